"""solve()'s search and minimum_memory() against their contracts: the checks it reports are the
checks it made, it converges in a few of them (the infeasible checks' jumps), forced stage counts
it cannot make are refused, and the memory users are told to get is exactly the least that fits.
"""
from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import HealthCheck, given, settings
from pd_oracle import Net
from test_solver_bruteforce import coeffs, instances

import fxpipe.passes.solver as solver
from fxpipe.errors import InfeasiblePlanError
from fxpipe.passes.solver import evaluate, minimum_memory, solve

SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])


def counting(mp: pytest.MonkeyPatch) -> tuple[list[str], list]:
    """Record every feasibility check solve() makes, and the plans the checks returned."""
    calls: list[str] = []
    found: list = []
    for name in ("check_budget", "check_exact", "fewest_stages"):
        real = getattr(solver, name)

        def wrapped(*args, _real=real, _name=name, **kw):
            calls.append(_name)
            out = _real(*args, **kw)
            plan = out if _name == "fewest_stages" else out[0]
            if plan is not None and _name != "fewest_stages":
                found.append(args[0].evaluate([p[0] for p in plan], [p[1] for p in plan]))
            return out
        mp.setattr(solver, name, wrapped)
    return calls, found


@settings(max_examples=150, **SETTINGS)
@given(instances())
def test_checks_reported_are_the_checks_made_and_few(inst) -> None:
    C, P, A, cb, net, cap, opt, stages, straight = inst
    with pytest.MonkeyPatch.context() as mp:
        calls, found = counting(mp)
        try:
            sol = solve(C, P, A, cb, net.workers, *coeffs(net), memory_cap=cap,
                        optimizer_state_factor=opt, stages=stages, straight=straight)
        except InfeasiblePlanError as e:
            assert len(calls) == 1  # one check at an unbounded budget proves it
            assert e.message == "no partition satisfies the memory and stage constraints"
            return
    assert sol.checks == len(calls)
    assert ("check_exact" in calls) == (stages is not None)
    assert ("check_budget" in calls) == (stages is None)
    assert "fewest_stages" not in calls[:-1]  # only once, at the end, when no count is forced
    best = min(found, key=lambda f: f.bottleneck)  # the search's best (the first of equals)
    assert ("fewest_stages" in calls) == (stages is None and len(best.starts) > 1)
    # each infeasible check jumps its lower bound to a value where the answer can change, so
    # the search ends after a handful of checks (bisection alone takes dozens on these)
    assert sol.checks <= 12


def test_forced_stage_counts_it_cannot_make_are_refused() -> None:
    a, b, g = coeffs(Net(3, 1.0, 1.0))
    args = ([1.0] * 4, [0.0] * 4, [0.0] * 4, [0.0] * 3, 3, a, b, g)
    for stages, nodes_workers in ((0, "4 nodes and 3 workers"), (4, "4 nodes and 3 workers")):
        with pytest.raises(InfeasiblePlanError) as info:
            solve(*args, stages=stages)
        assert info.value.message == f"cannot make {stages} stages from {nodes_workers}"
    with pytest.raises(InfeasiblePlanError, match="cannot make 3 stages from 2 nodes"):
        solve([1.0] * 2, [0.0] * 2, [0.0] * 2, [0.0], 3, a, b, g, stages=3)
    assert len(solve(*args, stages=3).starts) == 3


def test_the_lower_bound_does_not_cut_off_a_perfect_split() -> None:
    """Compute 4 x 1 s on 4 workers and free communication: every split reaches the work
    bound C / workers = 1 s exactly; the optimum is that bound, data parallelism on a tie."""
    a, b, g = coeffs(Net(4, 1e30, 1e30))
    sol = solve([1.0] * 4, [0.0] * 4, [0.0] * 4, [0.0] * 3, 4, a, b, g)
    assert sol.bottleneck == 1.0 and sol.replicas == (4,)
    sol = solve([1.0] * 4, [0.0] * 4, [0.0] * 4, [0.0] * 3, 4, a, b, g, stages=4)
    assert sol.bottleneck == 1.0 and sol.replicas == (1, 1, 1, 1)


