"""Feasibility with an exact stage count (``partition(..., stages=S)``), vectorised with numpy.

Exactly-S covers are not prefix-closed, so each state keeps every coverable prefix end: O(S M^2 N)
per check, slower than :mod:`.feasibility`'s any-count checks that ``stages=None`` uses.
"""
from __future__ import annotations

import numpy as np

from .feasibility import _BIG, _Inst, _v


def check_exact(inst: _Inst, tau: float, stages: int
                ) -> tuple[list[tuple[int, int, bool]] | None, float]:
    """Like :func:`check_budget` with exactly ``stages`` stages. Exactly-s covers are not
    prefix-closed, so each state keeps the full set of coverable prefix ends (O(N) per state).
    Every start is tried, so a reach that is not monotone in the start (recomputation, see
    recompute.py) is handled: each flag of ``inst.flags`` adds its own coverable ends."""
    n, m = inst.n, inst.m
    la_ok = inst.cutm <= min(tau, _BIG)
    nxt = inst.next_cut_value(tau)
    zero = np.zeros(n + 1, dtype=bool)
    zero[0] = True
    E = [[zero] * (m + 1)]  # E[s][k]: ends coverable by exactly s stages within budget k
    for s in range(1, stages + 1):
        row = [np.zeros(n + 1, dtype=bool)]
        for k in range(1, m + 1):
            acc = row[k - 1].copy()
            for r in inst.rs:
                if r > k:
                    break
                starts = np.flatnonzero(E[s - 1][k - r][:n] & la_ok[r, :n])
                if starts.size == 0:
                    continue
                for x in inst.flags:
                    e, et = inst.reach_many(r, _v(m, k, r), starts, tau, x)
                    grow = et < n
                    if grow.any():
                        nxt = min(nxt, float(inst.time_many(r, starts[grow], et[grow] + 1,
                                                            x).min()))
                    keep = e > starts
                    diff = np.zeros(n + 2, dtype=np.int64)
                    np.add.at(diff, starts[keep] + 1, 1)
                    np.add.at(diff, e[keep] + 1, -1)
                    acc |= np.cumsum(diff)[: n + 1] > 0
            row.append(acc)
        E.append(row)
    if not E[stages][m][n]:
        return None, nxt
    out: list[tuple[int, int, bool]] = []
    x, k = n, m
    for s in range(stages, 0, -1):
        while k > 1 and E[s][k - 1][x]:
            k -= 1
        found = None
        for r in inst.rs:
            if r > k:
                break
            v = _v(m, k, r)
            for a in np.flatnonzero(E[s - 1][k - r][:x] & la_ok[r, :x]).tolist()[::-1]:
                for f in inst.flags:
                    if inst.time(r, a, x, f) <= tau and (inst.cap is None
                                                         or inst.mem(r, v, a, x, f) <= inst.cap):
                        found = (a, r, f)
                        break
                if found:
                    break
            if found:
                break
        assert found is not None, "exact-stage reconstruction lost its witness"
        out.append(found)
        x, k = found[0], k - found[1]
    out.reverse()
    return out, nxt
