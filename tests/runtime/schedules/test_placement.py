"""Processes hosting several stages (interleaved-1f1b, zb-v): literal per-process orders
derived by hand, the bubble they leave under unit costs, validation and refusals."""
from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fxpipe.errors import ConfigError
from fxpipe.runtime.schedules.placed_orders import greedy_orders
from fxpipe.runtime.schedules.placement import (PlacedSchedule, make_placed_schedule, placement,
                                                process_order, simulate_placed, validate_placed)
from fxpipe.runtime.schedules.schedule import Action, DeadlockError, ScheduleError
from fxpipe.runtime.schedules.kinds import make_schedule
from fxpipe.runtime.schedules.simulate import simulate

UNIT = (1.0, 1.0, 1.0)


def test_interleaved_two_processes_two_chunks_four_microbatches_by_hand() -> None:
    """Megatron-LM's interleaved order, derived by hand from its definition (P = 2, v = 2, m =
    4; stage s on process s % 2). The k-th forward of a process is chunk (k mod 4) // 2 of
    microbatch (k // 4) * 2 + k mod 2: F0 F1 on chunk 0, F0 F1 on chunk 1, F2 F3 on chunk 0,
    F2 F3 on chunk 1; backwards walk the chunks in reverse (B0 B1 on chunk 1, B0 B1 on chunk
    0, ...). Warm-up forwards: (P - p - 1) * 2 + (v - 1) * P = 4 on process 0, 2 on process 1;
    then forward k + warm-up / backward k pairs; then the remaining backwards."""
    ps = make_placed_schedule("interleaved-1f1b", 2, 4, chunks=2, microbatches=4)
    assert ps.hosts == (((0, 0), (2, 0)), ((1, 0), (3, 0)))
    assert ps.grid() == [
        "p0  |F0@0 F1@0 F0@2 F1@2 F2@0 B0@2 F3@0 B1@2 F2@2 B0@0 F3@2 B1@0 B2@2 B3@2 B2@0 B3@0 "
        "U0@0 U0@2",
        "p1  |F0@1 F1@1 F0@3 B0@3 F1@3 B1@3 F2@1 B0@1 F3@1 B1@1 F2@3 B2@3 F3@3 B3@3 B2@1 B3@1 "
        "U0@1 U0@3"]
    # the per-rank lists are the projections, with 1f1b-flush's versions (all read version 0)
    assert " ".join(map(str, ps.schedule.actions[(2, 0)])) == "F0 F1 B0 B1 F2 F3 B2 B3 U0"
    assert {a.version for acts in ps.schedule.actions.values() for a in acts} == {0, 1}


def test_interleaved_second_batch_reads_the_first_update() -> None:
    ps = make_placed_schedule("interleaved-1f1b", 2, 8, chunks=2, microbatches=4)
    acts = ps.schedule.actions[(1, 0)]
    assert [(str(a), a.version) for a in acts if a.minibatch == 5 and a.kind != "U"] == \
        [("F5", 1), ("B5", 1)]
    assert [str(a) for a in acts if a.kind == "U"] == ["U0", "U1"]


@pytest.mark.parametrize("P,v,per", [(2, 2, 1), (2, 2, 2), (4, 2, 2), (2, 3, 2), (4, 4, 1)])
def test_interleaved_bubble_is_one_over_v_of_1f1b(P: int, v: int, per: int) -> None:
    """Chunk costs F = 1, B = 2: a process does 3vm of work; 1F1B on P stages each v times
    bigger has the bubble 3v(P - 1) (its makespan (m + P - 1) * 3v); interleaved's is 3(P - 1),
    1/v of it (Narayanan et al. 2021, eq. for t_pb)."""
    m = per * P
    ps = make_placed_schedule("interleaved-1f1b", P, m, chunks=v, microbatches=m)
    span, busy = simulate_placed(ps, [(1.0, 2.0, 0.0)] * (v * P))
    assert busy == [3.0 * v * m] * P
    assert span - 3 * v * m == 3 * (P - 1)
    flat = simulate(make_schedule("1f1b-flush", [1] * P, m, microbatches=m), [1.0 * v] * P,
                    [2.0 * v] * P)
    assert flat.makespan - 3 * v * m == 3 * v * (P - 1)


