"""Exact minimum-bottleneck partitioning into contiguous, replicated stages (pure numbers).

Minimises ``max(max_s alpha[r_s] C_s + beta[r_s] P_s, max_{s>=1} gamma[r_s] cut_bytes[a_s])`` with
``sum r_s <= workers`` and memory capped, by a search on the bottleneck with :mod:`.feasibility`.
"""
from __future__ import annotations

import logging
import math
from typing import Sequence

from fxpipe.errors import InfeasiblePlanError

from .copies import Shared
from .exact_stages import check_exact
from .feasibility import RECOMPUTE_MODES, Solution, _Inst, check_budget, fewest_stages
from .memory_rule import PIPEDREAM, MemoryRule
from .recompute import check_budget_rc, fewest_stages_rc

log = logging.getLogger(__name__)

__all__ = ["Solution", "solve", "evaluate", "minimum_memory", "RECOMPUTE_MODES"]

# Below this relative gap the search probes ``lo`` itself instead of the midpoint.
_PROBE_LO_GAP = 1e-9
# minimum_memory reports a need above this many bytes as no plan (inf): past any machine.
_NO_PLAN = 1e30


def _instance(compute: Sequence[float], parameters: Sequence[float],
              activations: Sequence[float], cut_bytes: Sequence[float], workers: int,
              alpha: Sequence[float], beta: Sequence[float], gamma: Sequence[float],
              memory_cap: float | None, optimizer_state_factor: float, straight: bool,
              recompute: str = "never", forward: Sequence[float] | None = None,
              held: Sequence[float] | None = None, memory_rule: MemoryRule = PIPEDREAM,
              shared: Sequence[Shared] = (), sharded_state: float = 0.0) -> _Inst:
    return _Inst(compute, parameters, activations, cut_bytes, workers, alpha, beta, gamma,
                 memory_cap, optimizer_state_factor, straight, recompute, forward, held,
                 memory_rule, shared, sharded_state)


def _check(inst: _Inst, tau: float, stages: int | None) -> tuple[list[tuple] | None, float]:
    """The feasibility check for this instance: the fast monotone one without recomputation,
    else the all-starts one (recompute.py); ``stages``: exactly that many."""
    if stages is not None:
        return check_exact(inst, tau, stages)
    return check_budget(inst, tau) if inst.flags == (False,) else check_budget_rc(inst, tau)


def _solution(inst: _Inst, plan: Sequence[tuple]) -> Solution:
    """Cost a witness ``(start, replicas[, recompute])`` per stage. Under "auto" a stage
    recomputes only where it must: dropping the flag never slows a stage, so it is dropped
    wherever the stage still fits in memory without it (the bottleneck cannot grow)."""
    starts, reps = [p[0] for p in plan], [p[1] for p in plan]
    flags = [bool(p[2]) if len(p) > 2 else inst.flags[0] for p in plan]
    if len(inst.flags) > 1 and any(flags):
        mem = inst.evaluate(starts, reps, recompute=[False] * len(plan)).memory
        flags = [f and not (inst.cap is None or mem[s] <= inst.cap) for s, f in enumerate(flags)]
    return inst.evaluate(starts, reps, recompute=flags)  # solve() sets the checks


