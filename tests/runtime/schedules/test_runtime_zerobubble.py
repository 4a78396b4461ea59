"""Zero-bubble schedules (ZB-H1, ZB-H2): literal tables, the bubble they leave, and training
that equals the reference executor and minibatch SGD (every W before its batch's update)."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import torch
from rt_helpers import SkipMLP, batches, loss_fn, sgd, split, tiny_mlp
from rt_spawn import Job, run_jobs
from rt_tied import TiedLM, ce, plain_sgd_groups, sgd_m, token_batches

from fxpipe.errors import ConfigError
from fxpipe.runtime.schedules import zerobubble
from fxpipe.runtime.execution.buckets import last_backwards
from fxpipe.runtime.pricing.plansim import peak_in_flight
from fxpipe.runtime.execution.reference import ReferenceExecutor
from fxpipe.runtime.schedules.schedule import Action, Schedule, ScheduleError, split_ranks, validate
from fxpipe.runtime.schedules.kinds import make_schedule
from fxpipe.runtime.schedules.simulate import format_grid, simulate

TIGHT = dict(rtol=1e-6, atol=1e-7)


def table(sched: Schedule) -> dict[tuple[int, int], str]:
    return {rank: " ".join(map(str, acts)) for rank, acts in sched.actions.items()}


# ----------------------------------------------------------------------------- as data

def test_zb_h1_two_stages_by_hand() -> None:
    """F = B = W = 1, 1F1B's windows (2, 1): stage 1 runs F B W at once (one minibatch in
    flight); stage 0 admits two, and its W's fill the slot a B is not there yet."""
    s = make_schedule("zb-h1", [1, 1], 4, microbatches=4)
    assert table(s) == {(0, 0): "F0 F1 B0 W0 F2 B1 W1 F3 B2 W2 B3 W3 U0",
                        (1, 0): "F0 B0 W0 F1 B1 W1 F2 B2 W2 F3 B3 W3 U0"}
    assert s.windows == (2, 1) and split_ranks(s) == {(0, 0), (1, 0)}


def test_zb_h2_two_stages_by_hand() -> None:
    """Three in flight per stage (2 x 2 - 1): stage 0's third F fills the start-up; stage 1
    puts its W's off while B's are to be done, and every slot is busy but the first of stage 1
    and the last of stage 0: makespan 3m + S - 1 = 13."""
    s = make_schedule("zb-h2", [1, 1], 4, microbatches=4)
    assert table(s) == {(0, 0): "F0 F1 F2 B0 W0 B1 F3 B2 W1 W2 B3 W3 U0",
                        (1, 0): "F0 B0 F1 B1 F2 B2 W0 F3 B3 W1 W2 W3 U0"}
    assert format_grid(s).splitlines() == [
        "s0r0  |F0 F1 F2 B0 W0 B1 F3 B2 W1 W2 B3 W3  .",
        "s1r0  | . F0 B0 F1 B1 F2 B2 W0 F3 B3 W1 W2 W3"]


