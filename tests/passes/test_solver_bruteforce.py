"""The exact solver and ``partition`` against a literal brute force on small random instances.

The brute force prices every partition with pd_oracle.py, the cost model written out from its
definitions (no fxpipe.passes code), so a wrong formula in the solver, its feasibility checks or
``partition``'s coefficients cannot hide behind an expectation computed by the same formula.
Sizes are whole bytes, so memory (products of integers) is exact on both sides and the cap test
has no rounding; times are compared to 1e-9, and ties (fewest stages wins) use that tolerance too.
"""
from __future__ import annotations

import itertools
import math
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pd_oracle import Net, price
from pd_oracle import live_bytes as oracle_live_bytes

from fxpipe.costmodel.hardware import Cluster
from fxpipe.costmodel.profile import Profile, ProfileNode
from fxpipe.errors import InfeasiblePlanError
from fxpipe.passes import partition
from fxpipe.passes.memory_rule import MemoryRule
from fxpipe.passes.solver import evaluate, solve

TIE = 1e-9


def coeffs(net: Net) -> tuple[list[float], list[float], list[float]]:
    """The per-r coefficients solve() takes, from the same definitions as pd_oracle."""
    k = 2.0 if net.sync == "allreduce" else 4.0
    a = [1.0 / r for r in range(1, net.workers + 1)]
    b = [k * (r - 1) / r / net.sync_bandwidth(r) / r for r in range(1, net.workers + 1)]
    g = [2.0 / (net.cut_bandwidth() * r) for r in range(1, net.workers + 1)]
    return a, b, g


def brute(C, P, A, cb, net: Net, cap, opt, stages, straight, schedule="pipedream", m_=None,
          shared=(), sharded=None):
    """Every cut set and replica vector priced by the definitions: (optimum, fewest stages of
    the plans within TIE of it, {(starts, replicas): price} of the feasible plans)."""
    n, m = len(C), net.workers
    feasible = {}
    for k in range(n):
        if stages is not None and k + 1 != stages:
            continue
        for cuts in itertools.combinations(range(1, n), k):
            if any(math.isinf(cb[p - 1]) for p in cuts):
                continue
            reps = [(1,) * (k + 1)] if straight else [
                rv for rv in itertools.product(range(1, m + 1), repeat=k + 1) if sum(rv) <= m]
            for rv in reps:
                if sum(rv) > m:
                    continue
                pr = price(C, P, A, cb, (0, *cuts), rv, net, opt, schedule, m_, shared, sharded)
                if cap is None or all(x <= cap for x in pr.memory):
                    feasible[((0, *cuts), rv)] = pr
    if not feasible:
        return math.inf, None, feasible
    best = min(pr.bottleneck for pr in feasible.values())
    fewest = min(len(s) for (s, _), pr in feasible.items() if pr.bottleneck <= best * (1 + TIE))
    return best, fewest, feasible


ints = st.integers(0, 1000).map(float)
secs = st.floats(0.0, 10.0, allow_nan=False).map(lambda x: round(x, 2))


@st.composite
def instances(draw):
    n = draw(st.integers(1, 7))
    m = draw(st.integers(1, 5))
    C = draw(st.lists(secs, min_size=n, max_size=n))
    P = draw(st.lists(ints, min_size=n, max_size=n))
    A = draw(st.lists(ints, min_size=n, max_size=n))
    cb = draw(st.lists(st.one_of(ints, st.just(math.inf)), min_size=n - 1, max_size=n - 1))
    bw = draw(st.sampled_from([100.0, 1000.0, 1e4, 1e6]))
    wpm = draw(st.sampled_from(sorted({1, m} | ({2} if m % 2 == 0 else set()))))
    net = Net(m, bw, bw * draw(st.sampled_from([1.0, 10.0])), wpm,
              draw(st.sampled_from(["allreduce", "parameter-server"])))
    cap = draw(st.one_of(st.none(), st.integers(0, 8000).map(float)))
    opt = draw(st.sampled_from([0.0, 1.0, 2.0]))
    stages = draw(st.one_of(st.none(), st.integers(1, min(n, m))))
    straight = draw(st.booleans())
    return C, P, A, cb, net, cap, opt, stages, straight


