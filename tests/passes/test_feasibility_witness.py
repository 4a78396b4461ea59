"""The feasibility checks on tiny hand-made instances: bounds met EXACTLY (a stage's time equal to
tau, its memory or a cut's cost equal to the cap or tau: "within" means <=), and which witness a
check returns when several plans fit (its scan order, which is what ``solve`` hands back).

Every expected plan is derived in the docstring from the definitions (pure numbers, dyadic so
float equality is exact). Instances take beta = gamma = 0 and alpha_r = 1 / r unless told, so
a stage's time is C / r (C + F / r recomputing), and optimizer factor 0, so a stage's memory is
    no recomputation: (1 + v) P + v A        recomputation: (1 + v) P + v (cut into it + H) + A
with ``v`` its in-flight count; in the checks v = ceil((m - k + r) / r) for a stage with r
replicas at prefix budget k of m workers (idle workers count as if in front of it).
Witnesses are (start, replicas, recompute) per stage."""
from __future__ import annotations

import math

import numpy as np
import pytest

from fxpipe.passes.exact_stages import check_exact
from fxpipe.passes.feasibility import INF, _Inst, check_budget, fewest_stages
from fxpipe.passes.recompute import check_budget_rc, fewest_stages_rc


def inst(C: list[float], m: int, mode: str = "never", *, F: list[float] | None = None,
         P: list[float] | None = None, A: list[float] | None = None,
         cb: list[float] | None = None, cap: float | None = None, straight: bool = False,
         beta: list[float] | None = None, gamma: list[float] | None = None) -> _Inst:
    """An instance with the defaults of the module docstring (zeros where not given)."""
    n = len(C)
    zeros = [0.0] * n
    return _Inst(C, P or zeros, A or zeros, cb if cb is not None else [0.0] * (n - 1), m,
                 [1.0 / r for r in range(1, m + 1)], beta or [0.0] * m, gamma or [0.0] * m,
                 cap, 0.0, straight, mode, F if F is not None else zeros, None)


# ------------------------------------------------------------ check_exact (stages = S)
def test_exact_two_starts_with_different_reaches() -> None:
    """C = (1, 1, 2), 2 workers, tau = 2, exactly 2 stages. Stage 0 on one worker ends at 1
    or 2 (times 1, 2; [0, 3) takes 4); from 1 the last stage reaches only 2 ([1, 3) takes 3),
    from 2 it reaches 3 (time 2). So [0, 2) | [2, 3) is the one plan: the coverable ends of
    several starts are the union of their ranges, whatever each one reaches."""
    plan, _ = check_exact(inst([1.0, 1.0, 2.0], 2), 2.0, 2)
    assert plan == [(0, 1, False), (2, 1, False)]


def test_exact_walk_back_uses_the_least_budget() -> None:
    """C = (1, 1, 1, 1), 3 workers, tau = 2, 2 stages. Plans within 2: [0, 2) | [2, 4) on
    one worker each (2 workers), or with a 2-replica stage ([0, 1) | [1, 4) x2,
    [0, 3) x2 | [3, 4), ...: 3 workers). The walk back takes the least budget that covers
    the model (2, one worker idle), then per stage the fewest replicas and the latest start."""
    plan, _ = check_exact(inst([1.0] * 4, 3), 2.0, 2)
    assert plan == [(0, 1, False), (2, 1, False)]


def test_exact_walk_back_takes_the_latest_start() -> None:
    """C = (1, 1, 1), 2 workers, tau = 2, 2 stages: [0, 1) | [1, 3) and [0, 2) | [2, 3) both
    take 2 with one worker each; the walk back tries the latest start first: 2."""
    plan, _ = check_exact(inst([1.0] * 3, 2), 2.0, 2)
    assert plan == [(0, 1, False), (2, 1, False)]


def test_exact_walk_back_tries_every_start_when_memory_is_not_monotone() -> None:
    """Recomputing, straight, 2 workers, tau = 2, cap 10: C = (1/2, 1/2, 1/2, 3/2), F = A =
    P = 0, cut bytes (1, 5, 100) at 1, 2, 3. Stage 0 needs 0 B and ends at 1, 2 or 3 (times
    1/2, 1, 3/2); the last stage's memory is the cut into it (v = 1): from 3 it needs 100 B
    (over), from 1 it takes 5/2 s (over), from 2 it takes 2 s and 5 B. One plan: starts
    (0, 2); the latest start does not fit, the one before it does."""
    i = inst([0.5, 0.5, 0.5, 1.5], 2, "always", cb=[1.0, 5.0, 100.0], cap=10.0, straight=True)
    plan, _ = check_exact(i, 2.0, 2)
    assert plan == [(0, 1, True), (2, 1, True)]