def _peak_chunks(ps: PlacedSchedule) -> int:
    """Most chunk activations a process holds at once (F done, its W not)."""
    peak = 0
    for steps in ps.order:
        held = 0
        for _, a in steps:
            held += (a.kind == "F") - (a.kind == "W")
            peak = max(peak, held)
    return peak


@pytest.mark.parametrize("P,per", [(2, 1), (2, 2), (3, 2), (4, 2), (4, 4), (8, 2)])
def test_zb_v_leaves_only_the_last_process_start_up(P: int, per: int) -> None:
    """F = B = W = 1: each process does 6m of work; process P - 1 hosts stages P - 1 and P and
    cannot start before minibatch 0 went through P - 1 stages, so 6m + P - 1 is the least
    makespan. With 2P minibatches admitted per process the greedy V reaches it; with the
    default P (at most 2P chunk activations held: 1F1B's memory, a chunk being half a stage)
    it stays within twice that start-up, far below interleaved 1F1B's on the same stages."""
    m = per * P
    ps = make_placed_schedule("zb-v", P, m, microbatches=m, limit=2 * P)
    assert ps.hosts == tuple(((p, 0), (2 * P - 1 - p, 0)) for p in range(P))
    span, busy = simulate_placed(ps, [UNIT] * (2 * P))
    assert busy == [6.0 * m] * P
    assert span == 6 * m + P - 1
    lean = make_placed_schedule("zb-v", P, m, microbatches=m)
    assert _peak_chunks(lean) <= 2 * P
    span, _ = simulate_placed(lean, [UNIT] * (2 * P))
    assert 6 * m + P - 1 <= span <= 6 * m + 2 * (P - 1)
    inter = make_placed_schedule("interleaved-1f1b", P, m, chunks=2, microbatches=m)
    assert span < simulate_placed(inter, [UNIT] * (2 * P))[0]


def test_zb_v_two_processes_by_hand() -> None:
    """P = 2, m = 2, F = B = W = 1 (stages 0, 3 on process 0; 1, 2 on process 1), from the
    rules (oldest ready B, else the deepest ready F, a new minibatch only while fewer than P =
    2 are admitted, else a W that delays nothing). t0: p0 F0@0. t1: p0 F1@0, p1 F0@1. t2: p1
    F0@2 (deeper than F1@1), p0 idle. t3: p0 F0@3 (F0@2 ended), p1 F1@1. t4: p0 B0@3, p1 F1@2. t5:
    p0 F1@3 (F1@2 ended at 5, ready: F before W), p1 B0@2. t6: p0 B1@3, p1 B0@1. t7: p0 B0@0, p1
    B1@2. t8: p0 W0@3 (B1@1 ends at 9: a W fits), p1 B1@1. t9: p0 B1@0, p1 W0@2 ... then the W's."""
    ps = make_placed_schedule("zb-v", 2, 2, microbatches=2)
    assert ps.grid() == [
        "p0  |F0@0 F1@0 F0@3 B0@3 F1@3 B1@3 B0@0 W0@3 B1@0 W0@0 W1@3 W1@0 U0@0 U0@3",
        "p1  |F0@1 F0@2 F1@1 F1@2 B0@2 B0@1 B1@2 B1@1 W0@2 W0@1 W1@2 W1@1 U0@1 U0@2"]
    assert simulate_placed(ps, [UNIT] * 4)[0] == 13.0


def test_interleaved_round_robin_on_three_stages() -> None:
    """S = 3 on P = 2: stages 0, 2 on process 0, stage 1 on process 1 (a greedy order with
    fused backwards, since Megatron's needs S = vP); valid, and one update per stage."""
    ps = make_placed_schedule("interleaved-1f1b", 2, 8, num_stages=3, microbatches=4)
    assert ps.hosts == (((0, 0), (2, 0)), ((1, 0),))
    assert {r: sum(a.kind == "U" for a in acts) for r, acts in ps.schedule.actions.items()} == \
        {(0, 0): 2, (1, 0): 2, (2, 0): 2}
    assert not any(a.kind == "W" for acts in ps.schedule.actions.values() for a in acts)
    assert len(process_order(ps)) == sum(len(o) for o in ps.order)


