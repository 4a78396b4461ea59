"""Mitigations and auto under torchrun (2 gloo ranks) against the reference executor.

The distributed executor builds the same MitigatedReplica and the same compensated optimizers as
the reference one, so a pipedream+predict+dc+momentum run (with checkpoints, an LR scheduler and
dropout, trainer_job.py) must agree with the oracle to float tolerance; and schedule="auto" must
reach one decision on both ranks."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from test_runtime_trainer_dist import HERE, _run, _torchrun


def test_mitigated_pipedream_distributed_equals_reference(tmp_path: Path) -> None:
    for schedule in ("pipedream+predict+dc+momentum", "auto"):
        ref = _run([sys.executable, str(HERE / "trainer_job.py"), str(tmp_path / "ref.pt"),
                    "--ckpt", str(tmp_path / f"ref-{schedule}"), "--executor", "reference",
                    "--schedule", schedule])
        assert ref.returncode == 0, ref.stdout[-3000:]
        dist = _torchrun(str(tmp_path / "dist.pt"), "--ckpt", str(tmp_path / f"d-{schedule}"),
                         "--schedule", schedule)
        assert dist.returncode == 0, dist.stdout[-3000:]
        want = torch.load(tmp_path / "ref.pt", weights_only=True)
        got = torch.load(tmp_path / "dist.pt", weights_only=True)
        for name, t in want["state"].items():
            torch.testing.assert_close(got["state"][name], t, rtol=1e-6, atol=1e-7, msg=name)
        assert [h["loss"] for h in got["history"]] == \
            pytest.approx([h["loss"] for h in want["history"]], rel=1e-6)