@pytest.mark.slow
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(instances())
def test_solver_matches_brute_force(inst) -> None:
    C, P, A, cb, net, cap, opt, stages, straight = inst
    want, want_s, feasible = brute(C, P, A, cb, net, cap, opt, stages, straight)
    a, b, g = coeffs(net)
    try:
        sol = solve(C, P, A, cb, net.workers, a, b, g, memory_cap=cap, optimizer_state_factor=opt,
                    stages=stages, straight=straight, tie_tolerance=TIE)
    except InfeasiblePlanError:
        assert want == math.inf
        return
    assert want < math.inf
    mine = price(C, P, A, cb, sol.starts, sol.replicas, net, opt)
    assert (tuple(sol.starts), tuple(sol.replicas)) in feasible  # valid, and fits the cap
    assert math.isclose(mine.bottleneck, want, rel_tol=TIE)  # optimal
    assert math.isclose(sol.bottleneck, mine.bottleneck, rel_tol=TIE)
    assert sol.in_flight == mine.in_flight
    assert sol.memory == mine.memory  # whole bytes: exact
    for got, exp in zip(sol.stage_times + sol.cut_times, mine.stage_times + mine.cut_times):
        assert math.isclose(got, exp, rel_tol=TIE)
    if straight:
        assert set(sol.replicas) == {1}
    assert len(sol.replicas) == (stages if stages is not None else want_s)
    # Exact in floating point (DESIGN.md): with the definitions checked above, the solver's
    # bottleneck is the least its own cost expressions (evaluate) give any feasible plan, to the
    # last bit; that least is among the plans the definitions put within 1e-6 of the optimum.
    def own(plan: tuple) -> float:
        return evaluate(C, P, A, cb, net.workers, a, b, g, list(plan[0]), list(plan[1]),
                        optimizer_state_factor=opt).bottleneck
    near = {k: own(k) for k, pr in feasible.items() if pr.bottleneck <= want * (1 + 1e-6)}
    exact = solve(C, P, A, cb, net.workers, a, b, g, memory_cap=cap, optimizer_state_factor=opt,
                  stages=stages, straight=straight)  # no tie tolerance
    assert exact.bottleneck == min(near.values())
    assert own((exact.starts, exact.replicas)) == exact.bottleneck
    if stages is None:  # ties at exactly the same value: fewest stages
        assert len(exact.starts) == min(len(k[0]) for k, v in near.items()
                                        if v == exact.bottleneck)


RULES = {  # the shapes the runtime maps these schedules to (runtime/pricing/memory.py)
    "2bw": lambda m: MemoryRule("2bw", "one", "window"),
    "1f1b-flush": lambda m: MemoryRule("1f1b-flush", "none", "window-batch", m),
    "gpipe": lambda m: MemoryRule("gpipe", "none", "batch", m),
}


@pytest.mark.slow
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(instances(), st.sampled_from(sorted(RULES)), st.sampled_from([None, 1, 2, 3, 7]))
def test_solver_under_a_schedule_memory_rule_matches_brute_force(inst, schedule, m) -> None:
    """The optimum when memory is priced as ``schedule`` holds it (pd_oracle.SCHEDULE_MEMORY,
    from each schedule's definition), not PipeDream's rule: optimal, fits, exact memory."""
    C, P, A, cb, net, cap, opt, stages, straight = inst
    want, want_s, feasible = brute(C, P, A, cb, net, cap, opt, stages, straight, schedule, m)
    a, b, g = coeffs(net)
    rule = RULES[schedule](m)
    try:
        sol = solve(C, P, A, cb, net.workers, a, b, g, memory_cap=cap, optimizer_state_factor=opt,
                    stages=stages, straight=straight, tie_tolerance=TIE, memory_rule=rule)
    except InfeasiblePlanError:
        assert want == math.inf
        return
    assert want < math.inf
    mine = price(C, P, A, cb, sol.starts, sol.replicas, net, opt, schedule, m)
    assert (tuple(sol.starts), tuple(sol.replicas)) in feasible
    assert math.isclose(mine.bottleneck, want, rel_tol=TIE)
    assert sol.memory == mine.memory
    assert len(sol.replicas) == (stages if stages is not None else want_s)
    assert evaluate(C, P, A, cb, net.workers, a, b, g, list(sol.starts), list(sol.replicas),
                    optimizer_state_factor=opt, memory_rule=rule).memory == sol.memory


@st.composite
def shared_parameters(draw, n: int, P: list[float]):
    """Up to two parameters shared by later nodes (tied weights), owners distinct, each at most
    its owner's bytes (it is part of them): ``(owner, bytes, users)``."""
    out = []
    owners = draw(st.lists(st.integers(0, max(n - 2, 0)), max_size=2, unique=True)) if n > 1 \
        else []
    for o in owners:
        users = draw(st.lists(st.integers(o + 1, n - 1), min_size=1, max_size=3, unique=True))
        out.append((o, float(draw(st.integers(0, int(P[o])))), tuple(sorted(users))))
    return out