def test_refusals_say_what_to_do() -> None:
    with pytest.raises(ConfigError) as info:
        make_placed_schedule("interleaved-1f1b", 2, 6, chunks=2, microbatches=3)
    assert info.value.message == ("interleaved-1f1b with a batch of 3 microbatches on 2 "
                                  "processes")
    assert "multiple of the processes (2)" in (info.value.hint or "")
    with pytest.raises(ConfigError) as info:
        make_placed_schedule("zb-v", 2, 4, num_stages=3)
    assert info.value.message == "zb-v with 3 stages on 2 processes"
    assert "into 4 stages" in (info.value.hint or "")
    with pytest.raises(ConfigError, match="1 stages on 2 processes"):
        placement("interleaved-1f1b", 1, 2)
    with pytest.raises(ConfigError, match="'zb-h9' is not a placed kind"):
        make_placed_schedule("zb-h9", 2, 4)


def test_a_merged_order_that_deadlocks_is_caught() -> None:
    """A merged list that reorders a stage's own list is refused; two stages of one process
    merged in an order that waits on itself is a deadlock."""
    ps = make_placed_schedule("interleaved-1f1b", 2, 2, chunks=1, microbatches=2)
    order = list(ps.order)
    steps = list(order[1])  # process 1 (stage 1, the last): F0 B0 F1 B1 U0
    order[1] = tuple([steps[1], steps[0]] + steps[2:])
    bad = PlacedSchedule(ps.schedule, ps.hosts, tuple(order))
    with pytest.raises(ScheduleError, match="merged list runs stage 1"):
        validate_placed(bad)
    # two stages on one process in the wrong order: F0 of stage 1 before F0 of stage 0
    one = make_placed_schedule("interleaved-1f1b", 1, 1, chunks=2, microbatches=1)
    steps = list(one.order[0])
    swapped = (steps[1], steps[0]) + tuple(steps[2:])
    with pytest.raises(DeadlockError, match="process 0 stuck at F0 of stage 1 waiting for F0 "
                                            "on stage 0"):
        validate_placed(PlacedSchedule(one.schedule, one.hosts, (swapped,)))


def test_updates_come_after_every_w_of_the_batch() -> None:
    ps = make_placed_schedule("zb-v", 3, 12, microbatches=6)
    for acts in ps.schedule.actions.values():
        text = " ".join(map(str, acts))
        u0 = text.index("U0")
        assert all(text.index(f"W{k} ") < u0 for k in range(6))
        assert sum(a.kind == "W" for a in acts) == 12
    assert isinstance(ps.order[0][0][1], Action)


def test_replicated_placement_copies_the_pipeline() -> None:
    """R = 2 copies of zb-v on 2 processes: process j * P + p is copy j's p; copy j runs
    minibatches k = i * 2 + j in the order copy 0 runs i; each stage's two replicas meet at
    every update (process_order executes the U's together)."""
    one = make_placed_schedule("zb-v", 2, 4, microbatches=2)
    two = make_placed_schedule("zb-v", 2, 8, microbatches=4, replicas=2)
    assert two.hosts == (((0, 0), (3, 0)), ((1, 0), (2, 0)), ((0, 1), (3, 1)), ((1, 1), (2, 1)))
    assert two.schedule.replicas == (2, 2, 2, 2) and two.schedule.group == 4
    for p in range(2):
        for j in range(2):
            assert [(r[0], a.kind, a.minibatch if a.kind == "U" else a.minibatch * 2 + j)
                    for r, a in one.order[p]] == \
                [(r[0], a.kind, a.minibatch) for r, a in two.order[j * 2 + p]]
    span, busy = simulate_placed(two, [UNIT] * 4)
    assert (span, busy) == (simulate_placed(one, [UNIT] * 4)[0], [24.0] * 4)
    with pytest.raises(ConfigError) as info:
        make_placed_schedule("zb-v", 2, 8, microbatches=3, replicas=2)
    assert info.value.message == ("zb-v with 2 replicas, 3 microbatches per batch and 8 "
                                  "minibatches")


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_any_costs_and_message_times_give_a_valid_placed_schedule(data) -> None:
    """The greedy never gets stuck and always yields merged lists the processes can carry out:
    any process count, stage costs (zero ones included), message times and admission limit."""
    kind = data.draw(st.sampled_from(["zb-v", "interleaved-1f1b"]))
    P = data.draw(st.integers(1, 4))
    S = 2 * P if kind == "zb-v" else data.draw(st.integers(P, 3 * P))
    cost = st.floats(0.0, 3.0, allow_nan=False)
    costs = [data.draw(st.tuples(cost, cost, cost)) for _ in range(S)]
    comm = [data.draw(cost) for _ in range(S)]
    m = P * data.draw(st.integers(1, 3))
    limit = data.draw(st.integers(1, 2 * P))
    ps = make_placed_schedule(kind, P, 2 * m, num_stages=S, microbatches=m, limit=limit,
                              costs=costs, comm=comm)
    validate_placed(ps)
    span, busy = simulate_placed(ps, costs, comm)
    assert span >= max(busy) - 1e-9


