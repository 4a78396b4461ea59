"""Feasibility with an exact stage count (``partition(..., stages=S)``).

Exactly-S covers are not prefix-closed (dropping a stage changes the count), so unlike
:func:`~fxpipe.passes.feasibility.check_budget` each state keeps the full set of coverable prefix
ends as a boolean array: O(S M^2 N) per check, vectorised with numpy. Fine for real models; the
fast path (stages=None) is what scales to 10,000 nodes.
"""
from __future__ import annotations

import numpy as np

from .feasibility import _BIG, Stages, _Inst, _v


def check_exact(inst: _Inst, tau: float, stages: int) -> tuple[Stages | None, float]:
    """Like :func:`check_budget` with exactly ``stages`` stages. Exactly-s covers are not
    prefix-closed, so each state keeps the full set of coverable prefix ends (O(N) per state)."""
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
                e, et = inst.reach_many(r, _v(m, k, r), starts, tau)
                grow = et < n
                if grow.any():
                    nxt = min(nxt, float(inst.time_many(r, starts[grow], et[grow] + 1).min()))
                keep = e > starts
                diff = np.zeros(n + 2, dtype=np.int64)
                np.add.at(diff, starts[keep] + 1, 1)
                np.add.at(diff, e[keep] + 1, -1)
                acc |= np.cumsum(diff)[: n + 1] > 0
            row.append(acc)
        E.append(row)
    if not E[stages][m][n]:
        return None, nxt
    out: Stages = []
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
                if inst.time(r, a, x) <= tau and (inst.cap is None or inst.mem(v, a, x) <= inst.cap):
                    found = (a, r)
                    break
            if found:
                break
        assert found is not None, "exact-stage reconstruction lost its witness"
        out.append(found)
        x, k = found[0], k - found[1]
    out.reverse()
    return out, nxt
