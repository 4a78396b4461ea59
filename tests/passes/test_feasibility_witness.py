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

import pytest

from fxpipe.passes.exact_stages import check_exact
from fxpipe.passes.feasibility import _Inst
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