def test_zb_h2_keeps_a_w_where_a_message_is_still_on_the_wire() -> None:
    """As above, but a message takes 1 s across the cut (activations and gradients). By hand
    from the rules (F = B = W = 1, three in flight): stage 1 runs F0 at 2 (its input left stage
    0 at 1), B0, F1 at 4, B1, F2 at 6, B2, then W0 at 8 (three in flight: no F). At 9 F3 is not
    there yet (stage 0 ran F3 from 8 to 9, so it arrives at 10) and W1 ends by then, so W1 goes
    first; without the wire F3 would be there at 9. Stage 0: B0 at 5 (stage 1's B0 ended at 4),
    W0 at 6 (B1 arrives at 7), B1, F3 at 8 (B2 arrives at 9), B2, W1, W2 while B3 travels (12 ->
    13), B3, W3."""
    s = make_schedule("zb-h2", [1, 1], 4, microbatches=4, comm=[0.0, 1.0])
    assert table(s) == {(0, 0): "F0 F1 F2 B0 W0 B1 F3 B2 W1 W2 B3 W3 U0",
                        (1, 0): "F0 B0 F1 B1 F2 B2 W0 W1 F3 B3 W2 W3 U0"}
    # Three stages, 0.5 s into stages 1 and 2 (five in flight: no F waits for memory). Stage 2
    # runs F0 B0 at 3 (F0 of stage 1 ended at 2.5), then each F as it arrives and its B. Stage
    # 1's B0 is there only at 5.5 (stage 2's B0 ended at 5), so F3 (there at 4.5) goes first
    # (without the wire B0 is there at 4, before F3); then each W fits exactly while the next
    # B travels: W0 at 6.5 (B1 there at 7.5), W1 at 8.5, W2 at 10.5. Stage 0 likewise.
    s = make_schedule("zb-h2", [1, 1, 1], 4, microbatches=4, comm=[0.0, 0.5, 0.5])
    assert table(s) == {(0, 0): "F0 F1 F2 F3 B0 W0 B1 W1 B2 W2 B3 W3 U0",
                        (1, 0): "F0 F1 F2 F3 B0 W0 B1 W1 B2 W2 B3 W3 U0",
                        (2, 0): "F0 B0 F1 B1 F2 B2 F3 B3 W0 W1 W2 W3 U0"}
    assert table(make_schedule("zb-h2", [1, 1, 1], 4, microbatches=4))[(1, 0)] == \
        "F0 F1 F2 B0 F3 B1 W0 B2 W1 B3 W2 W3 U0"


def test_a_w_that_would_delay_an_arriving_f_waits() -> None:
    """Two stages, three in flight, 1.5 s across the cut, stage 1's W takes 2 s. By hand: stage
    1 runs F0 at 2.5, B0, F1, B1, F2, B2 (ends 8.5), W0 until 10.5 (no F: three in flight).
    Stage 0 ran F3 from 9 to 10, so F3 reaches stage 1 at 11.5: W1 from 10.5 would end at
    12.5 and delay it, so stage 1 idles and runs F3 B3 first, then W1 W2 W3."""
    s = make_schedule("zb-h2", [1, 1], 4, microbatches=4,
                      costs=[(1.0, 1.0, 1.0), (1.0, 1.0, 2.0)], comm=[0.0, 1.5])
    assert table(s) == {(0, 0): "F0 F1 F2 B0 W0 B1 F3 B2 W1 W2 B3 W3 U0",
                        (1, 0): "F0 B0 F1 B1 F2 B2 W0 F3 B3 W1 W2 W3 U0"}


@pytest.mark.parametrize("stages", [2, 3, 4, 8])
@pytest.mark.parametrize("per", [1, 2, 4])
def test_zb_h2_leaves_only_the_last_stages_start_up(stages: int, per: int) -> None:
    """Balanced stages, F = B = W = 1: each stage does 3m slots of work and the last one
    cannot start before slot S - 1, so 3m + S - 1 is the least makespan; ZB-H2 reaches it,
    ZB-H1 and 1F1B do not (1F1B: (m + S - 1)(F + B + W))."""
    m = per * stages
    unit = ([1.0] * stages, [2.0] * stages)
    zb2 = simulate(make_schedule("zb-h2", [1] * stages, m, microbatches=m), *unit).makespan
    zb1 = simulate(make_schedule("zb-h1", [1] * stages, m, microbatches=m), *unit).makespan
    fused = simulate(make_schedule("1f1b-flush", [1] * stages, m, microbatches=m), *unit).makespan
    assert zb2 == 3 * m + stages - 1
    assert fused == 3 * (m + stages - 1)
    assert zb2 < zb1 < fused