def test_ties_within_the_tolerance_go_to_fewer_stages() -> None:
    """Two nodes, 2 workers, a slow network: [1 | 1] takes 1 s; data parallelism takes
    (2 + 2 (1/2) P / B) / 2 = 1 + 5e-10 s. Within a tolerance of 1e-9 it is a tie and data
    parallelism wins; without one the pipeline is strictly faster."""
    net = Net(2, 1.0, 1.0)
    args = ([1.0, 1.0], [5e-10, 5e-10], [0.0, 0.0], [0.0], 2, *coeffs(net))
    assert solve(*args).replicas == (1, 1)
    assert solve(*args, tie_tolerance=1e-9).replicas == (2,)
    assert solve(*args, tie_tolerance=1e-11).replicas == (1, 1)


@pytest.mark.slow
@settings(max_examples=100, **SETTINGS)
@given(instances())
def test_minimum_memory_is_the_least_cap_some_plan_fits(inst) -> None:
    C, P, A, cb, net, _, opt, stages, straight = inst
    a, b, g = coeffs(net)
    n, m = len(C), net.workers
    need = math.inf
    for k in range(n):
        if stages is not None and k + 1 != stages:
            continue
        for cuts in itertools.combinations(range(1, n), k):
            if any(math.isinf(cb[p - 1]) for p in cuts):
                continue
            for rv in ([(1,) * (k + 1)] if straight else
                       itertools.product(range(1, m + 1), repeat=k + 1)):
                if sum(rv) <= m:
                    sol = evaluate(C, P, A, cb, m, a, b, g, [0, *cuts], rv,
                                   optimizer_state_factor=opt)
                    need = min(need, max(sol.memory))
    got = minimum_memory(C, P, A, cb, m, a, b, g, optimizer_state_factor=opt, stages=stages,
                         straight=straight)
    assert got == need  # exactly (0 when nothing is needed): the bisection ends on adjacent floats


def test_minimum_memory_without_any_plan_is_infinite() -> None:
    a, b, g = coeffs(Net(2, 1.0, 1.0))
    # the only cut is forbidden, and two stages are demanded
    assert minimum_memory([1.0, 1.0], [1.0, 1.0], [1.0, 1.0], [math.inf], 2, a, b, g,
                          stages=2) == math.inf
    # a cap of 3e30: one node of 1e30 parameter bytes needs 3 P (weights, gradient, state)
    assert minimum_memory([1.0], [1e30], [0.0], [], 1, a, b, g) == math.inf
    assert minimum_memory([1.0], [1e29], [0.0], [], 1, a, b, g) == (2.0 + 1.0) * 1e29


def test_default_optimizer_state_is_one_copy_of_the_weights() -> None:
    """Without optimizer_state_factor a replica holds weights, gradients and one state tensor
    per parameter (SGD with momentum): 3 P, plus the activations."""
    a, b, g = coeffs(Net(1, 1.0, 1.0))
    assert solve([1.0], [10.0], [5.0], [], 1, a, b, g).memory == (35.0,)
    assert evaluate([1.0], [10.0], [5.0], [], 1, a, b, g, [0], [1]).memory == (35.0,)
    assert minimum_memory([1.0], [10.0], [5.0], [], 1, a, b, g) == 35.0