@pytest.mark.slow
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data(), instances(), st.sampled_from(["pipedream", *sorted(RULES)]),
       st.sampled_from([None, 2]))
def test_shared_parameters_copies_match_brute_force(data, inst, schedule, m) -> None:
    """A stage that uses a shared parameter (a tied embedding's head) without owning it keeps a
    copy, priced in its memory like its own parameters (pd_oracle, from that definition): the
    solver's optimum under a cap, its memory exactly and each stage's copies."""
    C, P, A, cb, net, cap, opt, stages, straight = inst
    shared = data.draw(shared_parameters(len(C), P))
    want, want_s, feasible = brute(C, P, A, cb, net, cap, opt, stages, straight, schedule, m,
                                   shared)
    a, b, g = coeffs(net)
    rule = RULES[schedule](m) if schedule != "pipedream" else MemoryRule("pipedream", "window",
                                                                         "window")
    try:
        sol = solve(C, P, A, cb, net.workers, a, b, g, memory_cap=cap, optimizer_state_factor=opt,
                    stages=stages, straight=straight, tie_tolerance=TIE, memory_rule=rule,
                    shared=shared)
    except InfeasiblePlanError:
        assert want == math.inf
        return
    assert want < math.inf
    mine = price(C, P, A, cb, sol.starts, sol.replicas, net, opt, schedule, m, shared)
    assert (tuple(sol.starts), tuple(sol.replicas)) in feasible
    assert math.isclose(mine.bottleneck, want, rel_tol=TIE)
    assert sol.memory == mine.memory
    assert len(sol.replicas) == (stages if stages is not None else want_s)
    ends = [*sol.starts[1:], len(C)]
    assert sol.copies == tuple(
        sum(nb for o, nb, us in shared if not s0 <= o < e and any(s0 <= u < e for u in us))
        for s0, e in zip(sol.starts, ends))


def test_a_tied_heads_stage_keeps_a_copy_by_hand() -> None:
    """An embedding (node 0, 60 bytes, all of them the weight the head at node 2 uses), a
    middle node of 100 bytes, the head (no weight of its own), SGD with momentum (opt = 1),
    1F1B with a flush every minibatch (no versions) and no activations: a replica holds 3 x its
    parameters. Cut after node 0, stage 1 keeps 100 + 60 (the head's copy): 480 bytes, so 2
    stages do not fit 300 bytes; priced without the copy they would (180 and 300)."""
    C, P, A, cb = [1.0, 1.0, 1.0], [60.0, 100.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0]
    a, b, g = coeffs(Net(3, 1e30, 1e30))
    flush = MemoryRule("1f1b-flush", "none", "window-batch", microbatches=1)
    tied = [(0, 60.0, (2,))]
    two = evaluate(C, P, A, cb, 3, a, b, g, [0, 1], [1, 1], shared=tied, memory_rule=flush)
    assert two.copies == (0.0, 60.0) and two.memory == (180.0, 480.0)
    head = evaluate(C, P, A, cb, 3, a, b, g, [0, 2], [1, 1], shared=tied, memory_rule=flush)
    assert head.copies == (0.0, 60.0) and head.memory == (480.0, 180.0)
    one = evaluate(C, P, A, cb, 3, a, b, g, [0], [1], shared=tied, memory_rule=flush)
    assert one.copies == (0.0,) and one.memory == (480.0,)
    with pytest.raises(InfeasiblePlanError):
        solve(C, P, A, cb, 3, a, b, g, memory_cap=300.0, stages=2, straight=True,
              memory_rule=flush, shared=tied)
    untied = solve(C, P, A, cb, 3, a, b, g, memory_cap=300.0, stages=2, straight=True,
                   memory_rule=flush)
    assert untied.starts == (0, 1) and untied.memory == (180.0, 300.0)
    three = solve(C, P, A, cb, 3, a, b, g, memory_cap=300.0, straight=True, memory_rule=flush,
                  shared=tied)
    assert three.starts == (0, 1, 2) and three.memory == (180.0, 300.0, 180.0)
    assert three.copies == (0.0, 0.0, 60.0)