def test_memory_of_each_kind_in_minibatches_in_flight() -> None:
    for kind, want in (("1f1b-flush", [4, 3, 2, 1]), ("zb-h1", [4, 3, 2, 1]),
                       ("zb-h2", [7, 7, 7, 7])):
        s = make_schedule(kind, [1] * 4, 16, microbatches=16)
        assert [peak_in_flight(s.actions[(k, 0)]) for k in range(4)] == want, kind


def test_unbalanced_stages_place_the_ws_by_their_costs() -> None:
    """A slow middle stage (3x): W's of the others fill their waits for it; the bubble left is
    the slow stage's start-up and drain only, far below 1F1B's."""
    costs = [(1.0, 1.0, 1.0), (3.0, 3.0, 3.0), (1.0, 1.0, 1.0)]
    fwd, bwd = [c[0] for c in costs], [c[1] + c[2] for c in costs]
    m = 12
    zb = simulate(make_schedule("zb-h2", [1, 1, 1], m, microbatches=m, costs=costs), fwd, bwd)
    fl = simulate(make_schedule("1f1b-flush", [1, 1, 1], m, microbatches=m), fwd, bwd)
    assert zb.makespan < fl.makespan
    assert zb.makespan <= 9 * m + 2 * 1 + 2 * 1  # the slow stage's work + the others' F, B ahead


def _makespan(kind: str, replicas: list[int], m: int, costs, comm) -> float:
    """fxpipe's event simulator (not the scheduler's own cost model) on ``costs``."""
    fwd, bwd = [c[0] for c in costs], [c[1] + c[2] for c in costs]
    wf = [c[2] / (c[1] + c[2]) for c in costs]
    sched = make_schedule(kind, replicas, m, microbatches=m,
                          **({"costs": costs, "comm": comm} if kind.startswith("zb") else {}))
    return simulate(sched, fwd, bwd, comm_time=comm[1:], weight_fraction=wf).makespan


@pytest.mark.parametrize("seed", range(8))
def test_zero_bubble_kinds_are_never_slower_than_1f1b(seed: int) -> None:
    """ZB-H1 holds 1F1B's memory, so 1F1B's own order (W right after B) is one of its orders:
    on the costs it was built for it must never lose to ``1f1b-flush``. The greedy alone did,
    on unbalanced stages (e.g. the first case below: 51 against 45.5); likewise zb-h2, whose
    larger limits admit zb-h1's orders, never loses to zb-h1. Random 2-4 stage
    pipelines, replicas 1-2, costs in {0.5, 1, 2}, with and without transfer times."""
    import random

    rng = random.Random(seed)
    cases = [([1, 1, 1], 9, [(2.0, 0.5, 2.0), (1.0, 2.0, 0.5), (1.0, 2.0, 0.5)], [0.0] * 3)]
    for _ in range(25):
        S = rng.randint(2, 4)
        replicas = [rng.choice([1, 1, 2]) for _ in range(S)]
        m = rng.choice([1, 2, 3]) * sum(replicas)
        costs = [tuple(rng.choice([0.5, 1.0, 2.0]) for _ in range(3)) for _ in range(S)]
        comm = [0.0] + [rng.choice([0.0, 0.0, 0.5]) for _ in range(S - 1)]
        cases.append((replicas, m, costs, comm))
    for replicas, m, costs, comm in cases[0 if seed == 0 else 1:]:
        fused = _makespan("1f1b-flush", replicas, m, costs, comm)
        h1 = _makespan("zb-h1", replicas, m, costs, comm)
        assert h1 <= fused + 1e-9, ("zb-h1", replicas, m, costs, comm)
        # zb-h2 may hold more in flight, so zb-h1's orders are among its own: never slower
        # (its greedy alone lost to zb-h1's in seeds 0, 2, 3 and 6, e.g. 29 against 27)
        assert _makespan("zb-h2", replicas, m, costs, comm) <= h1 + 1e-9, \
            ("zb-h2", replicas, m, costs, comm)


