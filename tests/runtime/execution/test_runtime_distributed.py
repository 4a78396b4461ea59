"""The distributed runtime (gloo, CPU, spawned processes) against the reference executor."""
from __future__ import annotations

import copy
import json
import logging

import pytest
import torch
from rt_helpers import batches, loss_fn, sgd, split, tiny_mlp

from fxpipe.runtime.schedules.ncclcheck import check_logs
from fxpipe.runtime.errors import WorkerFailedError
from fxpipe.runtime.execution.cores import usable_cores
from fxpipe.runtime.execution.launch import run_distributed
from fxpipe.runtime.execution.reference import ReferenceExecutor
from fxpipe.runtime.schedules.kinds import make_schedule
from fxpipe.runtime.timeline import busy_fraction, write_chrome_trace
from rt_faults import Die, Hang

pytestmark = [pytest.mark.multiprocess]

TIGHT = dict(rtol=1e-6, atol=1e-7)


def test_distributed_equals_reference_and_records_a_timeline(tmp_path) -> None:
    """8 pipedream minibatches on 2 stages through run_distributed (the launcher's own path;
    more schedules and pipelines in test_runtime_schedules.py), and the trace it writes."""
    data = batches(8)
    model = tiny_mlp()
    sched = make_schedule("pipedream", [1, 1], 8)
    ref = ReferenceExecutor(split(copy.deepcopy(model), [2]), [1, 1], sched, loss_fn,
                            sgd).run(data)
    got = run_distributed(split(copy.deepcopy(model), [2]), [1, 1], sched, loss_fn, sgd, data,
                          timeout_s=30, join_timeout_s=240, record_comm=True)
    torch.testing.assert_close(got.losses, ref.losses, **TIGHT)
    assert check_logs(got.comm_logs) == 2 * 2 * 8  # act + grad, each posted at both ends
    for rank in sched.ranks:
        torch.testing.assert_close(got.replica_params[rank], ref.replica_params[rank], **TIGHT)
    assert got.peak_bytes == ref.peak_bytes

    path = write_chrome_trace(got.timeline, tmp_path / "trace.json")
    trace = json.loads(path.read_text())
    complete = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    for pid in (0, 1):
        mine = sorted((e for e in complete if e["pid"] == pid), key=lambda e: e["ts"])
        for kind in "FB":
            names = sorted(e["name"] for e in mine if e["cat"] in ("forward", "backward")
                           and e["name"][0] == kind)
            assert names == sorted(f"{kind}{k}" for k in range(8)), (pid, names)
        for e in mine:
            assert e["dur"] >= 0 and {"stage", "replica"} <= set(e["args"])
        for a, b in zip(mine, mine[1:]):  # microsecond rounding: allow 0.002 us
            assert a["ts"] + a["dur"] <= b["ts"] + 2e-3, (a, b)
        cats = {e["cat"] for e in mine}
        assert {"forward", "backward", "optimizer"} <= cats
        assert ("send" in cats) and ("recv" in cats)
    busy = busy_fraction(got.timeline, steady_state=False)
    assert set(busy) == {0, 1}
    for rank, evs in got.timeline.items():  # F, B and U time over the rank's span
        compute = sum(e.end - e.start for e in evs if e.category in ("forward", "backward",
                                                                      "optimizer"))
        span = max(e.end for e in evs) - min(e.start for e in evs)
        assert busy[rank] == pytest.approx(compute / span, rel=1e-12)


def test_killed_rank_makes_the_others_fail_naming_it(caplog: pytest.LogCaptureFixture) -> None:
    sched = make_schedule("pipedream", [1, 1, 1], 8)
    caplog.set_level(logging.WARNING, logger="fxpipe.runtime.execution.cores")
    with pytest.raises(WorkerFailedError) as info:
        run_distributed(split(tiny_mlp(), [1, 3]), [1, 1, 1], sched, loss_fn, sgd, batches(8),
                        timeout_s=5, join_timeout_s=120, hooks={1: Die(3)})
    err = info.value
    # the survivors exit by themselves (a positive code; the launcher's terminate after
    # join_timeout_s would show as a negative signal number), each naming the dead rank
    assert err.exitcodes[1] == 17 and err.exitcodes[0] > 0 and err.exitcodes[2] > 0
    for i in (0, 2):
        assert "stage 1 replica 0 (rank 1)" in err.errors[i], err.errors[i]
    # 3 one-thread ranks on a host of fewer cores are named before they start (cores.py)
    said = [r.getMessage() for r in caplog.records if "CPU ranks x 1 thread(s)" in r.getMessage()]
    assert len(said) == (1 if usable_cores() < 3 else 0), said


def test_hung_rank_times_out_naming_it() -> None:
    sched = make_schedule("pipedream", [1, 1], 4)
    with pytest.raises(WorkerFailedError) as info:
        run_distributed(split(tiny_mlp(), [2]), [1, 1], sched, loss_fn, sgd, batches(4),
                        timeout_s=2, join_timeout_s=120, hooks={1: Hang(1)})
    err = info.value
    assert err.exitcodes[0] == 1
    assert "stage 1 replica 0 (rank 1)" in err.errors[0] and "timeout 2 s" in err.errors[0]