def test_a_cap_between_the_rules_has_a_plan_only_under_the_flushing_schedule() -> None:
    """Two equal nodes on 2 workers, 100 bytes of weights and 100 of activations each, SGD with
    momentum (opt = 1): data parallelism needs 800 bytes per worker under any rule, a 2-stage
    pipeline's first stage (v = 2) 600 under PipeDream's rule (a stashed version and two
    minibatches) and 400 under 1F1B with a flush every minibatch: a 500-byte cap has a plan
    only for the flushing schedule."""
    C, P, A, cb = [1.0, 1.0], [100.0, 100.0], [100.0, 100.0], [0.0]
    a, b, g = coeffs(Net(2, 1e30, 1e30))
    # data parallel (one stage, r = 2, v = 1): 200 (2 + 1) + 0 + 1 x 200 = 800 under any rule;
    # pipeline [1, 1], stage 0 (v = 2): PipeDream 100 x 3 + 1 x 100 + 2 x 100 = 600,
    # 1F1B with a flush at m = 1: 100 x 3 + 0 + min(2, 1) x 100 = 400; stage 1 (v = 1): 400
    pd = solve(C, P, A, cb, 2, a, b, g, memory_cap=None, stages=2)
    assert pd.memory == (600.0, 400.0)
    flush = MemoryRule("1f1b-flush", "none", "window-batch", microbatches=1)
    assert solve(C, P, A, cb, 2, a, b, g, stages=2, memory_rule=flush).memory == (400.0, 400.0)
    with pytest.raises(InfeasiblePlanError):
        solve(C, P, A, cb, 2, a, b, g, memory_cap=500.0)
    sol = solve(C, P, A, cb, 2, a, b, g, memory_cap=500.0, memory_rule=flush)
    assert sol.starts == (0, 1) and sol.replicas == (1, 1) and max(sol.memory) <= 500.0


@pytest.mark.slow
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(instances(), st.sampled_from(["pipedream", "1f1b-flush"]), st.sampled_from([0.5, 1.0]))
def test_sharded_optimizer_state_matches_brute_force(inst, schedule, part) -> None:
    """A replicated stage that splits ``part`` of the optimizer state over its replicas
    (ZeRO-1: pd_oracle's ``sharded``, each keeps 1/r of it, and a broadcast of the new weights
    makes the sync 3 (r-1)/r P): the optimum under the cap, its memory and times."""
    C, P, A, cb, net, cap, opt, stages, straight = inst
    net = Net(net.workers, net.bandwidth, net.intra_bandwidth, net.workers_per_machine)
    sharded = part * opt
    want, want_s, feasible = brute(C, P, A, cb, net, cap, opt, stages, straight, schedule,
                                   None, (), sharded)
    a, g = coeffs(net)[0], coeffs(net)[2]
    b = [x * (1.5 if r > 1 else 1.0) for r, x in enumerate(coeffs(net)[1], start=1)]
    rule = (MemoryRule("pipedream", "window", "window") if schedule == "pipedream"
            else RULES[schedule](None))
    try:
        sol = solve(C, P, A, cb, net.workers, a, b, g, memory_cap=cap, optimizer_state_factor=opt,
                    stages=stages, straight=straight, tie_tolerance=TIE, memory_rule=rule,
                    sharded_state=sharded)
    except InfeasiblePlanError:
        assert want == math.inf
        return
    assert want < math.inf
    mine = price(C, P, A, cb, sol.starts, sol.replicas, net, opt, schedule, None, (), sharded)
    assert (tuple(sol.starts), tuple(sol.replicas)) in feasible
    assert math.isclose(mine.bottleneck, want, rel_tol=TIE)
    assert len(sol.replicas) == (stages if stages is not None else want_s)
    assert sol.memory == mine.memory
    for got, exp in zip(sol.stage_times, mine.stage_times):
        assert math.isclose(got, exp, rel_tol=TIE)


@st.composite
def profiles(draw):
    """Small graphs (a chain plus skip connections, some values not sendable) on clusters with
    one or two levels, as ``partition`` sees them."""
    n = draw(st.integers(1, 6))
    nodes = []
    for i in range(n):
        inputs = {f"n{i - 1}"} if i else set()
        if i > 1 and draw(st.booleans()):
            inputs.add(f"n{draw(st.integers(0, i - 2))}")
        nodes.append(ProfileNode(
            name=f"n{i}", op="call_module", target="m", forward_s=draw(secs), backward_s=0.0,
            activation_bytes=draw(ints), parameter_bytes=draw(ints), inputs=tuple(sorted(inputs)),
            sendable=draw(st.sampled_from([True, True, True, False]))))
    m = draw(st.sampled_from([1, 2, 3, 4, 6]))
    wpm = draw(st.sampled_from([d for d in (1, 2, 3, m) if m % d == 0]))
    bw = draw(st.sampled_from([100.0, 1000.0, 1e4]))
    net = Net(m, bw, bw * draw(st.sampled_from([1.0, 10.0])), wpm,
              draw(st.sampled_from(["allreduce", "parameter-server"])))
    cap = draw(st.one_of(st.none(), st.integers(500, 8000).map(float)))
    return Profile(nodes=tuple(nodes), batch_size=4), net, cap