def test_greedy_that_loses_to_1f1b_is_replaced_by_1f1b() -> None:
    """Three stages, stage 0 with a long W: the greedy's W's delay stage 0's B's; 1F1B's order
    (W after B) is kept instead, as its split schedule."""
    costs = [(2.0, 0.5, 2.0), (1.0, 2.0, 0.5), (1.0, 2.0, 0.5)]
    mbs, wins = range(9), [3, 2, 1]
    greedy = zerobubble.batch_orders([1, 1, 1], mbs, wins, costs)
    plain = zerobubble.one_f_one_b_orders([1, 1, 1], mbs, wins)
    assert zerobubble.batch_makespan([1, 1, 1], greedy, costs) > \
        zerobubble.batch_makespan([1, 1, 1], plain, costs)
    assert zerobubble.best_batch_orders("zb-h1", [1, 1, 1], mbs, wins, costs) == plain
    assert " ".join(map(str, plain[(1, 0)])) == \
        "F0 F1 B0 W0 F2 B1 W1 F3 B2 W2 F4 B3 W3 F5 B4 W4 F6 B5 W5 F7 B6 W6 F8 B7 W7 B8 W8"


def test_batch_makespan_by_hand() -> None:
    """Two stages, costs (F, B, W) = (1, 2, 3) and (2, 1, 1), a transfer of 0.5 each way:
    F0 0-1, F0' 1.5-3.5, B0' 3.5-4.5, W0' 4.5-5.5, B0 5-7, W0 7-10: ends at 10; orders that
    wait on each other never end (inf)."""
    costs = [(1.0, 2.0, 3.0), (2.0, 1.0, 1.0)]
    one = {(0, 0): [Action("F", 0), Action("B", 0), Action("W", 0)],
           (1, 0): [Action("F", 0), Action("B", 0), Action("W", 0)]}
    assert zerobubble.batch_makespan([1, 1], one, costs, [0.0, 0.5]) == 10.0
    stuck = {(0, 0): [Action("B", 0), Action("F", 0)], (1, 0): [Action("F", 0), Action("B", 0)]}
    assert zerobubble.batch_makespan([1, 1], stuck, costs) == float("inf")
    # default: unit costs, no transfer time: F0 0-1, F0' 1-2, B0' 2-3, W0' 3-4, B0 3-4, W0 4-5
    assert zerobubble.batch_makespan([1, 1], one) == 5.0


def test_batch_makespan_charges_each_links_own_transfer() -> None:
    """Three stages, unit costs, transfers 1 into stage 1 and 2 into stage 2 (each way), one
    minibatch: F 0-1, 2-3, 5-6; B of stage 2 6-7, its W 7-8; stage 1's B waits for stage 2's
    gradient (7 + 2) 9-10, W 10-11; stage 0's B waits for stage 1's (10 + 1) 11-12, W 12-13."""
    one = {(s, 0): [Action("F", 0), Action("B", 0), Action("W", 0)] for s in range(3)}
    assert zerobubble.batch_makespan([1, 1, 1], one, None, [0.0, 1.0, 2.0]) == 13.0


def test_batch_makespan_of_a_w_before_its_b_and_of_nothing() -> None:
    """A W needs its own B's input gradient: listed before it on the same rank, it never runs
    (inf, like any order that waits on itself); a batch with no actions ends at 0."""
    w_first = {(0, 0): [Action("F", 0), Action("W", 0), Action("B", 0)]}
    assert zerobubble.batch_makespan([1], w_first) == float("inf")
    assert zerobubble.batch_makespan([1], {}) == 0.0


