"""Mitigations and auto under torchrun (2 gloo ranks) against the reference executor.

The distributed executor builds the same MitigatedReplica and the same compensated optimizers as
the reference one, so a pipedream+predict+dc+momentum run, and a pipedream+nesterov one with the
Muon recipe (Muon's and NAdam's Nesterov forms), with checkpoints, an LR scheduler and dropout
(trainer_job.py), must agree with the oracle to float tolerance; and schedule="auto" must
reach one decision on both ranks: without a pilot (too short a run: flush, each minibatch cut
into microbatches on both executors), with one split over the two ranks, whose merged curves must
give the single-process pilot's decision, row for row, and with the candidates trained in turn on
the job's own pipeline (no rank copies a stage), whose run must equal the reference executor's."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from rt_procs import HERE, _run, _torchrun

from fxpipe.runtime.training.auto import AutoOptions

pytestmark = [pytest.mark.multiprocess]


def test_mitigated_pipedream_distributed_equals_reference(tmp_path: Path) -> None:
    for i, (schedule, extra) in enumerate((("pipedream+predict+dc+momentum", []),
                                           ("pipedream+nesterov", ["--optimizer", "muon"]),
                                           ("auto", []), ("auto", ["--pilot", "12"]),
                                           ("auto", ["--pilot", "12", "--where", "pipeline"]),
                                           ("auto", ["--pilot", "6", "--where", "pipeline",
                                                     "--samples", "160", "--look-again", "1"]))):
        ref = _run([sys.executable, str(HERE / "trainer_job.py"), str(tmp_path / "ref.pt"),
                    "--ckpt", str(tmp_path / f"ref-{i}"), "--executor", "reference",
                    "--schedule", schedule, *extra])
        assert ref.returncode == 0, ref.stdout[-3000:]
        dist = _torchrun(str(tmp_path / "dist.pt"), "--ckpt", str(tmp_path / f"d-{i}"),
                         "--schedule", schedule, *extra)
        assert dist.returncode == 0, dist.stdout[-3000:]
        want = torch.load(tmp_path / "ref.pt", weights_only=False)
        got = torch.load(tmp_path / "dist.pt", weights_only=False)
        if schedule == "auto" and not extra:  # too short for a pilot: flush, each minibatch
            # of 4 cut into 2 microbatches (rank 1, holding only the targets, cuts by rank 0's
            # sizes): one update per minibatch on both executors
            assert (want["auto"].schedule, want["auto"].split) == ("1f1b-flush", 2)
            assert (got["auto"].schedule, got["auto"].split) == ("1f1b-flush", 2)
        if "--look-again" in extra:  # an asynchronous pick raced against flush again at
            # minibatch 12 of 40, on both executors alike (auto_look)
            a, b = want["auto"], got["auto"]
            assert a.schedule not in ("1f1b-flush", "gpipe", "zb-h1", "zb-h2")
            assert "looked again at minibatch 12" in a.later[-1]
            assert [x.split(" (")[0] for x in b.later] == [x.split(" (")[0] for x in a.later]
        elif "pipeline" in extra:  # the candidates in turn on each executor's own pipeline,
            # the winner going on from its pilot (7 minibatches: the first epoch's)
            a, b = want["auto"], got["auto"]
            assert (a.where, b.where, a.continued, b.continued) == ("pipeline",) * 2 + (7, 7)
            assert b.schedule == a.schedule and b.level == pytest.approx(a.level, rel=1e-6)
            assert [(r.schedule, r.minibatches) for r in b.rows] == \
                [(r.schedule, r.minibatches) for r in a.rows]
            assert {r.schedule for r in a.rows} == set(AutoOptions().candidates)
        elif "--pilot" in extra:  # the pilot ran: in one process, and split over the two ranks
            a, b = want["auto"], got["auto"]
            assert (a.pilot_ranks, b.pilot_ranks, a.pilot_minibatches) == (1, 2, 12)
            assert b.schedule == a.schedule and b.level == a.level
            assert [(r.schedule, r.minibatches, r.period_s) for r in b.rows] == \
                [(r.schedule, r.minibatches, r.period_s) for r in a.rows]
            assert {r.schedule for r in a.rows} == set(AutoOptions().candidates)
        for name, t in want["state"].items():
            torch.testing.assert_close(got["state"][name], t, rtol=1e-6, atol=1e-7, msg=name)
        assert [h["loss"] for h in got["history"]] == \
            pytest.approx([h["loss"] for h in want["history"]], rel=1e-6)
