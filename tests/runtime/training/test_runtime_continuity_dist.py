"""Continuity and overlap on real processes (issue 27): pipedream on 2 torchrun ranks, one epoch
read in segments of 4 minibatches, timelines on. No drain at the segment boundaries (stage 0
still has its window of minibatches in flight at each), the same weights as the reference
executor and as one segment per epoch, and every gradient's receive posted before the forward
that runs while that gradient is on its way (the overlap the message order exists for)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from rt_procs import HERE, ROOT, _port

pytestmark = [pytest.mark.multiprocess]


def _job(out: Path, segment: int, reference: bool = False) -> None:
    out.mkdir(parents=True, exist_ok=True)
    cmd = ([sys.executable, str(HERE / "continuity_job.py"), str(out), str(segment),
            "--executor", "reference"] if reference else
           [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
            "--master-addr=127.0.0.1", f"--master-port={_port()}",
            str(HERE / "continuity_job.py"), str(out), str(segment)])
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=ROOT,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]


def test_segments_do_not_drain_the_pipeline_and_receives_are_posted_early(tmp_path: Path
                                                                          ) -> None:
    _job(tmp_path / "seg4", 4)
    _job(tmp_path / "ref", 4, reference=True)
    _job(tmp_path / "whole", 16, reference=True)
    ranks = [torch.load(tmp_path / "seg4" / f"rank{i}.pt", weights_only=False) for i in (0, 1)]
    ref = torch.load(tmp_path / "ref" / "rank0-ref.pt", weights_only=False)["weights"]
    whole = torch.load(tmp_path / "whole" / "rank0-ref.pt", weights_only=False)["weights"]
    got = {}  # each rank wrote its own stage back: Linear 0 on stage 0, Linears 2 and 4 on 1
    stage_of = {0: ("0.",), 1: ("2.", "4.")}
    for r in ranks:
        for name, t in r["weights"].items():
            if name.startswith(stage_of[r["stage"]]):
                got[name] = t
    assert sorted(got) == sorted(ref)
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=1e-6, atol=1e-7, msg=name)
        torch.testing.assert_close(ref[name], whole[name], rtol=1e-12, atol=1e-12, msg=name)

    stage0 = next(r for r in ranks if r["stage"] == 0)
    segments = stage0["events"]
    assert len(segments) == 5  # 16 minibatches in windows of 4, then the epoch end's drain
    in_flight, seen = [], 0
    for tl in segments:
        seen += sum(c == "forward" for c, *_ in tl) - sum(c == "backward" for c, *_ in tl)
        in_flight.append(seen)
    assert in_flight == [2, 2, 2, 2, 0]  # stage 0's window at every boundary; drained at the end

    events = [e for tl in segments for e in tl]
    start = {mb: s for c, _, s, _, mb, _ in events if c == "forward"}
    waits = [(name, posted) for c, name, s, e, mb, posted in events
             if c == "recv" and name.startswith("recv gradient")]
    assert len(waits) == 16
    early = []
    for name, posted in waits:  # 'recv gradient 'h' of minibatch k': posted before F(k+1)
        k = int(name.rsplit(" ", 1)[1])
        if k + 1 in start:
            early.append(posted < start[k + 1])
    assert early == [True] * 15  # gradients travel on their own channel (comm.CHANNELS)