@pytest.mark.parametrize("C, P, bottleneck, starts, replicas, checks", [
    ([1.0] * 4, 0.0, 1.0, (0,), (4,), 5),
    ([1.0] * 4, 0.5, 1.0, (0, 1, 2, 3), (1, 1, 1, 1), 4),
    ([1.0, 3.0], 0.0, 1.0, (0,), (4,), 5),
    ([1.0, 3.0], 0.5, 11 / 9, (0, 1), (1, 3), 5),
    ([2.0, 1.0, 1.0], 0.0, 1.0, (0,), (4,), 5),
    ([2.0, 1.0, 1.0], 0.5, 1.25, (0, 1, 2), (2, 1, 1), 4),
    ([1.0, 1.0], 0.0, 0.5, (0,), (4,), 5),
    ([1.0, 1.0], 0.5, 0.75, (0, 1), (2, 2), 4),
])
def test_the_search_starts_at_the_work_bound(C, P, bottleneck, starts, replicas, checks) -> None:
    """4 workers, 1 B/s, no activations: the optimum, and the number of checks the search
    takes from its bracket [work bound (1 - 1e-9), first plan]: sum(C) / 4 below (every worker
    busy all the time), so a looser or tighter start changes the count. Optima by hand: with
    no parameters data parallelism on 4 is sum(C) / 4; [1, 3] with P = 0.5 per node: stage
    [1 | 3] on 1 + 3 workers, 3 / 3 + 2 (2/3) 0.5 / 3 = 11/9."""
    a, b, g = coeffs(Net(4, 1.0, 1.0))
    n = len(C)
    sol = solve(C, [P] * n, [0.0] * n, [0.0] * (n - 1), 4, a, b, g)
    assert (sol.starts, sol.replicas, sol.checks) == (starts, replicas, checks)
    assert sol.bottleneck == pytest.approx(bottleneck, rel=1e-12)


@pytest.mark.parametrize("need", [0.0, 0.4, 35.0, 1e-300, 3e29, 9e29, 1e30])
def test_minimum_memory_is_exact_at_any_scale(need: float) -> None:
    """One node of `need` activation bytes and no parameters on one worker needs exactly `need`
    (memory = (2 + opt) P + (v - 1) P + v A with P = 0, v = 1): below 1 (halving from the first
    cap), above it (doubling) and up to 1e30 bytes, where the search stops."""
    a, b, g = coeffs(Net(1, 1.0, 1.0))
    assert minimum_memory([1.0], [0.0], [need], [], 1, a, b, g) == need


@pytest.mark.parametrize("need", [1.2e30, 3e30])
def test_minimum_memory_past_1e30_bytes_is_no_plan(need: float) -> None:
    a, b, g = coeffs(Net(1, 1.0, 1.0))
    assert minimum_memory([1.0], [0.0], [need], [], 1, a, b, g) == math.inf


def test_minimum_memory_lets_replicas_cut_the_minibatches_in_flight() -> None:
    """Three nodes of 10 parameter bytes (no activations) on 4 workers. By hand, memory per
    replica is 3 P + (v - 1) P, v = ceil(workers of this stage and after / r): replicas
    (2, 1, 1) hold v = 2, 2, 1: 40 bytes at most. Without replicas (straight) at most three
    stages fit, and the first then holds v = 3: 50 bytes (two stages hold 20 bytes in one:
    60). Replication is allowed unless asked otherwise."""
    a, b, g = coeffs(Net(4, 1.0, 1.0))
    args = ([1.0] * 3, [10.0] * 3, [0.0] * 3, [0.0] * 2, 4, a, b, g)
    assert minimum_memory(*args) == 40.0
    assert minimum_memory(*args, straight=True) == 50.0


def test_a_tolerance_never_trades_the_optimum_for_a_slower_plan_of_as_many_stages() -> None:
    """Two workers, 1 B/s ring all-reduce, C = [2, 2, 1] s, P = [1, 2, 2] B, no cut bytes. By
    hand: one stage takes 5 s on one worker and (5 + 2 (1/2) 5) / 2 = 5 s on two; [2 | 2 1]
    takes 3 s, [2 2 | 1] 4 s. Within a tolerance of 0.5 (4.5 s) no plan has fewer than two
    stages, so the 3 s plan stays; the 4 s one has as many stages and must not replace it."""
    args = ([2.0, 2.0, 1.0], [1.0, 2.0, 2.0], [0.0] * 3, [0.0] * 2, 2, *coeffs(Net(2, 1.0, 1.0)))
    for tol in (0.0, 0.5):
        sol = solve(*args, tie_tolerance=tol)
        assert (sol.starts, sol.replicas, sol.bottleneck) == ((0, 1), (1, 1), 3.0)


