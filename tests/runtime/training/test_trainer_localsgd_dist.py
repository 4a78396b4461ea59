"""``Trainer(schedule="localsgd")`` under torchrun: R = 2 copies of a 2- and a 4-stage pipeline
(4 and 8 gloo ranks) train what the reference executor trains, and a run that crashed after a
checkpoint resumes to exactly the uninterrupted run's weights (each replica's optimizer state
saved beside its stage's file)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from rt_procs import HERE, _run, _torchrun

LOCAL = ["--schedule", "localsgd", "--replicas", "2", "--average-every", "2", "--dropout", "0"]
"""No dropout: a replica's masks come from its own rank's generator under torchrun, and from the
one process's under the reference executor."""


@pytest.mark.multiprocess
@pytest.mark.parametrize("stages", [2, 4])
def test_localsgd_under_torchrun_equals_reference_and_resumes_exactly(tmp_path: Path,
                                                                      stages: int) -> None:
    args = [*LOCAL, "--stages", str(stages)]
    nproc = 2 * stages
    ref = _run([sys.executable, str(HERE / "trainer_job.py"), str(tmp_path / "ref.pt"),
                "--ckpt", str(tmp_path / "ref"), "--executor", "reference", *args])
    assert ref.returncode == 0, ref.stdout[-3000:]
    full = _torchrun(str(tmp_path / "full.pt"), "--ckpt", str(tmp_path / "full"), *args,
                     nproc=nproc)
    assert full.returncode == 0, full.stdout[-3000:]
    # checkpoints at (0, 4), (1, 0), (1, 4): the crash follows the second, mid-run
    crashed = _torchrun(str(tmp_path / "run.pt"), "--ckpt", str(tmp_path / "run"), *args,
                        "--crash-after", "2", nproc=nproc)
    assert crashed.returncode != 0 and not (tmp_path / "run.pt").exists()
    assert (tmp_path / "run" / "e0001-m0000000" / "stage0-replica1.pt").is_file()
    resumed = _torchrun(str(tmp_path / "run.pt"), "--ckpt", str(tmp_path / "run"), *args,
                        "--resume", nproc=nproc)
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    want = torch.load(tmp_path / "full.pt", weights_only=True)
    got = torch.load(tmp_path / "run.pt", weights_only=True)
    oracle = torch.load(tmp_path / "ref.pt", weights_only=True)
    assert want["state"].keys() == oracle["state"].keys()
    for name, t in want["state"].items():
        assert torch.equal(got["state"][name], t), name
        torch.testing.assert_close(oracle["state"][name], t, rtol=1e-6, atol=1e-7)
    assert [h["loss"] for h in got["history"]] == [h["loss"] for h in want["history"]]
    for h, r in zip(want["history"], oracle["history"]):
        assert h["loss"] == pytest.approx(r["loss"], rel=1e-6)
