"""The placed kinds' checks by their exact words: the flush rule, the deadlock report of
process_order (an all-reduce that never meets, a list cut short) and the order it executes
the merged lists in, each derived by hand from the definitions in runtime/schedules/placement.py."""
from __future__ import annotations

import pytest

from fxpipe.errors import ConfigError
from fxpipe.runtime.schedules.placement import (PlacedSchedule, make_placed_schedule, process_order,
                                                validate_placed)
from fxpipe.runtime.schedules.schedule import DeadlockError, ScheduleError, validate


def _deadlock(placed: PlacedSchedule, validating: bool = True) -> DeadlockError:
    """The DeadlockError of ``placed`` (through validate_placed, or process_order alone)."""
    with pytest.raises(DeadlockError) as info:
        (validate_placed if validating else process_order)(placed)
    return info.value


def test_megatron_refusal_names_the_first_batch_that_is_not_a_multiple() -> None:
    """5 minibatches, m = 4 on P = 2: batches [0..3] (4, a multiple of 2) and [4] (1, not):
    the refusal names the uneven one, 1 microbatch, not the first batch."""
    with pytest.raises(ConfigError) as info:
        make_placed_schedule("interleaved-1f1b", 2, 5, chunks=2, microbatches=4)
    assert info.value.message == "interleaved-1f1b with a batch of 1 microbatches on 2 processes"
    assert info.value.hint == ("Megatron's interleaved order needs microbatches per batch (and "
                               "num_minibatches) to be a multiple of the processes (2)")


def _w3_behind_u0(stage: int) -> PlacedSchedule:
    """zb-v on one process (stages 0 and 1), 8 minibatches, m = 4, with W3 of ``stage`` moved
    behind that stage's U0: batch 0 would be applied without minibatch 3's weight gradients.
    The per-rank rules alone accept it (checked here); only the flush rule refuses it."""
    ps = make_placed_schedule("zb-v", 1, 8, microbatches=4)
    steps = list(ps.order[0])
    i = next(i for i, (r, a) in enumerate(steps) if r == (stage, 0) and str(a) == "W3")
    u = next(i for i, (r, a) in enumerate(steps) if r == (stage, 0) and str(a) == "U0")
    moved = steps[:i] + steps[i + 1:u + 1] + [steps[i]] + steps[u + 1:]
    acts = dict(ps.schedule.actions)
    acts[(stage, 0)] = tuple(a for r, a in moved if r == (stage, 0))
    sched = type(ps.schedule)(ps.kind, ps.schedule.replicas, 8, acts, 4)
    validate(sched)
    return PlacedSchedule(sched, ps.hosts, (tuple(moved),))


def test_a_w_after_its_batch_update_is_refused() -> None:
    """Not minibatch SGD: refused."""
    with pytest.raises(ScheduleError, match="W3 on stage 0 replica 0 after 1 updates"):
        validate_placed(_w3_behind_u0(0))


def test_flush_refusal_names_stage_replica_and_batch_exactly() -> None:
    """W3 of stage 1 behind U0 runs after 1 update, yet minibatch 3 belongs to batch 3 // 4 =
    0. Stage 1, replica 0: the message must tell them apart."""
    with pytest.raises(ScheduleError) as info:
        validate_placed(_w3_behind_u0(1))
    assert info.value.message == ("W3 on stage 1 replica 0 after 1 updates: minibatch 3 belongs "
                                  "to batch 0")
    assert info.value.hint == "a flushing schedule runs batch b between U<b-1> and U<b>"


HINT = "reorder the merged lists so each process's next action can become ready"


def test_an_all_reduce_that_never_meets_is_a_deadlock_waiting_for_nothing() -> None:
    """Two copies (R = 2) of zb-v on one process: process j hosts (0, j) and (1, j) and ends its
    list with U0@0 U0@1. Process 1 swapped to U0@1 U0@0: process 0 waits at stage 0's
    all-reduce for process 1, which waits at stage 1's for process 0. An update needs no data,
    so each waits for "nothing"; both are named, process order, joined by "; "."""
    ps = make_placed_schedule("zb-v", 1, 2, microbatches=2, replicas=2)
    assert ps.hosts == (((0, 0), (1, 0)), ((0, 1), (1, 1)))
    assert [f"{a}@{r[0]}" for r, a in ps.order[1][-2:]] == ["U0@0", "U0@1"]
    order = (ps.order[0], ps.order[1][:-2] + (ps.order[1][-1], ps.order[1][-2]))
    err = _deadlock(PlacedSchedule(ps.schedule, ps.hosts, order))
    assert err.message == ("deadlock: process 0 stuck at U0 of stage 0 waiting for nothing; "
                           "process 1 stuck at U0 of stage 1 waiting for nothing")
    assert err.hint == HINT
    assert {r: str(a) for r, a in err.stuck.items()} == {(0, 0): "U0", (1, 1): "U0"}


