"""A memory rule that lists each stage's activation sets (passes/memory_rule.py, held="listed"):
counted by hand, refused when malformed, round-tripped through JSON, and the exact search's
optimum under it equal to brute force over every straight split."""
from __future__ import annotations

import itertools
import math
import random

import pytest

from fxpipe.errors import ConfigError, InfeasiblePlanError, PlanFormatError
from fxpipe.passes.memory_rule import MemoryRule
from fxpipe.passes.solver import evaluate, solve


def test_count_by_hand() -> None:
    rule = MemoryRule("dualpipev", "none", "listed", 8, listed=(4, 3, 2, 1))
    # stage s of a straight 4-stage pipeline has window 4 - s: the list is read by stage
    assert [rule.count(v, 1, 4) for v in (4, 3, 2, 1)] == [4, 3, 2, 1]
    assert rule.count(9, 1, 4) == 4  # a window beyond the list: its first stage's
    assert rule.stashed(4) == 0.0  # no stashed versions under a flushing kind
    assert MemoryRule("x", "none", "listed", listed=(5, 5), limit=3).count(2, 1, 2) == 3
    assert rule.label() == "dualpipev (m=8, sets held per stage 4-3-2-1)"


@pytest.mark.parametrize("held, listed", [("listed", ()), ("window", (2, 1)),
                                          ("listed", (2, -1)), ("listed", (2, True))])
def test_a_malformed_list_is_refused(held: str, listed: tuple) -> None:
    with pytest.raises(ConfigError, match="'listed' takes one count >= 0 per stage in listed"):
        MemoryRule("x", "none", held, listed=listed)
    with pytest.raises(ConfigError, match="in listed_full"):
        MemoryRule("x", "none", "window", recomputed="listed")


def test_recomputed_sets_by_hand() -> None:
    rule = MemoryRule("zb-v", "none", "listed", 4, split=2, recomputed="listed",
                      listed=(2, 2, 2), listed_full=(1, 3, 2))
    # stage s has window 3 - s; each set is half the profiled minibatch's (split 2)
    assert [rule.recomputed_sets(v, 1, 3) for v in (3, 2, 1)] == [0.5, 1.5, 1.0]


def test_it_round_trips_through_json() -> None:
    import json

    rule = MemoryRule("zb-v", "none", "listed", 4, recomputed="listed", listed=(2, 2, 2, 2),
                      listed_full=(1, 2, 2, 1))
    d = json.loads(json.dumps(rule.to_dict()))
    assert d["listed"] == [2, 2, 2, 2] and d["listed_full"] == [1, 2, 2, 1]
    assert MemoryRule.from_dict(d) == rule
    assert "listed" not in MemoryRule().to_dict()  # plans without it load as before
    with pytest.raises(PlanFormatError, match="field 'memory_rule'"):
        MemoryRule.from_dict({**d, "listed": []})


def _brute(C, P, A, cb, S, rule, cap, opt):
    best = math.inf
    for cuts in itertools.combinations(range(1, len(C)), S - 1):
        sol = evaluate(C, P, A, cb, S, [1.0] * (S + 1), [0.0] * (S + 1), [1.0] * (S + 1),
                       [0, *cuts], [1] * S, optimizer_state_factor=opt, memory_rule=rule)
        if max(sol.memory) <= cap:
            best = min(best, sol.bottleneck)
    return best


def test_the_exact_search_under_a_list_matches_brute_force() -> None:
    """Straight splits into S stages (the placed kinds' virtual pipelines), each stage's memory
    its state plus its listed sets of activations, under a cap: the optimum bottleneck of the
    exact search equals the best of every split that fits (or neither exists)."""
    rng = random.Random(7)
    checked = infeasible = 0
    for _ in range(150):
        n, S = rng.randint(3, 8), rng.randint(2, 4)
        if S > n:
            continue
        C = [rng.uniform(0.1, 3.0) for _ in range(n)]
        P = [float(rng.randint(0, 5)) for _ in range(n)]
        A = [float(rng.randint(0, 5)) for _ in range(n)]
        cb = [rng.uniform(0.0, 2.0) for _ in range(n - 1)]
        listed = tuple(rng.randint(0, 2 * S) for _ in range(S))
        rule = MemoryRule("dualpipev", "none", "listed", 2 * S, listed=listed)
        cap, opt = rng.uniform(5.0, 60.0), rng.choice([0.0, 2.0])
        want = _brute(C, P, A, cb, S, rule, cap, opt)
        ones, zeros = [1.0] * (S + 1), [0.0] * (S + 1)
        try:
            got = solve(C, P, A, cb, S, ones, zeros, ones, memory_cap=cap, stages=S,
                        straight=True, optimizer_state_factor=opt, memory_rule=rule)
        except InfeasiblePlanError:
            assert want == math.inf
            infeasible += 1
            continue
        assert math.isclose(got.bottleneck, want, rel_tol=1e-9), (n, S, listed)
        assert max(got.memory) <= cap
        checked += 1
    assert checked > 50 and infeasible > 5  # both branches seen