def live_bytes(prof: Profile) -> list[float]:
    """Bytes live across each cut, by the definition (pd_oracle.live_bytes)."""
    return oracle_live_bytes(prof.names, [nd.inputs for nd in prof.nodes],
                [nd.activation_bytes for nd in prof.nodes], [nd.sendable for nd in prof.nodes])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(profiles())
def test_partition_matches_brute_force(case) -> None:
    """partition() end to end (its coefficients, cut prices and plan fields) against the brute
    force over the definitions; a profile's cut prices come from its edges here too."""
    prof, net, cap = case
    C = [nd.forward_s for nd in prof.nodes]
    P = [nd.parameter_bytes for nd in prof.nodes]
    A = [nd.activation_bytes for nd in prof.nodes]
    cb = live_bytes(prof)
    want, want_s, feasible = brute(C, P, A, cb, net, cap, 1.0, None, False)
    cluster = Cluster(workers=net.workers, bandwidth=net.bandwidth, memory=cap,
                      workers_per_machine=net.workers_per_machine,
                      intra_bandwidth=net.intra_bandwidth)
    try:
        plan = partition(prof, cluster, sync=net.sync)
    except InfeasiblePlanError:
        assert want == math.inf
        return
    starts = tuple(prof.names.index(s.nodes[0]) for s in plan.stages)
    mine = feasible[(starts, tuple(plan.replicas))]  # KeyError: invalid or over the cap
    assert math.isclose(mine.bottleneck, want, rel_tol=TIE)
    assert math.isclose(plan.time_per_minibatch, want, rel_tol=TIE)
    assert len(plan.stages) == want_s
    assert [s.in_flight for s in plan.stages] == list(mine.in_flight)
    assert [s.memory_bytes for s in plan.stages] == list(mine.memory)
    for s, st_t, cut_t in zip(plan.stages, mine.stage_times, mine.cut_times):
        assert math.isclose(s.stage_time_s, st_t, rel_tol=TIE)
        assert math.isclose(s.comm_s, cut_t, rel_tol=TIE)
        assert s.input_bytes == (cb[prof.names.index(s.nodes[0]) - 1] if s.index else 0.0)
    dp = price(C, P, A, cb, (0,), (net.workers,), net, 1.0).bottleneck
    assert math.isclose(plan.data_parallel_time, dp, rel_tol=TIE)
    assert plan.noam == math.ceil(sum(plan.replicas) / plan.replicas[0])


def test_data_parallel_preferred_on_tie() -> None:
    # zero communication: one stage on all workers ties with any pipeline; DP must win.
    C, P, A = [1.0, 1.0, 1.0, 1.0], [0.0] * 4, [0.0] * 4
    a, b, g = coeffs(Net(4, 1e30, 1e30))
    sol = solve(C, P, A, [0.0] * 3, 4, a, b, g)
    assert sol.replicas == (4,) and sol.bottleneck == 1.0


def test_large_instance_beats_its_neighbours() -> None:
    """2000 nodes, 32 workers (how long it takes is bench/plan_speed.py's business): moving any
    single boundary by one node never helps, priced by the definitions."""
    rng = random.Random(1)
    n, net = 2000, Net(32, 1.25e9, 1.25e9)
    C = [rng.uniform(1e-4, 2e-3) for _ in range(n)]
    P = [rng.uniform(0, 4e6) if rng.random() < 0.3 else 0.0 for _ in range(n)]
    A = [rng.uniform(1e5, 1e7) for _ in range(n)]
    cb = [rng.uniform(1e5, 5e7) for _ in range(n - 1)]
    sol = solve(C, P, A, cb, 32, *coeffs(net))
    best = price(C, P, A, cb, sol.starts, sol.replicas, net).bottleneck
    assert math.isclose(sol.bottleneck, best, rel_tol=TIE)
    assert len(sol.starts) > 1  # a real pipeline, so there are boundaries to move
    for i in range(1, len(sol.starts)):
        for d in (-1, 1):
            st_ = list(sol.starts)
            st_[i] += d
            if st_ != sorted(set(st_)) or st_[-1] >= n:
                continue
            assert price(C, P, A, cb, st_, sol.replicas, net).bottleneck >= best * (1 - TIE)