def _refused(f) -> tuple[str, str | None]:
    with pytest.raises((ConfigError, ScheduleError)) as info:
        f()
    return info.value.message, info.value.hint


def test_every_refusal_names_the_value_and_what_to_do() -> None:
    """Each bad argument of the placement and of the greedy orders, with its exact message and
    hint (a wrong hint is a wrong instruction to the user)."""
    V, KINDS = "zb-v", "use one of ('interleaved-1f1b', 'zb-v', 'dualpipev')"
    split = "zb-v places two stages per process in a V: split the model into 4 stages"
    assert _refused(lambda: placement("interleaved-1f1b", 4, 0)) == (
        "4 stages on 0 processes", "give at least one stage per process")
    assert _refused(lambda: placement(V, 3, 2)) == ("zb-v with 3 stages on 2 processes", split)
    assert _refused(lambda: placement("zb-h1", 4, 2)) == ("'zb-h1' is not a placed kind", KINDS)
    for bad in (0, "2"):
        assert _refused(lambda: make_placed_schedule(V, 2, 4, replicas=bad)) == (
            f"replicas={bad!r}", "use 1 or more copies of the pipeline")
    share = ("both must be multiples of the replicas (2): each copy of the pipeline gets an "
             "equal share of every batch")
    assert _refused(lambda: make_placed_schedule(V, 2, 5, replicas=2, microbatches=6)) == (
        "zb-v with 2 replicas, 6 microbatches per batch and 5 minibatches", share)
    assert _refused(lambda: make_placed_schedule(V, 2, 6, replicas=2, microbatches=5)) == (
        "zb-v with 2 replicas, 5 microbatches per batch and 6 minibatches", share)
    assert _refused(lambda: make_placed_schedule(V, 0, 4)) == (
        "num_processes=0", "use 1 or more processes")
    assert _refused(lambda: make_placed_schedule("interleaved-1f1b", 2, 4, chunks=0)) == (
        "chunks=0", "use at least 1 chunk per process")
    counts = "use at least 1 microbatch per batch and 0 or more minibatches"
    assert _refused(lambda: make_placed_schedule(V, 2, 4, microbatches=0)) == (
        "microbatches=0, num_minibatches=4", counts)
    assert _refused(lambda: make_placed_schedule(V, 2, -1)) == (
        "microbatches=4, num_minibatches=-1", counts)
    hosts, mbs = (((0, 0), (3, 0)), ((1, 0), (2, 0))), [0, 1]
    assert _refused(lambda: greedy_orders(hosts, 4, mbs, 0, True)) == (
        "in-flight limit 0", "allow at least 1 in flight per process")
    for costs in ([UNIT] * 3, [(1.0, 1.0, -1.0)] * 4):
        assert _refused(lambda: greedy_orders(hosts, 4, mbs, 2, True, costs=costs)) == (
            f"costs={costs!r} needs one (F, B, W) >= 0 per stage",
            "e.g. [(1.0, 1.0, 1.0)] * stages")
    for comm in ([0.0] * 3, [0.0, -1.0, 0.0, 0.0]):
        assert _refused(lambda: greedy_orders(hosts, 4, mbs, 2, True, comm=comm)) == (
            f"comm={comm!r} needs one time >= 0 per stage (the cut into it)",
            "e.g. [0.0] * stages")


