"""The solver's feasibility checks: is there a plan with bottleneck at most ``tau``, in few stages?

:class:`_Inst` holds an instance's prefix sums and the ONLY cost expressions decisions use (its
vectorised twins do the same IEEE operations), so plans are optimal exactly in floating point.
"""
from __future__ import annotations

import math
from bisect import bisect_right
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from .copies import Copies, Shared
from .memory_rule import PIPEDREAM, MemoryRule

INF = math.inf
RECOMPUTE_MODES = ("never", "always", "auto")
_BIG = np.finfo(float).max


@dataclass(frozen=True)
class Solution:
    """A partition and its costs; ``starts[s]`` is the first node of stage ``s``."""

    bottleneck: float
    starts: tuple[int, ...]
    replicas: tuple[int, ...]
    compute_times: tuple[float, ...]   # alpha[r] * C_s
    sync_times: tuple[float, ...]      # beta[r] * P_s
    stage_times: tuple[float, ...]     # the stage's own time (compute + sync)
    cut_bytes: tuple[float, ...]       # bytes into stage s (0 for stage 0)
    cut_times: tuple[float, ...]       # gamma[r] * bytes into stage s (0 for stage 0)
    memory: tuple[float, ...]          # bytes per replica
    in_flight: tuple[int, ...]         # v_s
    checks: int = 0                    # feasibility checks the search used (diagnostics)
    recompute: tuple[bool, ...] = ()   # per stage: activation recomputation (() = none)
    recompute_times: tuple[float, ...] = ()  # alpha[r] * F_s where recomputing, else 0
    copies: tuple[float, ...] = ()     # bytes of shared parameters stage s keeps a copy of


def replica_state(opt: float, sharded: float, r: int) -> float:
    """Optimizer state per parameter byte one of ``r`` replicas keeps when ``sharded`` bytes
    of the ``opt`` are split among them (ZeRO-1); ``opt`` itself for r = 1 or nothing split."""
    return float(opt) - float(sharded) * (1.0 - 1.0 / r)