def test_greedy_ties_go_to_the_rank_due_first() -> None:
    """Ranks due at the same time run in the order they became due. By hand, S = 2, m = 3,
    costs (1, 1, 2) and (1, 1, 0), zb-h1 windows [2, 1]: at t = 2 stage 0 waits (its B0 needs
    stage 1's B0, not yet scheduled) and is queued behind stage 1, which starts B0 (2-3); at
    t = 3 stage 1 (due first) runs W0 (0 s) then F1, stage 0 runs B0 (3-4); at t = 4 stage 0 is
    due before stage 1, sees no B1 scheduled, and runs W0 (4-6): a W that fits what it knows;
    then B1 (arrived at 5) 6-7, F2 7-8, W1 8-10 (stage 1's B2 is not scheduled yet), B2, W2."""
    costs = [(1.0, 1.0, 2.0), (1.0, 1.0, 0.0)]
    got = zerobubble.batch_orders([1, 1], range(3), [2, 1], costs)
    assert {rk: " ".join(map(str, a)) for rk, a in got.items()} == {
        (0, 0): "F0 F1 B0 W0 B1 F2 W1 B2 W2", (1, 0): "F0 B0 W0 F1 B1 W1 F2 B2 W2"}


def test_zero_cost_forwards_do_not_stall_the_greedy() -> None:
    """Stages whose forward costs nothing (a reshape): everything becomes ready at once; by
    hand F 0-1, 1-1, 1-1, B 1-2, 2-3, 3-4, W of stage 0 4-5 (the others' W fit earlier)."""
    costs = [(1.0, 1.0, 1.0), (0.0, 1.0, 1.0), (0.0, 1.0, 1.0)]
    got = zerobubble.batch_orders([1, 1, 1], range(1), [3, 2, 1], costs)
    assert all(" ".join(map(str, a)) == "F0 B0 W0" for a in got.values())
    assert zerobubble.batch_makespan([1, 1, 1], got, costs) == 5.0


def test_w_rules_are_validated() -> None:
    ok = Schedule.from_text([1], {(0, 0): "F0 F1 B0 W0 B1 W1 U0"})
    validate(ok)
    for text, match in (("F0 W0 B0 U0", "before the backward's input part"),
                        ("F0 B0 W0 W0 U0", "weight gradients repeated"),
                        ("F0 F1 B0 W0 B1 U0", "a rank splits every backward")):
        with pytest.raises(ScheduleError, match=match):
            validate(Schedule.from_text([1], {(0, 0): text}))
    assert Action.parse("W3") == Action("W", 3)


def test_buckets_launch_after_the_last_w_of_a_round() -> None:
    assert last_backwards("FFBWBWUFBWU") == {5: 6, 9: 10}
    assert last_backwards("FFBBUFBU") == {3: 4, 6: 7}


def test_zero_bubble_kinds_reject_a_memory_of_nothing() -> None:
    from fxpipe.runtime.schedules import zerobubble
    with pytest.raises(ConfigError) as info:
        zerobubble.batch_orders([1, 1], range(2), [0, 0])
    # stage 0 waits first (for a later time), then stage 1 finds nothing anyone could wait for
    assert info.value.message == "zero-bubble scheduling is stuck on stage 1 replica 0"
    assert info.value.hint == "every stage needs a memory limit of at least 1"


def test_bad_kinds_costs_and_comm_are_refused_with_what_to_do() -> None:
    """Each refusal names the offending value and says what to pass instead; a wrong count, a
    wrong tuple and a negative time are each refused on their own."""
    from fxpipe.runtime.schedules import zerobubble
    with pytest.raises(ConfigError) as info:
        zerobubble.limits("zb-h3", [1, 1])
    assert (info.value.message, info.value.hint) == ("'zb-h3' is not a zero-bubble kind",
                                                     "use zb-h1 or zb-h2")
    for costs in ([(1.0, 1.0, 1.0)], [(1.0, 1.0), (1.0, 1.0, 1.0)],
                  [(1.0, -1.0, 1.0), (1.0, 1.0, 1.0)]):
        with pytest.raises(ConfigError) as info:
            zerobubble.batch_orders([1, 1], range(2), [1, 1], costs=costs)
        assert info.value.message == f"costs={costs!r} needs one (F, B, W) >= 0 per stage"
        assert info.value.hint == "e.g. [(1.0, 1.0, 1.0)] * stages"
    for comm in ([0.0], [0.0, -1.0]):
        with pytest.raises(ConfigError) as info:
            zerobubble.batch_orders([1, 1], range(2), [1, 1], comm=comm)
        assert info.value.message == f"comm={comm!r} needs one time >= 0 per stage (the cut into it)"
        assert info.value.hint is None


