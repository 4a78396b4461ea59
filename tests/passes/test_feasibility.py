"""The solver's building blocks, each against its one-line contract checked by brute force.

``test_solver_bruteforce`` checks the answers; these check the pieces that produce them on inputs
the end-to-end tests rarely reach: hints that are far off (the monotone searches must still land
on the exact boundary), long runs of forbidden cuts, feasibility checks that must prove a whole
interval of budgets infeasible, exact stage counts. Instances are small and every plan is
enumerated; plan costs come from the instance's own ``evaluate`` (the expressions the checks must
agree with to the last bit; that those expressions are right is test_solver_bruteforce's job).
"""
from __future__ import annotations

import dataclasses
import itertools
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_solver_bruteforce import coeffs
from pd_oracle import Net

from fxpipe.passes.exact_stages import check_exact
from fxpipe.passes.feasibility import INF, _Inst, _v, check_budget, fewest_stages

SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])


def make(C, P, A, cb, net: Net, cap=None, opt=1.0, straight=False) -> _Inst:
    a, b, g = coeffs(net)
    return _Inst(C, P, A, cb, net.workers, a, b, g, cap, opt, straight)


def plans(inst: _Inst, stages: int | None = None):
    """Every valid plan: (starts, replicas, Solution), memory cap not applied."""
    n, m = inst.n, inst.m
    for k in range(n):
        if stages is not None and k + 1 != stages:
            continue
        for cuts in itertools.combinations(range(1, n), k):
            if any(math.isinf(inst.cbl[p]) for p in cuts):
                continue
            for rv in itertools.product(inst.rs, repeat=k + 1):
                if sum(rv) <= m:
                    yield (0, *cuts), rv, inst.evaluate([0, *cuts], rv)


def fits(inst: _Inst, sol) -> bool:
    return inst.cap is None or all(x <= inst.cap for x in sol.memory)


ints = st.integers(0, 60).map(float)
secs = st.sampled_from([0.0, 0.25, 0.5, 1.0, 1.5, 3.0, 0.1, 0.3])


@st.composite
def insts(draw, max_n: int = 5, max_m: int = 3):
    n = draw(st.integers(1, max_n))
    m = draw(st.integers(1, max_m))
    net = Net(m, draw(st.sampled_from([10.0, 100.0])), draw(st.sampled_from([10.0, 100.0, 1e3])),
              draw(st.sampled_from([1, m])), draw(st.sampled_from(["allreduce",
                                                                   "parameter-server"])))
    C = draw(st.lists(secs, min_size=n, max_size=n))
    P = draw(st.lists(ints, min_size=n, max_size=n))
    A = draw(st.lists(ints, min_size=n, max_size=n))
    cb = draw(st.lists(st.one_of(ints, st.just(math.inf)), min_size=n - 1, max_size=n - 1))
    cap = draw(st.one_of(st.none(), st.integers(0, 600).map(float)))
    return make(C, P, A, cb, net, cap, draw(st.sampled_from([0.0, 1.0])), draw(st.booleans()))


def taus(inst: _Inst, draw) -> float:
    """A budget worth checking: a plan's exact bottleneck, just below one, or anything."""
    values = sorted({sol.bottleneck for *_, sol in plans(inst)})
    v = draw(st.sampled_from(values)) if values else 1.0
    return draw(st.sampled_from([v, v * (1 - 1e-12), v * (1 + 1e-12), math.inf, 0.0,
                                 draw(st.floats(0, 20))]))


# ---------------------------------------------------------------- monotone searches
@settings(max_examples=300, **SETTINGS)
@given(st.data())
def test_search_lands_on_the_exact_boundary_whatever_the_hint(data) -> None:
    """_search(key, lim, a, f, lo) = the largest e in [a, n] with f(e); ``key`` and ``lo`` are
    only hints (here arbitrary: too short, too long, flat), so the stepping and the binary
    search behind it must find the boundary t from anywhere."""
    n = data.draw(st.integers(1, 60))
    inst = make([1.0] * n, [0.0] * n, [0.0] * n, [0.0] * (n - 1), Net(1, 1.0, 1.0))
    a = data.draw(st.integers(0, n))
    t = data.draw(st.integers(a, n))
    key = sorted(data.draw(st.lists(st.sampled_from([0.0, 1.0, 2.0, 5.0, 40.0]),
                                    min_size=n + 1, max_size=n + 1)))
    lim = data.draw(st.sampled_from([-1.0, 0.0, 0.5, 3.0, 100.0]))
    lo = data.draw(st.integers(-1, t))
    calls: list[int] = []

    def f(e: int) -> bool:
        calls.append(e)
        return e <= t

    assert inst._search(key, lim, a, f, lo) == t
    assert all(max(a, lo) <= e <= n for e in calls)  # never asks outside [start, n]