class _Inst:
    """One problem instance: prefix sums and the exact cost expressions."""

    def __init__(self, compute: Sequence[float], parameters: Sequence[float],
                 activations: Sequence[float], cut_bytes: Sequence[float], workers: int,
                 alpha: Sequence[float], beta: Sequence[float], gamma: Sequence[float],
                 memory_cap: float | None, optimizer_state_factor: float, straight: bool,
                 recompute: str = "never", forward: Sequence[float] | None = None,
                 held: Sequence[float] | None = None, rule: MemoryRule = PIPEDREAM,
                 shared: Sequence[Shared] = (), sharded_state: float = 0.0) -> None:
        n = len(compute)
        if n == 0 or len(parameters) != n or len(activations) != n or len(cut_bytes) != n - 1:
            raise ValueError("compute/parameters/activations need N >= 1 entries and cut_bytes N-1")
        if workers < 1 or min(len(alpha), len(beta), len(gamma)) < workers:
            raise ValueError("need workers >= 1 and alpha/beta/gamma for r = 1..workers")
        self.n, self.m = n, workers
        self.Cc = np.concatenate([[0.0], np.cumsum(np.asarray(compute, dtype=float))])
        self.Pc = np.concatenate([[0.0], np.cumsum(np.asarray(parameters, dtype=float))])
        self.Ac = np.concatenate([[0.0], np.cumsum(np.asarray(activations, dtype=float))])
        self.Cl, self.Pl, self.Al = self.Cc.tolist(), self.Pc.tolist(), self.Ac.tolist()
        cb = np.zeros(n + 1)
        cb[1:n] = np.asarray(cut_bytes, dtype=float)
        self.cb = cb
        self.cbl = cb.tolist()
        self.alpha = [0.0] + [float(x) for x in alpha[:workers]]
        self.beta = [0.0] + [float(x) for x in beta[:workers]]
        self.gamma = [1.0] + [float(x) for x in gamma[:workers]]  # index 0 unused
        self.cap = memory_cap
        # activation recomputation (see recompute.py): the flags a stage may take, the forward
        # time it repeats (F) and the bytes of model inputs it keeps per minibatch (H)
        if recompute not in RECOMPUTE_MODES:
            raise ValueError(f"recompute must be one of {RECOMPUTE_MODES}, got {recompute!r}")
        if recompute != "never" and (forward is None or len(forward) != n):
            raise ValueError("recompute needs forward times for the N nodes")
        self.flags = {"never": (False,), "always": (True,), "auto": (False, True)}[recompute]
        self.Fc = np.concatenate([[0.0], np.cumsum(np.asarray(forward if forward is not None
                                                              else np.zeros(n), dtype=float))])
        self.Hc = np.concatenate([[0.0], np.cumsum(np.asarray(held if held is not None
                                                              else np.zeros(n), dtype=float))])
        self.Fl, self.Hl = self.Fc.tolist(), self.Hc.tolist()
        self.opt = float(optimizer_state_factor)
        # per r: the optimizer state a replica keeps when ``sharded_state`` bytes per parameter
        # byte of it are split over the stage's r replicas (ZeRO-1; 0: every replica keeps all)
        self.optr = [0.0] + [replica_state(self.opt, sharded_state, r)
                             for r in range(1, workers + 1)]
        self.rs = [1] if straight else list(range(1, workers + 1))
        # cut cost per (r, position); positions 0 and n never cost anything (always allowed).
        self.cutm = cb[None, :] * np.asarray(self.gamma)[:, None]
        self.cutm[:, 0] = 0.0
        self.cutm[:, n] = 0.0
        self._cut_values: np.ndarray | None = None  # sorted on first use (the search's)
        self.ar = np.arange(n + 1)
        self._tkey: dict[int, list[float]] = {}
        self._mkey: dict[tuple[int, int], list[float]] = {}
        self._tkey_np: dict[tuple[int, bool], np.ndarray] = {}  # keys as arrays (reach_many)
        self._mkey_np: dict[tuple[int, int, bool], np.ndarray] = {}
        self.rule = rule
        self._coef: dict[tuple[int, int], tuple[float, float]] = {}
        self._recomputed: dict[tuple[int, int], float] = {}  # full sets when recomputing
        self.sh = Copies(shared, n)  # a stage's copies of parameters another stage owns

    @property
    def cut_values(self) -> np.ndarray:
        """Every finite cut time, sorted: the thresholds the search steps through (not made
        where a given partition is only priced)."""
        if self._cut_values is None:
            finite = self.cutm[self.rs][:, 1:self.n]
            self._cut_values = np.unique(finite[np.isfinite(finite)])
        return self._cut_values

    # --- the exact cost expressions (the only ones used for decisions) ------------------
    def time(self, r: int, a: int, e: int, x: bool = False) -> float:
        """Stage time; ``x``: recomputing, i.e. one more forward ``F`` per minibatch."""
        if x:
            return (self.alpha[r] * ((self.Cl[e] - self.Cl[a]) + (self.Fl[e] - self.Fl[a]))
                    + self.beta[r] * (self.Pl[e] - self.Pl[a]))
        return self.alpha[r] * (self.Cl[e] - self.Cl[a]) + self.beta[r] * (self.Pl[e] - self.Pl[a])

    def coef(self, r: int, v: int) -> tuple[float, float]:
        """(stashed versions, activation sets held) of a replica of a stage with ``r`` replicas
        and window ``v`` under the instance's memory rule (PipeDream's: ``v - 1``, ``v``)."""
        c = self._coef.get((r, v))
        if c is None:
            c = self._coef[(r, v)] = (self.rule.stashed(v), self.rule.sets(v, r, self.m))
            self._recomputed[(r, v)] = self.rule.recomputed_sets(v, r, self.m)
        return c

    def mem(self, r: int, v: int, a: int, e: int, x: bool = False) -> float:
        """Bytes per replica (``r`` replicas, window ``v``) by the memory rule; ``x``:
        recomputing, so the in-flight sets keep only the stage's inputs (the cut bytes into
        it, and model inputs ``H`` inside it) and one set's activations ``A`` are live at a
        time (the one being recomputed)."""
        k, h = self.coef(r, v)
        p = self.Pl[e] - self.Pl[a]
        if self.sh:
            p = p + self.sh.at(a, e)
        if x:
            return ((2.0 + self.optr[r]) * p + k * p
                    + h * (self.cbl[a] + (self.Hl[e] - self.Hl[a]))
                    + self._recomputed[(r, v)] * (self.Al[e] - self.Al[a]))
        return (2.0 + self.optr[r]) * p + k * p + h * (self.Al[e] - self.Al[a])

    def cut(self, r: int, p: int) -> float:
        return self.cbl[p] * self.gamma[r] if 0 < p < self.n else 0.0

    # --- monotone searches ------------------------------------------------------------
    def _search(self, key: list[float], lim: float, a: int, f: Callable[[int], bool],
                lo: int = -1) -> int:
        """Largest e in [a, n] with f(e) (f monotone true..false, f(a) true).

        ``key[e] - key[a] <= lim`` is a cheap guess (prefix sums round differently from the exact
        expression), corrected by stepping with the exact predicate ``f``."""
        n = self.n
        start = max(a, lo)
        e = bisect_right(key, key[a] + lim, start) - 1
        e = min(max(e, start), n)
        steps = 0
        while e < n and f(e + 1):
            e += 1
            steps += 1
            if steps > 8:  # long flat run at the boundary: exact binary search instead
                lo, hi = e, n
                while lo < hi:
                    mid = (lo + hi + 1) // 2
                    lo, hi = (mid, hi) if f(mid) else (lo, mid - 1)
                return lo
        while e > start and not f(e):
            e -= 1
        return e

    def reach(self, r: int, v: int, a: int, tau: float, lo: int = -1) -> tuple[int, int]:
        """(furthest end under time and memory, furthest end under time alone); ``lo`` is an end
        already known to pass both (a search hint)."""
        tk = self._tkey.get(r)
        if tk is None:
            tk = self._tkey[r] = (self.alpha[r] * self.Cc + self.beta[r] * self.Pc).tolist()
        et = self._search(tk, tau, a, lambda e: self.time(r, a, e) <= tau, lo)
        if self.cap is None or et == a:
            return et, et
        if self.mem(r, v, a, et) <= self.cap:
            return et, et
        mk = self._mkey.get((r, v))
        if mk is None:
            k, h = self.coef(r, v)
            mk = self._mkey[(r, v)] = ((2.0 + self.optr[r] + k) * self.Pc + h * self.Ac).tolist()
        em = self._search(mk, self.cap, a, lambda e: self.mem(r, v, a, e) <= self.cap,  # type: ignore[operator]
                          lo)
        return min(et, em), et

    def time_many(self, r: int, a: np.ndarray, e: np.ndarray, x: bool = False) -> np.ndarray:
        """Vectorised :meth:`time` (same IEEE operations, so the same values)."""
        if x:
            return (self.alpha[r] * ((self.Cc[e] - self.Cc[a]) + (self.Fc[e] - self.Fc[a]))
                    + self.beta[r] * (self.Pc[e] - self.Pc[a]))
        return self.alpha[r] * (self.Cc[e] - self.Cc[a]) + self.beta[r] * (self.Pc[e] - self.Pc[a])

    def mem_many(self, r: int, v: int, a: np.ndarray, e: np.ndarray,
                 x: bool = False) -> np.ndarray:
        """Vectorised :meth:`mem` (same IEEE operations, so the same values)."""
        k, h = self.coef(r, v)
        p = self.Pc[e] - self.Pc[a]
        if self.sh:
            p = p + self.sh.many(a, e)
        if x:
            return ((2.0 + self.optr[r]) * p + k * p
                    + h * (self.cb[a] + (self.Hc[e] - self.Hc[a]))
                    + self._recomputed[(r, v)] * (self.Ac[e] - self.Ac[a]))
        return (2.0 + self.optr[r]) * p + k * p + h * (self.Ac[e] - self.Ac[a])

    def reach_many(self, r: int, v: int, a: np.ndarray, tau: float,
                   x: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """Vectorised :meth:`reach`: the prefix-sum guess of :meth:`_search`, corrected with the
        exact predicate and verified lane by lane (the furthest end passes, the next fails);
        lanes that do not verify are found by exact bisection (log N vector steps)."""
        tk = self._tkey_np.get((r, x))
        if tk is None:  # a recomputing stage runs its forward twice
            tk = self._tkey_np[(r, x)] = (self.alpha[r] * (self.Cc + self.Fc) if x
                                          else self.alpha[r] * self.Cc) + self.beta[r] * self.Pc
        et = self._search_many(tk, tau, a, lambda a_, e: self.time_many(r, a_, e, x) <= tau)
        if self.cap is None:
            return et, et
        cap = self.cap
        k, h = self.coef(r, v)
        mk = self._mkey_np.get((r, v, x))
        if mk is None:  # a recomputing stage holds its input and what it must keep, per set
            per = 2.0 + self.optr[r] + k
            mk = self._mkey_np[(r, v, x)] = (
                per * self.Pc + h * self.Hc + self._recomputed[(r, v)] * self.Ac
                if x else per * self.Pc + h * self.Ac)
        lim = cap - h * self.cb[a] if x else cap
        em = self._search_many(mk, lim, a, lambda a_, e: self.mem_many(r, v, a_, e, x) <= cap)
        return np.minimum(et, em), et

    def _search_many(self, key: np.ndarray, lim: float | np.ndarray, a: np.ndarray,
                     f: Callable[[np.ndarray, np.ndarray], np.ndarray]) -> np.ndarray:
        """Per lane, the largest e in [a, n] with e == a or f(a, e) (f monotone true..false):
        what bisection from [a, n] gives, found from the guess ``key[e] - key[a] <= lim``."""
        n = self.n
        e = np.clip(np.searchsorted(key, key[a] + lim, side="right") - 1, a, n)
        for _ in range(2):  # prefix sums round differently: a step at the boundary
            nxt = np.minimum(e + 1, n)
            up = (e < n) & f(a, nxt)
            down = (e > a) & ~f(a, e)
            e = np.where(up, nxt, np.where(down, e - 1, e))
        nxt = np.minimum(e + 1, n)
        ok = ((e == a) | f(a, e)) & ((e == n) | ~f(a, nxt))
        if not ok.all():
            bad = ~ok
            e = e.copy()
            e[bad] = self._bisect(a[bad], f)
        return e

    def _bisect(self, a: np.ndarray, f: Callable[[np.ndarray, np.ndarray], np.ndarray]
                ) -> np.ndarray:
        lo, hi = a.copy(), np.full_like(a, self.n)
        while True:
            act = lo < hi
            if not act.any():
                return lo
            mid = (lo + hi + 1) // 2
            ok = f(a, mid) & act
            lo = np.where(ok, mid, lo)
            hi = np.where(act & ~ok, mid - 1, hi)

    def last_allowed(self, tau: float) -> "_LastAllowed":
        return _LastAllowed(self, tau)

    def next_cut_value(self, tau: float) -> float:
        values = self.cut_values
        i = int(np.searchsorted(values, tau, side="right"))
        return float(values[i]) if i < len(values) else INF

    # --- evaluation of a given plan ---------------------------------------------------
    def evaluate(self, starts: Sequence[int], replicas: Sequence[int], checks: int = 0,
                 recompute: Sequence[bool] | None = None) -> Solution:
        """Costs of a plan; ``recompute``: one flag per stage (default: the mode's only flag,
        or no recomputation under "auto")."""
        bounds = list(starts) + [self.n]
        flags = (tuple(bool(f) for f in recompute) if recompute is not None
                 else (self.flags[-1] if len(self.flags) == 1 else False,) * len(replicas))
        total = sum(replicas)
        comp, sync, st, cb, ct, mem, vs, rt, cp = [], [], [], [], [], [], [], [], []
        after = total
        for s, (r, x) in enumerate(zip(replicas, flags)):
            a, e = bounds[s], bounds[s + 1]
            v = -(-after // r)
            after -= r
            c = self.alpha[r] * ((self.Cl[e] - self.Cl[a]) + (self.Fl[e] - self.Fl[a]) if x
                                 else self.Cl[e] - self.Cl[a])
            y = self.beta[r] * (self.Pl[e] - self.Pl[a])
            comp.append(c)
            sync.append(y)
            st.append(self.time(r, a, e, x))
            cb.append(self.cbl[a] if s else 0.0)
            ct.append(self.cut(r, a) if s else 0.0)
            mem.append(self.mem(r, v, a, e, x))
            vs.append(v)
            rt.append(self.alpha[r] * (self.Fl[e] - self.Fl[a]) if x else 0.0)
            cp.append(self.sh.at(a, e))
        return Solution(max(st + ct), tuple(starts), tuple(replicas), tuple(comp), tuple(sync),
                        tuple(st), tuple(cb), tuple(ct), tuple(mem), tuple(vs), checks,
                        flags, tuple(rt), tuple(cp))


class _LastAllowed:
    """``la(r, x)`` = last position <= x where a stage with r replicas may start under ``tau``.

    Usually a few steps back from x; a whole row is computed (numpy) only when a scan is long,
    which keeps a check O(M^2) instead of O(M N)."""

    def __init__(self, inst: _Inst, tau: float) -> None:
        self.inst = inst
        self.t = min(tau, float(_BIG))  # forbidden (inf) cuts stay forbidden even at tau = inf
        self.rows: dict[int, list[int]] = {}

    def __call__(self, r: int, x: int) -> tuple[int, float]:
        """(last allowed start <= x, smallest cut cost among the rejected positions in (a, x])."""
        inst, t = self.inst, self.t
        if x >= inst.n or x <= 0:
            return x, INF
        row = self.rows.get(r)
        if row is None:
            g, cbl = inst.gamma[r], inst.cbl
            rejected = INF
            p = x
            for _ in range(16):
                if p <= 0:
                    return 0, rejected
                c = cbl[p] * g
                if c <= t:
                    return p, rejected
                if c < rejected:
                    rejected = c
                p -= 1
            la = np.where(inst.cutm[r] <= t, inst.ar, 0)
            np.maximum.accumulate(la, out=la)
            row = self.rows[r] = la.tolist()
        a = row[x]
        return a, float(inst.cutm[r, a + 1:x + 1].min()) if a < x else INF


def _v(m: int, k: int, r: int) -> int:
    """In-flight count of a stage with r replicas whose prefix budget (this stage included) is k."""
    return -(-(m - k + r) // r)


# --- feasibility checks ----------------------------------------------------------------------
Stages = list[tuple[int, int]]  # (start, replicas) per stage


def check_budget(inst: _Inst, tau: float) -> tuple[Stages | None, float]:
    """Is there a plan with bottleneck <= tau (any number of stages)?

    Returns (a witness plan or None, ``nxt``). When infeasible, every value in ``[tau, nxt)`` is
    infeasible too: ``R(k)`` can only grow when some stage reaches ``R(k) + 1`` (its time there is
    a threshold) or when a rejected cut becomes allowed (its cost is a threshold); ``nxt`` is the
    smallest such threshold."""
    n, m = inst.n, inst.m
    cap = inst.cap
    la = inst.last_allowed(tau)
    nxt = INF
    R = [0] * (m + 1)
    ch: list[tuple[int, int] | None] = [None] * (m + 1)
    for k in range(1, m + 1):
        best, bc = R[k - 1], None
        pairs = []
        for r in inst.rs:
            if r > k:
                break
            a, rejected = la(r, R[k - r])
            if rejected < nxt:
                nxt = rejected
            pairs.append((r, a))
            # exact pruning: a stage that cannot even reach best + 1 cannot improve R(k)
            if inst.time(r, a, best + 1) > tau:
                continue
            v = _v(m, k, r)
            if cap is not None and inst.mem(r, v, a, best + 1) > cap:
                continue
            e, _ = inst.reach(r, v, a, tau, best + 1)
            if e > best:
                best, bc = e, (r, a)
                if best >= n:
                    break
        R[k], ch[k] = best, bc
        if best >= n:
            return _rebuild_budget(ch, R, k, n), nxt
        for r, a in pairs:
            t = inst.time(r, a, best + 1)
            if t < nxt and (cap is None or inst.mem(r, _v(m, k, r), a, best + 1) <= cap):
                nxt = t
    return None, nxt


def _rebuild_budget(ch: list[tuple[int, int] | None], R: list[int], k: int, x: int) -> Stages:
    out: Stages = []
    while x > 0:
        c = ch[k]
        if c is None:
            k -= 1
            continue
        r, a = c
        if a < x:
            out.append((a, r))
            x = a
        k -= r
    out.reverse()
    return out


def fewest_stages(inst: _Inst, tau: float) -> Stages | None:
    """A plan with bottleneck <= tau and as few stages as possible.

    "At most s stages" covers are prefix-closed, so the layered recurrence
    ``R_s(k) = max(R_{s-1}(k), R_s(k-1), max_r reach_r(la_r(R_{s-1}(k-r))))`` is exact. A pair
    (k, r) can only beat ``R_{s-1}(k)`` when ``R_{s-1}(k-r)`` changed in the previous layer, so each
    layer only revisits budgets that just improved."""
    n, m = inst.n, inst.m
    la = inst.last_allowed(tau)
    prev = [0] * (m + 1)
    changed = list(range(m))  # layer 1 builds on the empty prefix at every budget
    layers: list[list[tuple[str, int, int]]] = []
    for _ in range(m):
        cand = prev[:]
        cch: list[tuple[str, int, int]] = [("s", 0, 0)] * (m + 1)
        for kp in changed:
            if prev[kp] >= n:
                continue
            for r in inst.rs:
                k = kp + r
                if k > m:
                    break
                a = la(r, prev[kp])[0]
                best = cand[k]
                if best >= n or inst.time(r, a, best + 1) > tau:
                    continue
                v = _v(m, k, r)
                if inst.cap is not None and inst.mem(r, v, a, best + 1) > inst.cap:
                    continue
                e = inst.reach(r, v, a, tau, best + 1)[0]
                if e > best:
                    cand[k], cch[k] = e, ("r", r, a)
        cur = cand
        for k in range(1, m + 1):  # R_s(k) >= R_s(k-1): a bigger budget may leave workers idle
            if cur[k - 1] > cur[k]:
                cur[k], cch[k] = cur[k - 1], ("k", 0, 0)
        layers.append(cch)
        if cur[m] >= n:
            return backtrack_layers(layers, n, m)
        changed = [k for k in range(m + 1) if cur[k] != prev[k]]
        if not changed:
            return None
        prev = cur
    return None


def backtrack_layers(layers: Sequence[Sequence[tuple[Any, ...]]], n: int, m: int
                     ) -> list[Any]:
    """The cover the layered recurrence found (its last layer reaches ``n`` with budget ``m``):
    walk back through each layer's choices, ``("r", r, a, *extra)`` (a stage from ``a`` on
    ``r`` replicas, carrying ``extra``, e.g. its recompute flag), ``("k", ...)`` (the budget
    below) and ``("s", ...)`` (the layer below); one ``(a, r, *extra)`` per stage, in order."""
    out: list[Any] = []
    x, k, si = n, m, len(layers)
    while x > 0:
        kind, r, a, *extra = layers[si - 1][k]
        if kind == "k":
            k -= 1
        elif kind == "s":
            si -= 1
        else:
            if a < x:
                out.append((a, r, *extra))
                x = a
            si -= 1
            k -= r
    out.reverse()
    return out