# ----------------------------------------------------------------------------- training

CASES = {
    "zb-h1-2stage": (tiny_mlp, (2,), (1, 1), "zb-h1", 8, 4, False),
    "zb-h2-2stage": (tiny_mlp, (2,), (1, 1), "zb-h2", 8, 4, False),
    "zb-h2-3stage-skip": (SkipMLP, (2, 4), (1, 1, 1), "zb-h2", 8, 4, False),
    "zb-h1-4stage": (tiny_mlp, (1, 2, 3), (1, 1, 1, 1), "zb-h1", 8, 4, False),
    "zb-h2-4stage": (tiny_mlp, (1, 2, 3), (1, 1, 1, 1), "zb-h2", 8, 4, False),
    "zb-h2-2-1": (tiny_mlp, (2,), (2, 1), "zb-h2", 8, 4, False),
    "zb-h1-tied-2-1": (TiedLM, (1,), (2, 1), "zb-h1", 8, 4, True),
}


def _parts(name: str):
    make, cuts, reps, kind, n, m, tied = CASES[name]
    lf, opt = (ce, sgd_m) if tied else (loss_fn, sgd)
    data = token_batches(n) if tied else batches(n)
    return make, cuts, list(reps), make_schedule(kind, list(reps), n, microbatches=m), lf, opt, \
        data, m


@pytest.fixture(scope="module")
def distributed() -> dict[str, object]:
    jobs = []
    for name in CASES:
        make, cuts, reps, sched, lf, opt, data, _ = _parts(name)
        jobs.append(Job(split(make(), list(cuts)), reps, sched, lf, opt, data))
    return dict(zip(CASES, run_jobs(jobs)))


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", sorted(CASES))
def test_distributed_equals_reference_and_minibatch_sgd(name: str, distributed) -> None:
    make, cuts, reps, sched, lf, opt, data, m = _parts(name)
    ref = ReferenceExecutor(split(make(), list(cuts)), reps, sched, lf, opt).run(data)
    got = distributed[name]
    torch.testing.assert_close(got.losses, ref.losses, **TIGHT)
    for rank in ref.replica_params:
        torch.testing.assert_close(got.replica_params[rank], ref.replica_params[rank], **TIGHT)
    assert got.peak_bytes == ref.peak_bytes
    want = plain_sgd_groups(make(), data, m, lf, opt)
    for params in ref.replica_params.values():
        for n, p in params.items():
            torch.testing.assert_close(p, want[n], **TIGHT, msg=f"{name} {n}")


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_any_costs_give_a_valid_schedule(data) -> None:
    """The greedy never gets stuck and always yields a schedule an in-order executor carries
    out: any replica vector, stage costs (zero ones included) and message times."""
    reps = data.draw(st.lists(st.integers(1, 2), min_size=2, max_size=4))
    cost = st.floats(0.0, 3.0, allow_nan=False)
    costs = [data.draw(st.tuples(cost, cost, cost)) for _ in reps]
    comm = [data.draw(cost) for _ in reps]
    kind = data.draw(st.sampled_from(["zb-h1", "zb-h2"]))
    m = data.draw(st.integers(1, 8))
    s = make_schedule(kind, reps, 2 * m, microbatches=m, costs=costs, comm=comm)
    validate(s)
    assert all(sum(a.kind == "W" for a in acts) == sum(a.kind == "B" for a in acts)
               for acts in s.actions.values())