def test_exact_memory_equal_to_the_cap_fits() -> None:
    """C = (1, 1), A = (5, 10), 2 workers, cap 10, tau = 1, 2 stages: stage 0 (v = 2) holds
    2 * 5 = 10 B and stage 1 (v = 1) 10 B, both exactly the cap; the only 2-stage plan."""
    plan, _ = check_exact(inst([1.0, 1.0], 2, A=[5.0, 10.0], cap=10.0), 1.0, 2)
    assert plan == [(0, 1, False), (1, 1, False)]


def test_exact_auto_does_not_recompute_a_stage_that_fits_without() -> None:
    """One node, C = F = 1, one worker, tau = 2, "auto", no cap: the stage takes 1 s without
    recomputation and 2 s with it (both within tau); the walk back tries the mode's flags in
    order (no recomputation first) and keeps the first that fits."""
    plan, _ = check_exact(inst([1.0], 1, "auto", F=[1.0]), 2.0, 1)
    assert plan == [(0, 1, False)]


def test_exact_walk_back_takes_the_fewest_replicas() -> None:
    """One node, C = 1, A = 10, 2 workers, cap 15, tau = 1, 1 stage. At budget 1 the stage
    (v = 2) needs 20 B: over; at budget 2 one replica (v = 1, 10 B, 1 s) and two (10 B,
    1/2 s) both fit; the walk back tries the fewest replicas first: 1."""
    plan, _ = check_exact(inst([1.0], 2, A=[10.0], cap=15.0), 1.0, 1)
    assert plan == [(0, 1, False)]


# ------------------------------------------------ check_budget_rc / fewest_stages_rc
def test_rc_time_equal_to_tau_fits() -> None:
    """One node, C = F = 1, one worker, "always": the recomputing stage takes 1 + 1 = 2 s,
    exactly tau = 2, so both checks find it."""
    i = inst([1.0], 1, "always", F=[1.0])
    assert check_budget_rc(i, 2.0)[0] == [(0, 1, True)]
    assert fewest_stages_rc(i, 2.0) == [(0, 1, True)]


def test_rc_auto_prefers_no_recomputation_when_it_reaches_as_far() -> None:
    """One node, C = F = 1, one worker, "auto", tau = 2, no cap: without recomputation the
    stage takes 1 s, with it 2 s; both reach the end, and the first flag (none) is kept."""
    i = inst([1.0], 1, "auto", F=[1.0])
    assert check_budget_rc(i, 2.0)[0] == [(0, 1, False)]
    assert fewest_stages_rc(i, 2.0) == [(0, 1, False)]


def test_rc_skip_counts_a_stage_whose_memory_equals_the_cap() -> None:
    """One node, C = F = 1, A = 10, one worker, "always", cap 10, tau = 1: the only stage
    takes 2 s (over tau) and holds 1 * (0 + 0) + 10 = 10 B, exactly the cap, so it becomes
    feasible at 2: no plan within 1, and the skip ``nxt`` is 2 (not past it: no cut values)."""
    plan, nxt = check_budget_rc(inst([1.0], 1, "always", F=[1.0], A=[10.0], cap=10.0), 1.0)
    assert plan is None and nxt == 2.0


def test_rc_fewest_stages_allows_a_cut_whose_cost_equals_tau() -> None:
    """C = (2, 2), straight on 2 workers, gamma = 1, 2 bytes at the cut, "always" (F = 0),
    tau = 2: one stage takes 4 s; two take 2 s each and the cut costs 2 * 1 = 2 s, exactly
    tau, so the cut is allowed."""
    i = inst([2.0, 2.0], 2, "always", cb=[2.0], straight=True, gamma=[1.0, 1.0])
    assert fewest_stages_rc(i, 2.0) == [(0, 1, True), (1, 1, True)]
    assert check_budget_rc(i, 2.0)[0] == [(0, 1, True), (1, 1, True)]


def test_rc_fewest_stages_keeps_the_first_witness_of_a_budget() -> None:
    """One node, C = 2, P = 1, 3 workers, beta = (0, 0, 4), "always" (F = 0), tau = 2: one
    replica takes 2 s, two 1 s, three 2/3 + 4 s (over). Layer 1 builds on the empty prefix
    from every budget kp = 0, 1, 2, trying r = 1, 2, 3: budget 3 is first reached by
    (kp = 1, r = 2), and (kp = 2, r = 1), later, reaches no further: two replicas."""
    i = inst([2.0], 3, "always", P=[1.0], beta=[0.0, 0.0, 4.0])
    assert fewest_stages_rc(i, 2.0) == [(0, 2, True)]