@settings(max_examples=200, **SETTINGS)
@given(insts(), st.data())
def test_reach_is_the_furthest_end_under_time_and_memory(inst: _Inst, data) -> None:
    r = data.draw(st.sampled_from(inst.rs))
    v = data.draw(st.integers(1, 4))
    a = data.draw(st.integers(0, inst.n))
    tau = taus(inst, data.draw)
    ends = range(a, inst.n + 1)
    et = max(e for e in ends if e == a or inst.time(r, a, e) <= tau)
    em = max(e for e in ends if e == a or inst.cap is None or inst.mem(r, v, a, e) <= inst.cap)
    want = (min(et, em), et)
    both = [e for e in ends if e == a or (inst.time(r, a, e) <= tau and (
        inst.cap is None or inst.mem(r, v, a, e) <= inst.cap))]
    lo = data.draw(st.sampled_from([-1, *both]))
    assert inst.reach(r, v, a, tau, lo) == want
    assert inst.reach(r, v, a, tau) == want
    got_e, got_et = inst.reach_many(r, v, np.array([a, a]), tau)
    assert got_e.tolist() == [want[0]] * 2 and got_et.tolist() == [want[1]] * 2
    es = np.arange(a, inst.n + 1)
    aa = np.full_like(es, a)
    assert inst.time_many(r, aa, es).tolist() == [inst.time(r, a, e) for e in es]
    assert inst.mem_many(r, v, aa, es).tolist() == [inst.mem(r, v, a, e) for e in es]


@settings(max_examples=200, **SETTINGS)
@given(insts(), st.data())
def test_reach_many_is_each_lanes_furthest_end(inst: _Inst, data) -> None:
    """Every start at once (lanes whose guesses are right, off by a step, or far off): each
    lane's ends as the brute force over [a, n] finds them."""
    r = data.draw(st.sampled_from(inst.rs))
    v = data.draw(st.integers(1, 4))
    tau = taus(inst, data.draw)
    starts = np.array(data.draw(st.lists(st.integers(0, inst.n), min_size=1, max_size=12)))
    got_e, got_et = inst.reach_many(r, v, starts, tau)
    for a, e, et in zip(starts.tolist(), got_e.tolist(), got_et.tolist()):
        ends = range(a, inst.n + 1)
        want_t = max(f for f in ends if f == a or inst.time(r, a, f) <= tau)
        want_m = max(f for f in ends if f == a or inst.cap is None
                     or inst.mem(r, v, a, f) <= inst.cap)
        assert (e, et) == (min(want_t, want_m), want_t)


@settings(max_examples=200, **SETTINGS)
@given(st.data())
def test_search_many_corrects_any_guess(data) -> None:
    """The vectorised search for a monotone predicate is exact whatever its prefix-sum guess
    says: right, a step off (corrected), or far off (found by bisection): a key of zeros
    guesses n for every lane, a steep one guesses the lane's start."""
    n = data.draw(st.integers(1, 40))
    inst = make([1.0] * n, [1.0] * n, [1.0] * n, [1.0] * (n - 1), Net(1, 10.0, 10.0, 1,
                                                                            "allreduce"))
    starts = np.array(data.draw(st.lists(st.integers(0, n), min_size=1, max_size=10)))
    limit = {a: data.draw(st.integers(a, n)) for a in set(starts.tolist())}  # f true up to it
    kind = data.draw(st.sampled_from(["zeros", "steep", "random"]))
    key = {"zeros": np.zeros(n + 1), "steep": np.arange(n + 1) * 1e9,
           "random": np.cumsum(data.draw(st.lists(st.floats(0, 5), min_size=n + 1,
                                                  max_size=n + 1)))}[kind]
    lim = data.draw(st.floats(0, 10))

    def f(a: np.ndarray, e: np.ndarray) -> np.ndarray:
        return e <= np.array([limit[x] for x in a.tolist()], dtype=np.int64)
    got = inst._search_many(key, lim, starts, f)
    assert got.tolist() == [limit[a] for a in starts.tolist()]


