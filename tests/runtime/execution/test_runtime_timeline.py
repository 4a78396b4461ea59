"""The timeline: recording, idle gaps, Chrome/Perfetto trace, busy fractions (no processes)."""
from __future__ import annotations

import json

import pytest
from rt_helpers import batches, loss_fn, sgd, split, tiny_mlp

from fxpipe.errors import ConfigError
from fxpipe.runtime.execution.reference import ReferenceExecutor
from fxpipe.runtime.schedules.kinds import make_schedule
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
    """Busy only in the middle: the steady-state window is the middle half of F/B events.
    F_i starts at 10 i and lasts 10 for i in 2..5, else 1. Whole span: 0..71, busy 4 * 10 + 4 *
    1 = 44. Steady window: from the start of F_2 (8 // 4 = 2) to the end of F_5
    (ceil(3 * 8 / 4) - 1 = 5): 20..60, all of it busy."""
    evs = [TimelineEvent("forward", f"F{i}", 10.0 * i, 10.0 * i + (10 if 2 <= i < 6 else 1))
           for i in range(8)]
    assert busy_fraction({3: evs}, steady_state=True) == {3: 1.0}
    assert busy_fraction({3: evs}, steady_state=False) == {3: 44 / 71}


def test_steady_window_clips_events_and_counts_only_compute() -> None:
    """Four F/B events at 0-2, 4-6, 8-10, 12-14 plus an optimizer step 6-7, a send 10-11 and idle
    11-12. Steady window: start of event 1 (4) to end of event 2 (ceil(3) - 1 = 2): 4..10, of
    which forward/backward 4 + optimizer 1 = 5 busy (the send is not compute): 5/6. Whole span
    0..14: 2 * 4 + 1 = 9 busy of 14."""
    evs = [TimelineEvent("forward", "F0", 0.0, 2.0), TimelineEvent("forward", "F1", 4.0, 6.0),
           TimelineEvent("optimizer", "U0", 6.0, 7.0), TimelineEvent("backward", "B0", 8.0, 10.0),
           TimelineEvent("send", "B0", 10.0, 11.0), TimelineEvent("idle", "", 11.0, 12.0),
           TimelineEvent("backward", "B1", 12.0, 14.0)]
    assert busy_fraction({0: evs}) == {0: 5 / 6}
    assert busy_fraction({0: evs}, steady_state=False) == {0: 9 / 14}
    # fewer than 4 forward/backward events: the whole span, even when asked for steady state
    assert busy_fraction({0: evs[:3]}) == {0: 5 / 7}


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
    # the whole-run busy fraction is each rank's F, B and U time over its span: stage 0 waits
    # for stage 1's backwards, so strictly less than 1
    busy = busy_fraction(res.timeline, steady_state=False)
    for rank, evs in res.timeline.items():
        compute = sum(e.end - e.start for e in evs if e.category in ("forward", "backward",
                                                                      "optimizer"))
        span = max(e.end for e in evs) - min(e.start for e in evs)
        assert busy[rank] == pytest.approx(compute / span, rel=1e-12)
        assert [e.category for e in evs].count("idle") >= 1 and busy[rank] < 1


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