def test_rc_fewest_stages_takes_the_budget_s_own_stage_on_a_tie() -> None:
    """One node, C = 3, 2 workers, "always" (F = 0), tau = 3: budget 1 reaches the end with
    one replica (3 s), budget 2 with two (3/2 s); equal reach, so budget 2 keeps its own
    two-replica stage rather than falling back to budget 1's."""
    assert fewest_stages_rc(inst([3.0], 2, "always"), 3.0) == [(0, 2, True)]


def test_rc_budget_that_reaches_no_further_keeps_the_cover_below() -> None:
    """Nodes (P, A) = (1, 0), (0, 2), 4 workers, "always" (F = 0), 1 byte into node 1, cap 3,
    tau = 10 (time never binds). Recomputing memory (1 + v) P + v (cut + H) + A:
    stage [0, 1) needs 1 + v, stage [1, 2) needs v + 2, [0, 2) needs 3 + v (over at any v).
    R(1): [0, 1) at v = 4 needs 5: 0. R(2): one replica (v = 3) needs 4, two (v = 2) 3: 1.
    R(3) = 1 (from 1 at v = 2 needs 4), reached no further than R(2): its cover is R(2)'s.
    R(4): [1, 2) at v = 1 needs 3: the end. So stage 0 is budget 2's two-replica stage."""
    i = inst([1.0, 1.0], 4, "always", P=[1.0, 0.0], A=[0.0, 2.0], cb=[1.0], cap=3.0)
    assert check_budget_rc(i, 10.0)[0] == [(0, 2, True), (1, 1, True)]


# ------------------------------------------------ _Inst's expressions and searches
@pytest.mark.filterwarnings("ignore:invalid value encountered in multiply:RuntimeWarning")
def test_cut_costs_nothing_at_the_first_start_and_at_the_end() -> None:
    """C = (1, 1), one worker whose cut cost per byte is infinite, 2 bytes at the one cut:
    the cut at 1 costs inf (rejected at any finite tau), but position 0 (the first stage
    receives nothing) and position n = 2 (past the last node) cost 0, whatever gamma is; so
    the last allowed start <= 2 is 2 itself, and <= 1 it is 0 (rejected cost inf)."""
    i = inst([1.0, 1.0], 1, cb=[2.0], gamma=[math.inf])
    assert (i.cut(1, 0), i.cut(1, 1), i.cut(1, 2)) == (0.0, math.inf, 0.0)
    la = i.last_allowed(1.0)
    assert la(1, 2) == (2, INF)
    assert la(1, 1) == (0, math.inf)


def test_search_without_a_hint_starts_at_a() -> None:
    """_search(key, lim, a, f): the largest e in [a, n] with f(e); with no hint ``lo`` the
    range starts at a itself. Here f holds only at a = 0 (the empty stage): the answer is 0."""
    i = inst([1.0] * 3, 1)
    assert i._search([0.0, 1.0, 2.0, 3.0], 0.0, 0, lambda e: e <= 0) == 0


def test_reach_memory_equal_to_the_cap_fits() -> None:
    """C = A = (1, 1, 1), P = 0, cap 2, one replica, v = 1, tau = 10 (time never binds):
    [0, e) holds v * A = e bytes, so memory stops the stage at e = 2 (exactly the cap);
    time alone reaches 3."""
    i = inst([1.0] * 3, 1, A=[1.0] * 3, cap=2.0)
    assert i.reach(1, 1, 0, 10.0) == (2, 3)
    assert i.reach(1, 1, 0, 10.0, 1) == (2, 3)


def test_time_many_defaults_to_no_recomputation() -> None:
    """C = (1, 2), F = (4, 8), one replica: [0, 2) takes C = 3 s, or C + F = 15 s recomputing
    (x=True); like time(), time_many recomputes only when asked."""
    i = inst([1.0, 2.0], 1, "always", F=[4.0, 8.0])
    a, e = np.array([0]), np.array([2])
    assert i.time_many(1, a, e).tolist() == [3.0]
    assert i.time_many(1, a, e, True).tolist() == [15.0]


@pytest.mark.parametrize("mode, flag, time", [("never", False, 1.0), ("always", True, 3.0),
                                              ("auto", False, 1.0)])
def test_evaluate_defaults_to_the_mode_s_only_flag(mode: str, flag: bool, time: float) -> None:
    """One node, C = 1, F = 2, one worker, no flags given: "always" recomputes (1 + 2 = 3 s,
    2 s of it recomputation), "never" does not, and "auto" (two flags) does not either (1 s);
    no search ran, so ``checks`` is 0."""
    sol = inst([1.0], 1, mode, F=[2.0]).evaluate([0], [1])
    assert sol.recompute == (flag,) and sol.stage_times == (time,)
    assert sol.recompute_times == ((2.0,) if flag else (0.0,)) and sol.checks == 0