def test_validate_placed_refuses_each_broken_rule() -> None:
    """A valid interleaved schedule (stages 0, 2 on process 0; 1, 3 on process 1) broken one rule
    at a time."""
    ok = make_placed_schedule("interleaved-1f1b", 2, 4)
    assert ok.hosts == (((0, 0), (2, 0)), ((1, 0), (3, 0)))
    assert _refused(lambda: validate_placed(replace(ok, hosts=(ok.hosts[0], ok.hosts[1][:1])))
                    ) == ("hosted ranks [(0, 0), (1, 0), (2, 0)] != [(0, 0), (1, 0), (2, 0), "
                          "(3, 0)]", "place every stage on exactly one process")
    assert _refused(lambda: validate_placed(replace(ok, order=ok.order[:1]))) == (
        "1 merged lists for 2 processes", "give one merged list per process")
    backwards = (ok.order[0], tuple(reversed(ok.order[1])))
    assert _refused(lambda: validate_placed(replace(ok, order=backwards))) == (
        "process 1: its merged list runs stage 1 as U0 B3 B2 B1 F3 B0 F2 F1 F0, the stage's "
        "list is F0 F1 F2 B0 F3 B1 B2 B3 U0",
        "merge the hosted ranks' lists without reordering them")
    stray = (ok.order[0] + ok.order[1][:1], ok.order[1])
    assert _refused(lambda: validate_placed(replace(ok, order=stray))) == (
        "process 0 runs actions of stages [(1, 0)] it does not host",
        "a process runs only its own stages")
    assert _refused(lambda: ok.process_of((9, 0))) == (
        "rank (9, 0) is hosted by no process", "place every stage once")
    assert _refused(lambda: simulate_placed(ok, [UNIT] * 3)) == (
        "3 costs, 4 comm and 4 update times for 4 stages", "give one of each per stage")


def test_a_placed_schedule_is_a_frozen_picklable_value() -> None:
    """Spawned processes receive it pickled (its Schedule's read-only mapping is not picklable
    as such, hence __reduce__): the round trip gives an equal value; it cannot be changed."""
    import dataclasses
    import pickle

    for placed in (make_placed_schedule("zb-v", 2, 8),
                   make_placed_schedule("interleaved-1f1b", 2, 4, replicas=2, microbatches=4)):
        back = pickle.loads(pickle.dumps(placed))
        assert back == placed and back.kind == placed.kind
        assert back.schedule.actions == placed.schedule.actions
        assert (back.schedule.group, back.schedule.noam, back.schedule.windows) == (
            placed.schedule.group, placed.schedule.noam, placed.schedule.windows)
        with pytest.raises(dataclasses.FrozenInstanceError):
            placed.hosts = ()  # type: ignore[misc]


def test_defaults_and_the_remaining_refusals_exact() -> None:
    """m defaults to 2P microbatches per batch (2 P R with R copies); updates are never delayed
    (noam 1); 0 minibatches is an empty schedule, not an error; the remaining refusals by
    their exact text."""
    one, two = make_placed_schedule("zb-v", 2, 8), make_placed_schedule("zb-v", 2, 16, replicas=2)
    assert (one.schedule.group, one.schedule.noam) == (4, 1)
    assert (two.schedule.group, two.schedule.noam, two.num_processes) == (8, 1, 4)
    empty = make_placed_schedule("zb-v", 2, 0)
    assert empty.schedule.num_minibatches == 0 and all(not o for o in empty.order)
    assert _refused(lambda: make_placed_schedule("zb-h9", 2, 4)) == (
        "'zb-h9' is not a placed kind", "use one of ('interleaved-1f1b', 'zb-v', 'dualpipev')")
    assert _refused(lambda: make_placed_schedule("interleaved-1f1b", 2, 6, microbatches=3)) == (
        "interleaved-1f1b with a batch of 3 microbatches on 2 processes",
        "Megatron's interleaved order needs microbatches per batch (and num_minibatches) to be "
        "a multiple of the processes (2)")
    ok = make_placed_schedule("interleaved-1f1b", 2, 6, num_stages=3, microbatches=2)
    uneven = make_schedule("1f1b-flush", [1, 2, 1], 6)
    assert _refused(lambda: validate_placed(replace(ok, schedule=uneven))) == (
        "placed schedule with replicas [1, 2, 1]",
        "replicate the whole pipeline: every stage the same number of times")
    h = two.hosts  # copy j's process p is j * 2 + p; put both replicas of stage 3 on process 0
    assert h == (((0, 0), (3, 0)), ((1, 0), (2, 0)), ((0, 1), (3, 1)), ((1, 1), (2, 1)))
    both = (((3, 1), (3, 0)), h[1], ((0, 1), (0, 0)), h[3])
    assert _refused(lambda: validate_placed(replace(two, hosts=both))) == (
        "process 0 hosts several replicas of stage 3",
        "replicas of a stage all-reduce with each other: put them on different processes")
