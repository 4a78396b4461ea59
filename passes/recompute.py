"""Feasibility checks when stages may recompute their activations (pure numbers, still exact).

A recomputing stage's memory depends on the cut into it, not monotone in its start, so these checks
try every allowed start and both flags: O(M^2 N log N) per check instead of O(M^2 log N).
"""
from __future__ import annotations

import numpy as np

from .feasibility import _BIG, INF, _Inst, _v, backtrack_layers

Flagged = list[tuple[int, int, bool]]  # (start, replicas, recompute) per stage


def _starts(ok: np.ndarray, r: int, x_end: int) -> np.ndarray:
    """Allowed starts ``a <= x_end`` for a stage with r replicas (0 is always allowed)."""
    return np.flatnonzero(ok[r, :x_end + 1])


def _best_reach(inst: _Inst, r: int, v: int, starts: np.ndarray, tau: float, need: int
                ) -> tuple[int, int, bool]:
    """(furthest end, its start, its flag) over ``starts`` and the instance's flags, among the
    starts that reach at least ``need`` (-1 if none does). Exact pruning: for a fixed start,
    time and memory grow with the end, so a start over a bound at ``need`` cannot reach it."""
    best, arg = -1, (0, False)
    ends = np.full_like(starts, need)
    for x in inst.flags:
        ok = inst.time_many(r, starts, ends, x) <= tau
        if inst.cap is not None:
            ok &= inst.mem_many(r, v, starts, ends, x) <= inst.cap
        if not ok.any():
            continue
        cand = starts[ok]
        e, _ = inst.reach_many(r, v, cand, tau, x)
        i = int(np.argmax(e))
        if int(e[i]) > best:
            best, arg = int(e[i]), (int(cand[i]), x)
    return best, arg[0], arg[1]


def _threshold(inst: _Inst, r: int, v: int, starts: np.ndarray, end: int) -> float:
    """Least time at which a stage from one of ``starts`` could reach ``end`` (within memory)."""
    out = INF
    ends = np.full_like(starts, end)
    for x in inst.flags:
        t = inst.time_many(r, starts, ends, x)
        if inst.cap is not None:
            t = t[inst.mem_many(r, v, starts, ends, x) <= inst.cap]
        if t.size:
            out = min(out, float(t.min()))
    return out


def check_budget_rc(inst: _Inst, tau: float) -> tuple[Flagged | None, float]:
    """:func:`~fxpipe.passes.feasibility.check_budget` over every start and flag.

    ``nxt`` (every value in ``[tau, nxt)`` is infeasible too): the next cut value above ``tau``
    (any cut becoming allowed), and per (k, r) the least time at which some start could reach
    ``R(k) + 1`` within memory (no start does at ``tau``, so each of those times is > tau)."""
    n, m = inst.n, inst.m
    ok = inst.cutm <= min(tau, _BIG)
    nxt = inst.next_cut_value(tau)
    R = [0] * (m + 1)
    ch: list[tuple[int, int, bool] | None] = [None] * (m + 1)
    for k in range(1, m + 1):
        best, bc = R[k - 1], None
        for r in inst.rs:
            if r > k:
                break
            starts = _starts(ok, r, min(R[k - r], n - 1))
            e, a, x = _best_reach(inst, r, _v(m, k, r), starts, tau, best + 1)
            if e > best:
                best, bc = e, (r, a, x)
                if best >= n:
                    break
        R[k], ch[k] = best, bc
        if best >= n:
            return _rebuild(ch, k, n), nxt
        for r in inst.rs:
            if r > k:
                break
            starts = _starts(ok, r, min(R[k - r], n - 1))
            nxt = min(nxt, _threshold(inst, r, _v(m, k, r), starts, best + 1))
    return None, nxt


def _rebuild(ch: list[tuple[int, int, bool] | None], k: int, x: int) -> Flagged:
    out: Flagged = []
    while x > 0:
        c = ch[k]
        if c is None:
            k -= 1
            continue
        r, a, f = c
        if a < x:
            out.append((a, r, f))
            x = a
        k -= r
    out.reverse()
    return out


def fewest_stages_rc(inst: _Inst, tau: float) -> Flagged | None:
    """:func:`~fxpipe.passes.feasibility.fewest_stages` over every start and flag: the layered
    recurrence ``R_s(k) = max(R_{s-1}(k), R_s(k-1), max_r best reach from a <= R_{s-1}(k-r))``;
    a pair (k, r) can only improve on layer s-1 when ``R_{s-1}(k-r)`` just changed."""
    n, m = inst.n, inst.m
    ok = inst.cutm <= min(tau, _BIG)
    prev = [0] * (m + 1)
    changed = list(range(m))
    layers: list[list[tuple[str, int, int, bool]]] = []
    for _ in range(m):
        cur = prev[:]
        cch: list[tuple[str, int, int, bool]] = [("s", 0, 0, False)] * (m + 1)
        for kp in changed:
            if prev[kp] >= n:
                continue
            for r in inst.rs:
                k = kp + r
                if k > m:
                    break
                if cur[k] >= n:
                    continue
                starts = _starts(ok, r, min(prev[kp], n - 1))
                e, a, x = _best_reach(inst, r, _v(m, k, r), starts, tau, cur[k] + 1)
                if e > cur[k]:
                    cur[k], cch[k] = e, ("r", r, a, x)
        for k in range(1, m + 1):
            if cur[k - 1] > cur[k]:
                cur[k], cch[k] = cur[k - 1], ("k", 0, 0, False)
        layers.append(cch)
        if cur[m] >= n:
            return backtrack_layers(layers, n, m)
        changed = [k for k in range(m + 1) if cur[k] != prev[k]]
        if not changed:
            return None
        prev = cur
    return None