# ------------------------------------------------------ check_budget / fewest_stages
def test_budget_skip_counts_a_stage_whose_memory_equals_the_cap() -> None:
    """One node, C = 2, A = 10, one worker, cap 10, tau = 1: the only stage takes 2 s (over)
    and holds 1 * 10 = 10 B, exactly the cap, so it becomes feasible at 2: no plan within 1,
    and the skip ``nxt`` is 2 (no cut values)."""
    assert check_budget(inst([2.0], 1, A=[10.0], cap=10.0), 1.0) == (None, 2.0)


def test_memory_equal_to_the_cap_fits_in_both_checks() -> None:
    """One node, C = 1, A = 10, one worker, cap 10, tau = 1: the stage takes 1 s and holds
    1 * 10 = 10 B, both exactly at the bound: one stage."""
    i = inst([1.0], 1, A=[10.0], cap=10.0)
    assert fewest_stages(i, 1.0) == [(0, 1)]
    assert check_budget(i, 1.0)[0] == [(0, 1)]


def test_budget_that_reaches_no_further_keeps_the_cover_below() -> None:
    """C = (1, 1), (P, A) = (0, 1), (1, 1), 5 workers, cap 3, tau = 1, 2 bytes into node 1
    with gamma = (1, 0, 0, 1, 1): the cut is allowed only into 2 or 3 replicas. Memory
    (1 + v) P + v A: [0, 1) needs v, [1, 2) needs 1 + 2v, [0, 2) 1 + 3v (over at any v >= 1);
    times C / r (two nodes need r >= 2). R(1): [0, 1) at v = 5 needs 5: 0. R(2): r = 2
    (v = 3, 3 B): 1. R(3): r = 1 starts at 0 (the cut at 1 is refused) and reaches only 1,
    as do r = 2, 3 from 0: no further than R(2), so its cover is R(2)'s. R(4) = 1 ([1, 2) at
    v = 2 needs 5). R(5): [1, 2) on 2 replicas at v = 1 needs 3: the end. So stage 0 is
    budget 2's two-replica stage, not budget 3's one-replica one."""
    i = inst([1.0, 1.0], 5, P=[0.0, 1.0], A=[1.0, 1.0], cb=[2.0], cap=3.0,
             gamma=[1.0, 0.0, 0.0, 1.0, 1.0])
    assert check_budget(i, 1.0)[0] == [(0, 2), (1, 2)]


def test_budget_walk_back_skips_a_stage_where_the_next_one_starts() -> None:
    """Straight, 3 workers, tau = 3, cap 6, C = (3, 1, 0), (P, A) = (0, 1), (0, 2), (1, 2),
    gamma = 1, cut bytes (1, inf): the cut at 2 is forbidden. Memory (1 + v) P + v A.
    R(1) = 1 ([0, 1): 3 s, v = 3 needs 3 B; [0, 2) takes 4 s). R(2) = 2 (from 1 at v = 2:
    [1, 2) needs 4, [1, 3) 11). R(3): from la(R(2) = 2) = 1 at v = 1, [1, 3) takes 1 s and
    6 B: the end. Walking back, budget 2's stage also starts at 1: it is skipped (it would be
    an empty stage), and budget 1's [0, 1) is the first stage."""
    i = inst([3.0, 1.0, 0.0], 3, P=[0.0, 0.0, 1.0], A=[1.0, 2.0, 2.0], cb=[1.0, math.inf],
             cap=6.0, straight=True, gamma=[1.0, 1.0, 1.0])
    assert check_budget(i, 3.0)[0] == [(0, 1), (1, 1)]


def test_fewest_stages_takes_the_budget_s_own_stage_on_a_tie() -> None:
    """One node, C = 3, 2 workers, tau = 3: budget 1 reaches the end with one replica (3 s),
    budget 2 with two (3/2 s); equal reach, so budget 2 keeps its own two-replica stage
    rather than falling back to budget 1's."""
    assert fewest_stages(inst([3.0], 2), 3.0) == [(0, 2)]


def test_fewest_stages_keeps_a_small_budget_s_reach() -> None:
    """Straight on 2 workers, C = 1 and A = 1 per node (3 nodes), P = 0, cap 2, tau = 10
    (time never binds): [a, e) holds v (e - a) bytes. One stage: budget 1 (v = 2) reaches 1,
    budget 2 (v = 1) reaches 2, not 3. Two stages: after [0, 1) at budget 1, [1, 3) at v = 1
    holds 2 B: the end, so [0, 1) | [1, 3); budget 1's reach must survive budget 2's larger
    one."""
    i = inst([1.0] * 3, 2, A=[1.0] * 3, cap=2.0, straight=True)
    assert fewest_stages(i, 10.0) == [(0, 1), (1, 1)]