def solve(compute: Sequence[float], parameters: Sequence[float], activations: Sequence[float],
          cut_bytes: Sequence[float], workers: int, alpha: Sequence[float], beta: Sequence[float],
          gamma: Sequence[float], *, memory_cap: float | None = None,
          optimizer_state_factor: float = 1.0, stages: int | None = None,
          straight: bool = False, tie_tolerance: float = 0.0, recompute: str = "never",
          forward: Sequence[float] | None = None,
          held: Sequence[float] | None = None, memory_rule: MemoryRule = PIPEDREAM,
          shared: Sequence[Shared] = (), sharded_state: float = 0.0) -> Solution:
    """Minimum-bottleneck partition (see module docstring). ``stages`` forces an exact count;
    ``straight`` forces every ``r = 1``. Plans within ``tie_tolerance`` (relative) of the optimum
    count as ties, won by the fewest stages: measured profiles are nowhere near 1e-9 accurate, so
    a pipeline that beats data parallelism by rounding noise should not be chosen. Raises
    InfeasiblePlanError when nothing fits.

    ``recompute``: "never", "always" (every stage recomputes its activations) or "auto" (each
    stage may; the optimum over both, recomputing only where needed, see recompute.py);
    ``forward``: per-node forward time (what a recomputing stage repeats; required unless
    "never"); ``held``: per-node bytes a recomputing stage holding the node keeps per in-flight
    minibatch besides its cut input (model inputs; default 0). ``memory_rule``: what a replica
    holds besides its state under the schedule the plan is for (default PipeDream's).
    ``shared``: parameters used by nodes besides the one that owns them (tied weights, a
    reused layer), ``(owner, bytes, users)`` by node index with the bytes in the owner's
    ``parameters``: a stage holding a user but not the owner keeps a copy of its own, priced in
    its memory like its own parameters (the stage's ``copies``). ``sharded_state``: bytes per
    parameter byte of ``optimizer_state_factor`` that a stage's r replicas split among
    themselves (ZeRO-1: each keeps 1/r of them); the caller prices the sync it adds in ``beta``."""
    inst = _instance(compute, parameters, activations, cut_bytes, workers, alpha, beta, gamma,
                     memory_cap, optimizer_state_factor, straight, recompute, forward, held,
                     memory_rule, shared, sharded_state)
    if stages is not None and not 1 <= stages <= min(inst.n, workers):
        raise InfeasiblePlanError(f"cannot make {stages} stages from {inst.n} nodes and "
                                  f"{workers} workers")

    def check(tau: float) -> tuple[list[tuple] | None, float]:
        return _check(inst, tau, stages)

    plan, _ = check(math.inf)
    checks = 1
    if plan is None:
        raise InfeasiblePlanError("no partition satisfies the memory and stage constraints")
    best = _solution(inst, plan)
    # Work bound: sum_s r_s T_s >= min_r(r alpha_r) C_total and sum_s r_s <= workers.
    lower = min(r * inst.alpha[r] for r in inst.rs) * inst.Cl[-1] / workers
    lo, hi = max(0.0, lower * (1 - 1e-9)), best.bottleneck
    while lo < hi:
        if hi - lo <= _PROBE_LO_GAP * hi:
            tau = lo
        elif lo > 0 and hi > 2 * lo:
            tau = math.sqrt(lo * hi)  # geometric steps while the bracket is wide
        else:
            tau = lo + (hi - lo) / 2
        plan, nxt = check(tau)
        checks += 1
        log.debug("check %d: lo=%r hi=%r tau=%r feasible=%s", checks, lo, hi, tau, plan is not None)
        if plan is None:
            lo = max(lo, nxt)
            continue
        sol = _solution(inst, plan)
        assert sol.bottleneck <= tau, "feasibility check returned a plan over its bound"
        best, hi = sol, sol.bottleneck
    if stages is None and len(best.starts) > 1:
        bound = hi * (1.0 + max(tie_tolerance, 0.0))
        fewer = (fewest_stages(inst, bound) if inst.flags == (False,)
                 else fewest_stages_rc(inst, bound))
        checks += 1
        if fewer is not None and len(fewer) < len(best.starts):
            best = _solution(inst, fewer)
    if any(best.recompute) and len(inst.flags) > 1:
        # "auto": recompute only when it is strictly faster or saves stages; an equally fast
        # plan without it, with no more stages, wins
        plain = _instance(compute, parameters, activations, cut_bytes, workers, alpha, beta,
                          gamma, memory_cap, optimizer_state_factor, straight,
                          memory_rule=memory_rule, shared=shared, sharded_state=sharded_state)
        alt = (fewest_stages(plain, best.bottleneck) if stages is None
               else check_exact(plain, best.bottleneck, stages)[0])
        checks += 1
        if alt is not None and len(alt) <= len(best.starts):
            best = _solution(plain, alt)
    log.debug("solved N=%d M=%d in %d checks: bottleneck %.6g", inst.n, workers, checks,
              best.bottleneck)
    return Solution(**{**best.__dict__, "checks": checks})


def evaluate(compute: Sequence[float], parameters: Sequence[float], activations: Sequence[float],
             cut_bytes: Sequence[float], workers: int, alpha: Sequence[float],
             beta: Sequence[float], gamma: Sequence[float], starts: Sequence[int],
             replicas: Sequence[int], *, optimizer_state_factor: float = 1.0,
             recompute: Sequence[bool] | None = None, forward: Sequence[float] | None = None,
             held: Sequence[float] | None = None, memory_rule: MemoryRule = PIPEDREAM,
             shared: Sequence[Shared] = (), sharded_state: float = 0.0) -> Solution:
    """Costs of a given partition, with the solver's exact expressions (for tests, reports);
    ``recompute``: one flag per stage (then ``forward`` is required, see :func:`solve`)."""
    mode = "auto" if recompute is not None and any(recompute) else "never"
    inst = _instance(compute, parameters, activations, cut_bytes, workers, alpha, beta, gamma,
                     None, optimizer_state_factor, False, mode, forward, held, memory_rule,
                     shared, sharded_state)
    return inst.evaluate(list(starts), list(replicas), recompute=recompute)


def minimum_memory(compute: Sequence[float], parameters: Sequence[float],
                   activations: Sequence[float], cut_bytes: Sequence[float], workers: int,
                   alpha: Sequence[float], beta: Sequence[float], gamma: Sequence[float], *,
                   optimizer_state_factor: float = 1.0, stages: int | None = None,
                   straight: bool = False, recompute: str = "never",
                   forward: Sequence[float] | None = None,
                   held: Sequence[float] | None = None,
                   memory_rule: MemoryRule = PIPEDREAM, shared: Sequence[Shared] = (),
                   sharded_state: float = 0.0) -> float:
    """Smallest per-worker memory for which some plan exists (time unconstrained), to the float:
    0 when nothing needs memory, inf when no plan exists at all or only above ``_NO_PLAN``
    bytes. Used to tell users how much memory they need. Bisection on the cap from a bracket
    ``(lo, hi]`` with ``ok(lo)`` false and ``ok(hi)`` true (ok is monotone in the cap), found
    by halving or doubling from 1, so it ends on adjacent floats: hi is the least that fits."""
    def ok(cap: float) -> bool:
        inst = _instance(compute, parameters, activations, cut_bytes, workers, alpha, beta,
                         gamma, cap, optimizer_state_factor, straight, recompute, forward, held,
                         memory_rule, shared, sharded_state)
        return _check(inst, math.inf, stages)[0] is not None

    if ok(0.0):
        return 0.0
    hi = 1.0
    if ok(hi):
        while ok(hi / 2):  # ends: hi / 2 reaches 0.0, which does not fit
            hi /= 2
        lo = hi / 2
    else:
        while True:
            if hi >= _NO_PLAN:
                return math.inf
            lo, hi = hi, min(2 * hi, _NO_PLAN)
            if ok(hi):
                break
    while True:
        mid = lo + (hi - lo) / 2
        if mid <= lo or mid >= hi:  # lo and hi are adjacent floats: hi is the least that fits
            return hi
        lo, hi = (lo, mid) if ok(mid) else (mid, hi)