def test_a_deadlock_names_the_minibatch_and_the_stage_it_waits_on() -> None:
    """One process, two chunks (stages 0, 1), m = 2: Megatron's order with warm-up
    (P - p - 1) * 2 + (v - 1) * P = 1 forward, forward k of chunk k mod 2 on minibatch k // 2:
    F0@0, then F0@1 B0@1, F1@0 B0@0, F1@1 B1@1, then B1@0. Moving F1@1 before F1@0 (each
    stage's own list unchanged) leaves the process at F1 of stage 1 waiting for F1 on stage 0."""
    one = make_placed_schedule("interleaved-1f1b", 1, 2, chunks=2, microbatches=2)
    assert one.grid() == ["p0  |F0@0 F0@1 B0@1 F1@0 B0@0 F1@1 B1@1 B1@0 U0@0 U0@1"]
    s = one.order[0]
    swapped = s[:3] + (s[5], s[3], s[4]) + s[6:]
    err = _deadlock(PlacedSchedule(one.schedule, one.hosts, (swapped,)))
    assert err.message == "deadlock: process 0 stuck at F1 of stage 1 waiting for F1 on stage 0"
    assert err.hint == HINT


def test_a_peer_whose_list_ended_leaves_the_all_reduce_stuck() -> None:
    """The same two copies, process 1's list cut before its last update (U0@1): process 0 runs
    stage 0's all-reduce with process 1, then waits at stage 1's for a process whose list is
    over. process_order reports it (it does not run off the end of process 1's list)."""
    ps = make_placed_schedule("zb-v", 1, 2, microbatches=2, replicas=2)
    cut = PlacedSchedule(ps.schedule, ps.hosts, (ps.order[0], ps.order[1][:-1]))
    err = _deadlock(cut, validating=False)
    assert err.message == "deadlock: process 0 stuck at U0 of stage 1 waiting for nothing"
    assert {r: str(a) for r, a in err.stuck.items()} == {(1, 0): "U0"}


def test_process_order_runs_each_list_on_and_meets_at_all_reduces() -> None:
    """Two copies of a one-stage pipeline, 4 minibatches, m = 2 (one per copy per batch):
    process 0 runs F0 B0 U0 F2 B2 U1, process 1 F1 B1 U0 F3 B3 U1. The execution walks the
    processes in turn, each as far as it can: process 0 runs F0 B0 and waits at U0; process 1
    runs F1 B1, reaches U0, where both U0's run, and goes on: F3 B3, then waits at U1. The next
    round: process 0 runs F2 B2, reaches U1, both U1's run."""
    ps = make_placed_schedule("interleaved-1f1b", 1, 4, chunks=1, microbatches=2, replicas=2)
    assert ps.grid() == ["p0  |F0@0 B0@0 U0@0 F2@0 B2@0 U1@0", "p1  |F1@0 B1@0 U0@0 F3@0 B3@0 U1@0"]
    assert process_order(ps) == [(0, 0), (0, 1), (1, 0), (1, 1), (0, 2), (1, 2), (1, 3), (1, 4),
                                 (0, 3), (0, 4), (0, 5), (1, 5)]


def test_an_all_reduce_meets_the_processes_of_its_own_stage() -> None:
    """Two copies of a 3-process pipeline (one stage each): copy j's process p is 3j + p, and
    stage s's all-reduce is processes s and 3 + s, no others (stage 2's replicas share no
    process with stage 0's or 1's). The schedule is valid, and each update of stage s runs on
    both of its processes back to back in the execution order."""
    ps = make_placed_schedule("interleaved-1f1b", 3, 6, chunks=1, microbatches=6, replicas=2)
    assert ps.hosts == (((0, 0),), ((1, 0),), ((2, 0),), ((0, 1),), ((1, 1),), ((2, 1),))
    out = process_order(ps)
    for s in range(3):
        at = [out.index((p, len(ps.order[p]) - 1)) for p in (s, 3 + s)]
        assert str(ps.order[s][-1][1]) == "U0" and at[1] == at[0] + 1


def test_a_w_before_its_b_waits_for_that_b() -> None:
    """process_order on its own (validate_placed refuses such lists earlier): zb-v on one
    process, m = 1, unit costs: F0@0 F0@1 B0@1, then B0@0 (a B before any W), W0@1 W0@0. With
    W0@1 moved before B0@1 the W of stage 1 waits for B0 of stage 1 (not for the B's own input,
    F0 there, which has run)."""
    ps = make_placed_schedule("zb-v", 1, 1, microbatches=1)
    s = ps.order[0]
    assert [f"{a}@{r[0]}" for r, a in s] == ["F0@0", "F0@1", "B0@1", "B0@0", "W0@1", "W0@0",
                                             "U0@0", "U0@1"]
    early = PlacedSchedule(ps.schedule, ps.hosts, (s[:2] + (s[4], s[2], s[3]) + s[5:],))
    err = _deadlock(early, validating=False)
    assert err.message == "deadlock: process 0 stuck at W0 of stage 1 waiting for B0 on stage 1"
