"""The timeline: recording, idle gaps, Chrome/Perfetto trace, busy fractions (no processes)."""
from __future__ import annotations

import json

import pytest
from rt_helpers import batches, loss_fn, sgd, split, tiny_mlp

from fxpipe.errors import ConfigError
from fxpipe.runtime.reference import ReferenceExecutor
from fxpipe.runtime.schedule import make_schedule
from fxpipe.runtime.timeline import (Recorder, TimelineEvent, busy_fraction, to_chrome_trace,
                                     totals, write_chrome_trace)


def test_recorder_fills_gaps_with_idle() -> None:
    rec = Recorder(0.0, args={"stage": 0})
    rec.add("forward", "F0", 1.0, 2.0, minibatch=0)
    rec.add("backward", "B0", 3.0, 5.0, minibatch=0)
    evs = rec.finish()
    assert [(e.category, e.start, e.end) for e in evs] == [
        ("forward", 1.0, 2.0), ("idle", 2.0, 3.0), ("backward", 3.0, 5.0)]
    assert evs[0].args == {"stage": 0, "minibatch": 0}
    assert totals(evs)["idle"] == 1.0
    assert busy_fraction({0: evs}, steady_state=False) == {0: 0.75}
    assert Recorder(enabled=False).finish() == []


def test_steady_state_ignores_fill_and_drain() -> None:
    """Busy only in the middle: the steady-state window is the middle half of F/B events."""
    evs = [TimelineEvent("forward", f"F{i}", 10.0 * i, 10.0 * i + (10 if 2 <= i < 6 else 1))
           for i in range(8)]
    assert busy_fraction({3: evs}, steady_state=True)[3] == pytest.approx(1.0)
    assert busy_fraction({3: evs}, steady_state=False)[3] < 0.7


def test_reference_run_trace(tmp_path) -> None:
    sched = make_schedule("1f1b-flush", [1, 1], 8, microbatches=4)
    res = ReferenceExecutor(split(tiny_mlp(), [2]), [1, 1], sched, loss_fn, sgd).run(batches(8))
    path = write_chrome_trace(res.timeline, tmp_path / "sub" / "t.json",
                              names={0: "stage 0", 1: "stage 1"})
    trace = json.loads(path.read_text())
    assert trace == to_chrome_trace(res.timeline, names={0: "stage 0", 1: "stage 1"})
    xs = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    for pid in (0, 1):
        names = sorted(e["name"] for e in xs if e["pid"] == pid
                       and e["cat"] in ("forward", "backward"))
        assert names == sorted([f"F{k}" for k in range(8)] + [f"B{k}" for k in range(8)])
        assert sum(e["cat"] == "optimizer" for e in xs if e["pid"] == pid) == 2
    meta = [e for e in trace["traceEvents"] if e["ph"] == "M" and e["name"] == "process_name"]
    assert {e["args"]["name"] for e in meta} == {"stage 0", "stage 1"}
    assert all(0 < b <= 1 for b in busy_fraction(res.timeline).values())


def test_empty_timeline_is_an_error(tmp_path) -> None:
    with pytest.raises(ConfigError, match="empty timeline"):
        write_chrome_trace({}, tmp_path / "t.json")


def test_background_events_get_a_track_of_their_own() -> None:
    """Bucketed all-reduces overlap the backward: they are drawn on a separate track, so the
    rank's own track stays sequential."""
    own = {0: [TimelineEvent("backward", "B0", 0.0, 2.0)]}
    bg = {0: [TimelineEvent("allreduce", "bucket 0", 1.0, 3.0, {"async": True})]}
    trace = to_chrome_trace(own, background=bg)
    xs = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    (b,) = [e for e in xs if e["name"] == "B0"]
    (a,) = [e for e in xs if e["name"] == "bucket 0"]
    assert a["tid"] != b["tid"] and a["ts"] == 1e6 < b["ts"] + b["dur"]
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert "allreduce (overlapped)" in names