def test_an_optimum_the_search_probes_exactly_is_accepted() -> None:
    """4 workers, 1 B/s ring all-reduce, C = [3, 1] s, P = [1, 2] B, one byte across the cut.
    By hand (stage time (C + 2 (r-1)/r P) / r, cut 2 X / r): one stage takes (4 + 2 (3/4) 3) / 4
    = 2.125 s at best (r = 4); [3 | 1] on (2, 1) takes max((3 + 1) / 2, 1, 2) = 2 s, as do
    (3, 1) and (2, 2), and nothing is faster (stage 1 alone needs 2 / r1 for its cut, stage 0
    3 / r0 + ..., r0 + r1 <= 4). The search reaches 2 s as its lower bound and probes it."""
    sol = solve([3.0, 1.0], [1.0, 2.0], [0.0, 0.0], [1.0], 4, *coeffs(Net(4, 1.0, 1.0)))
    assert sol.bottleneck == 2.0 and sol.starts == (0, 1)
    assert sol.replicas in {(2, 1), (3, 1), (2, 2)}


@pytest.mark.parametrize("C, P, bottleneck, starts, replicas", [
    ([1.0] * 4, 0.0, 1.0, (0,), (4,)),
    ([1.0, 3.0], 0.5, 11 / 9, (0, 1), (1, 3)),
    ([2.0, 1.0, 1.0], 0.5, 1.25, (0, 1, 2), (2, 1, 1)),
    ([1.0, 1.0], 0.5, 0.75, (0, 1), (2, 2)),
])
def test_coefficients_in_other_units_scale_the_optimum(C, P, bottleneck, starts, replicas) -> None:
    """The hand optima of test_the_search_starts_at_the_work_bound with every coefficient
    times 2^-10 (a profile in other time units; a power of two, so every product scales
    exactly): the same plan, the bottleneck times 2^-10. The search's lower bound must use
    the coefficients given, not assume alpha_r = 1 / r."""
    k = 2.0 ** -10
    a, b, g = ([k * x for x in c] for c in coeffs(Net(4, 1.0, 1.0)))
    n = len(C)
    sol = solve(C, [P] * n, [0.0] * n, [0.0] * (n - 1), 4, a, b, g)
    assert (sol.starts, sol.replicas) == (starts, replicas)
    assert sol.bottleneck == pytest.approx(k * bottleneck, rel=1e-12)


def test_checks_reported_with_recomputation_are_the_checks_made() -> None:
    """The same contract under recompute="auto" and "always" (the recomputing checks, and the
    extra search for an equally fast plan without recomputation), on the recompute tests'
    seeded profiles and the one where "auto" falls back to a plan without it."""
    from test_recompute import fat_and_thin, seeded

    cases = [(*fat_and_thin(4)[:10], 411.0, "auto")]
    for seed in range(12):
        C, F, P, A, H, cb, m, al, be, ga, rng = seeded(seed)
        cases.append((C, F, P, A, H, cb, m, al, be, ga, rng.choice([None, 600.0, 900.0]),
                      rng.choice(["auto", "always"])))
    names = ("check_budget", "check_exact", "fewest_stages", "check_budget_rc",
             "fewest_stages_rc")
    fell_back = 0
    for C, F, P, A, H, cb, m, al, be, ga, cap, mode in cases:
        calls: list[str] = []
        with pytest.MonkeyPatch.context() as mp:
            for name in names:
                def wrapped(*args, _real=getattr(solver, name), _name=name, **kw):
                    calls.append(_name)
                    return _real(*args, **kw)
                mp.setattr(solver, name, wrapped)
            try:
                sol = solve(C, P, A, cb, m, al, be, ga, memory_cap=cap, tie_tolerance=1e-9,
                            recompute=mode, forward=F, held=H)
            except InfeasiblePlanError:
                assert len(calls) == 1
                continue
        assert sol.checks == len(calls), (mode, calls)
        fell_back += mode == "auto" and calls[-1] in ("fewest_stages", "check_exact")
    assert fell_back >= 1  # the post-search for a plan without recomputation was counted