@settings(max_examples=150, **SETTINGS)
@given(st.data())
def test_last_allowed_cut_and_the_cheapest_rejected_one(data) -> None:
    """la(r, x) = (the last start <= x whose cut into r replicas costs <= tau (0 is always
    allowed), the least cost among the rejected positions after it); long runs of rejected
    cuts (more than 16) take the whole-row path."""
    n = data.draw(st.integers(2, 40))
    m = data.draw(st.integers(1, 3))
    cb = data.draw(st.lists(st.sampled_from([1.0, 5.0, 9.0, 50.0, math.inf]), min_size=n - 1,
                            max_size=n - 1))
    inst = make([1.0] * n, [0.0] * n, [0.0] * n, cb, Net(m, 2.0, 2.0))
    tau = data.draw(st.sampled_from([0.0, 1.0, 2.5, 5.0, 30.0, math.inf]))
    la = inst.last_allowed(tau)
    for r in inst.rs:
        for x in [*range(-1, n + 2), *range(n, -2, -1)]:  # both orders: rows are cached
            got = la(r, x)
            if x <= 0 or x >= n:
                assert got == (x, INF)
                continue
            cost = [0.0] + [inst.cut(r, p) for p in range(1, n)]
            t = min(tau, np.finfo(float).max)  # a forbidden (inf) cut stays forbidden at inf
            a = max(p for p in range(x + 1) if p == 0 or cost[p] <= t)
            rej = min((cost[p] for p in range(a + 1, x + 1)), default=INF)
            assert got == (a, rej), (r, x, tau)
    finite = {c * g for c in cb if c != math.inf for g in coeffs(Net(m, 2.0, 2.0))[2]}
    assert inst.next_cut_value(tau) == min((c for c in finite if c > tau), default=INF)


# ---------------------------------------------------------------- feasibility checks
def check_plan(inst: _Inst, stages, tau: float):
    """A returned plan is valid, within tau, within the memory cap: its Solution."""
    starts, reps = [p[0] for p in stages], [p[1] for p in stages]  # check_exact adds a flag
    assert all(not p[2] for p in stages if len(p) > 2)  # no recomputation on these instances
    assert starts[0] == 0 and starts == sorted(set(starts)) and starts[-1] < inst.n
    assert sum(reps) <= inst.m and all(r in inst.rs for r in reps)
    assert all(not math.isinf(inst.cbl[a]) for a in starts[1:])
    sol = inst.evaluate(starts, reps)
    assert sol.bottleneck <= tau and fits(inst, sol)
    return sol


@settings(max_examples=200, **SETTINGS)
@given(insts(), st.data())
def test_check_budget_is_exact_and_its_skip_is_safe(inst: _Inst, data) -> None:
    """A plan within tau exists iff check_budget finds one; when it finds none, no plan is
    within any value below the ``nxt`` it reports (what lets the search jump there)."""
    tau = taus(inst, data.draw)
    best = min((sol.bottleneck for *_, sol in plans(inst) if fits(inst, sol)), default=INF)
    plan, nxt = check_budget(inst, tau)
    if plan is not None:
        check_plan(inst, plan, tau)
    else:
        assert (best > tau or best == INF) and best >= nxt and (nxt > tau or nxt == INF)


@settings(max_examples=200, **SETTINGS)
@given(insts(), st.data())
def test_fewest_stages_within_a_budget(inst: _Inst, data) -> None:
    tau = taus(inst, data.draw)
    ok = [len(s) for s, _, sol in plans(inst) if sol.bottleneck <= tau and fits(inst, sol)]
    got = fewest_stages(inst, tau)
    if not ok:
        assert got is None
    else:
        assert got is not None and len(got) == min(ok)
        check_plan(inst, got, tau)


@settings(max_examples=200, **SETTINGS)
@given(insts(), st.data())
def test_check_exact_stage_count(inst: _Inst, data) -> None:
    S = data.draw(st.integers(1, min(inst.n, inst.m)))
    tau = taus(inst, data.draw)
    best = min((sol.bottleneck for *_, sol in plans(inst, S) if fits(inst, sol)), default=INF)
    plan, nxt = check_exact(inst, tau, S)
    if plan is not None:
        assert len(plan) == S
        check_plan(inst, plan, tau)
    else:
        assert (best > tau or best == INF) and best >= nxt and (nxt > tau or nxt == INF)


def test_in_flight_count_of_a_budget() -> None:
    """_v(m, k, r): a stage with r replicas whose prefix budget (itself included) is k, of m
    workers, has m - k + r workers from it on: ceil((m - k + r) / r) minibatches in flight."""
    assert [_v(8, k, 2) for k in (2, 3, 8)] == [4, 4, 1]  # 8/2, 7/2 -> 4, 2/2
    assert [_v(4, k, 3) for k in (3, 4)] == [2, 1]  # 4/3 -> 2, 3/3


