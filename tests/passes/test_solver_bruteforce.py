"""The exact solver against a literal brute force on small random instances."""
from __future__ import annotations

import itertools
import math

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fxpipe.errors import InfeasiblePlanError
from fxpipe.passes.solver import evaluate, solve


def coeffs(m: int, sync: str, bw: float, intra: float, wpm: int) -> tuple[list, list, list]:
    a, b, g = [], [], []
    for r in range(1, m + 1):
        w = intra if r <= wpm else bw
        a.append(1.0 / r)
        b.append((2.0 if sync == "allreduce" else 4.0) * (r - 1) / r / w / r)
        g.append(2.0 / (bw * r))
    return a, b, g


def brute(C, P, A, cb, m, a, b, g, cap, opt, stages, straight):
    """Enumerate every cut set and replica vector; return (best value, min stages at best)."""
    n = len(C)
    best, best_s = math.inf, None
    for k in range(n):
        for cuts in itertools.combinations(range(1, n), k):
            s = k + 1
            if stages is not None and s != stages:
                continue
            if any(math.isinf(cb[p - 1]) for p in cuts):
                continue
            starts = [0, *cuts]
            reps = [(1,) * s] if straight else [
                rv for rv in itertools.product(range(1, m + 1), repeat=s) if sum(rv) <= m]
            for rv in reps:
                if sum(rv) > m:
                    continue
                sol = evaluate(C, P, A, cb, m, a, b, g, starts, rv, optimizer_state_factor=opt)
                if cap is not None and any(x > cap for x in sol.memory):
                    continue
                if sol.bottleneck < best or (sol.bottleneck == best and s < best_s):
                    best, best_s = sol.bottleneck, s
    return best, best_s


vals = st.floats(0.0, 10.0, allow_nan=False).map(lambda x: round(x, 2))


@st.composite
def instances(draw):
    n = draw(st.integers(1, 7))
    m = draw(st.integers(1, 5))
    C = draw(st.lists(vals, min_size=n, max_size=n))
    P = draw(st.lists(vals, min_size=n, max_size=n))
    A = draw(st.lists(vals, min_size=n, max_size=n))
    cb = draw(st.lists(st.one_of(vals, st.just(math.inf)), min_size=n - 1, max_size=n - 1))
    sync = draw(st.sampled_from(["allreduce", "parameter-server"]))
    bw = draw(st.sampled_from([0.5, 1.0, 4.0, 100.0]))
    wpm = draw(st.sampled_from([1, 2, m]))
    intra = bw * draw(st.sampled_from([1.0, 10.0]))
    cap = draw(st.one_of(st.none(), st.floats(1.0, 200.0).map(lambda x: round(x, 1))))
    opt = draw(st.sampled_from([0.0, 1.0, 2.0]))
    stages = draw(st.one_of(st.none(), st.integers(1, min(n, m))))
    straight = draw(st.booleans())
    return C, P, A, cb, m, coeffs(m, sync, bw, intra, wpm), cap, opt, stages, straight


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(instances())
def test_solver_matches_brute_force(inst) -> None:
    C, P, A, cb, m, (a, b, g), cap, opt, stages, straight = inst
    want, want_s = brute(C, P, A, cb, m, a, b, g, cap, opt, stages, straight)
    try:
        sol = solve(C, P, A, cb, m, a, b, g, memory_cap=cap, optimizer_state_factor=opt,
                    stages=stages, straight=straight)
    except InfeasiblePlanError:
        assert want == math.inf
        return
    assert want < math.inf
    assert sol.bottleneck == want  # exact, not approximately
    again = evaluate(C, P, A, cb, m, a, b, g, sol.starts, sol.replicas, optimizer_state_factor=opt)
    assert again.bottleneck == sol.bottleneck
    assert sum(sol.replicas) <= m and all(r >= 1 for r in sol.replicas)
    assert list(sol.starts) == sorted(set(sol.starts)) and sol.starts[0] == 0
    assert all(not math.isinf(cb[p - 1]) for p in sol.starts[1:])
    if cap is not None:
        assert all(x <= cap for x in sol.memory)
    if straight:
        assert set(sol.replicas) == {1}
    if stages is not None:
        assert len(sol.replicas) == stages
    else:
        assert len(sol.replicas) == want_s  # ties: fewest stages (data parallelism first)


def test_data_parallel_preferred_on_tie() -> None:
    # zero communication: one stage on all workers ties with any pipeline; DP must win.
    C, P, A = [1.0, 1.0, 1.0, 1.0], [0.0] * 4, [0.0] * 4
    a, b, g = coeffs(4, "allreduce", 1e30, 1e30, 1)
    sol = solve(C, P, A, [0.0] * 3, 4, a, b, g)
    assert sol.replicas == (4,) and sol.bottleneck == 1.0


def test_large_instance_is_fast_and_beats_neighbours() -> None:
    import random
    import time
    rng = random.Random(1)
    n, m = 2000, 32
    C = [rng.uniform(1e-4, 2e-3) for _ in range(n)]
    P = [rng.uniform(0, 4e6) if rng.random() < 0.3 else 0.0 for _ in range(n)]
    A = [rng.uniform(1e5, 1e7) for _ in range(n)]
    cb = [rng.uniform(1e5, 5e7) for _ in range(n - 1)]
    a, b, g = coeffs(m, "allreduce", 1.25e9, 1.25e9, 1)
    t = time.perf_counter()
    sol = solve(C, P, A, cb, m, a, b, g)
    assert time.perf_counter() - t < 5.0
    # moving any single boundary by one node never helps
    for i in range(1, len(sol.starts)):
        for d in (-1, 1):
            st_ = list(sol.starts)
            st_[i] += d
            if st_ != sorted(set(st_)) or st_[-1] >= n:
                continue
            other = evaluate(C, P, A, cb, m, a, b, g, st_, sol.replicas)
            assert other.bottleneck >= sol.bottleneck