def test_bad_instances_are_refused() -> None:
    a, b, g = coeffs(Net(2, 1.0, 1.0))
    sizes = r"^compute/parameters/activations need N >= 1 entries and cut_bytes N-1$"
    with pytest.raises(ValueError, match=sizes):
        _Inst([], [], [], [], 2, a, b, g, None, 1.0, False)
    for bad in (([1.0], [1.0, 2.0], [1.0], []), ([1.0], [1.0], [], []),
                ([1.0, 1.0], [1.0, 1.0], [1.0, 1.0], [])):
        with pytest.raises(ValueError, match=sizes):
            _Inst(*bad, 2, a, b, g, None, 1.0, False)
    coeff = r"^need workers >= 1 and alpha/beta/gamma for r = 1\.\.workers$"
    with pytest.raises(ValueError, match=coeff):
        _Inst([1.0], [1.0], [1.0], [], 0, a, b, g, None, 1.0, False)
    with pytest.raises(ValueError, match=coeff):
        _Inst([1.0], [1.0], [1.0], [], 3, a, b, g, None, 1.0, False)
    with pytest.raises(ValueError, match=r"^recompute must be one of \('never', 'always', "
                                         r"'auto'\), got 'sometimes'$"):
        _Inst([1.0], [1.0], [1.0], [], 2, a, b, g, None, 1.0, False, "sometimes")
    for forward in (None, [1.0, 1.0]):  # missing, or not one per node
        with pytest.raises(ValueError, match=r"^recompute needs forward times for the N nodes$"):
            _Inst([1.0], [1.0], [1.0], [], 2, a, b, g, None, 1.0, False, "auto", forward)
    sol = make([1.0], [1.0], [1.0], [], Net(2, 1.0, 1.0)).evaluate([0], [2])
    with pytest.raises(dataclasses.FrozenInstanceError):
        sol.bottleneck = 0.0  # type: ignore[misc]


@st.composite
def recomputing_insts(draw, max_n: int = 6, max_m: int = 3):
    """Instances whose stages may recompute: a forward time and held bytes per node."""
    n = draw(st.integers(1, max_n))
    m = draw(st.integers(1, max_m))
    net = Net(m, draw(st.sampled_from([10.0, 100.0])), draw(st.sampled_from([10.0, 1e3])),
              1, "allreduce")
    a, b, g = coeffs(net)
    C = draw(st.lists(secs, min_size=n, max_size=n))
    cap = draw(st.one_of(st.none(), st.integers(0, 600).map(float)))
    return _Inst(C, draw(st.lists(ints, min_size=n, max_size=n)),
                 draw(st.lists(ints, min_size=n, max_size=n)),
                 draw(st.lists(ints, min_size=n - 1, max_size=n - 1)), m, a, b, g, cap,
                 draw(st.sampled_from([0.0, 1.0])), False, "auto",
                 [c / 3 for c in C], draw(st.lists(ints, min_size=n, max_size=n)))


@settings(max_examples=200, **SETTINGS)
@given(recomputing_insts(), st.data())
def test_reach_many_of_recomputing_lanes_is_each_lanes_furthest_end(inst: _Inst, data) -> None:
    """A recomputing stage (x): one more forward, its input and held bytes per set instead of
    its activations; every lane's ends as the brute force finds them."""
    r = data.draw(st.sampled_from(inst.rs))
    v = data.draw(st.integers(1, 4))
    tau = data.draw(st.sampled_from([math.inf, 0.0, data.draw(st.floats(0, 20))]))
    starts = np.array(data.draw(st.lists(st.integers(0, inst.n), min_size=1, max_size=8)))
    got_e, got_et = inst.reach_many(r, v, starts, tau, x=True)
    for a, e, et in zip(starts.tolist(), got_e.tolist(), got_et.tolist()):
        ends = range(a, inst.n + 1)
        want_t = max(f for f in ends if f == a or inst.time(r, a, f, True) <= tau)
        want_m = max(f for f in ends if f == a or inst.cap is None
                     or inst.mem(r, v, a, f, True) <= inst.cap)
        assert (e, et) == (min(want_t, want_m), want_t)


def test_recomputing_lanes_are_found_from_their_own_prefix_sums(monkeypatch) -> None:
    """The guess for a recomputing lane comes from its own keys (forward twice; input and held
    bytes, not activations), so no lane of a plain chain falls back to bisection."""
    rng = np.random.default_rng(0)
    n = 60
    net = Net(2, 100.0, 1e3, 1, "allreduce")
    a, b, g = coeffs(net)
    C = rng.uniform(0.1, 2.0, n).tolist()
    P, A, cb, H = (rng.uniform(0, 50, n).tolist(), rng.uniform(0, 80, n).tolist(),
                   rng.uniform(100, 300, n - 1).tolist(), rng.uniform(0, 10, n).tolist())
    fell_back = []
    for cap in (600.0, 2000.0):  # memory binding at the first cap, time at the second
        inst = _Inst(C, P, A, cb, 2, a, b, g, cap, 1.0, False, "auto", [c / 3 for c in C], H)
        real = inst._bisect
        monkeypatch.setattr(inst, "_bisect", lambda lanes, f, real=real: fell_back.append(
            len(lanes)) or real(lanes, f))
        for tau in (5.0, 20.0, 60.0):
            e, et = inst.reach_many(1, 2, np.arange(n + 1), tau, x=True)
            assert cap == 2000.0 or (e < et).any()  # the cap decides some lanes
    assert fell_back == []
