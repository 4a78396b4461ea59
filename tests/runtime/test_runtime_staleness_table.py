"""The staleness report (fxpipe.runtime.staleness) against literal tables and the paper's closed form.

The tables below are written by hand from the definitions in the module doc, not printed by the
code: PipeDream's 1F1B keeps stage s of a straight S-stage pipeline S - 1 - s of its own updates
behind; flush and GPipe apply exact gradients (0); 2BW is one version behind; vertical sync makes
every stage use the input stage's version (S - 1 behind). In global block-update counts
(Randomized PipeDream, Ilin & Richtarik, arXiv 2606.03498) steady-state PipeDream's worst case is
S^2 - S/2 for even S (their closed form; S^2 - ceil(S/2) for odd S, which our count gives).
"""
from __future__ import annotations

import math

import pytest

from fxpipe.runtime.staleness import format_table, own_delays, staleness_table

# own/global per stage, S = 4: worked by hand on the unit-time 1F1B grid (each stage updates once
# every 2 time slots, so S/2 = 2 global updates land per slot; stage s's read-to-update window
# shrinks by one slot per stage towards the output).
TABLE_S4 = {
    "1f1b-flush": [(0, 3), (0, 2), (0, 1), (0, 0)],
    "gpipe": [(0, 3), (0, 2), (0, 1), (0, 0)],
    "2bw": [(1, 7), (1, 6), (1, 5), (1, 4)],
    "pipedream": [(3, 14), (2, 12), (1, 10), (0, 8)],
    "pipedream+vsync": [(3, 18), (3, 16), (3, 14), (3, 12)],
    "localsgd": [(0, 3), (0, 2), (0, 1), (0, 0)],
}
TABLE_S2 = {
    "1f1b-flush": [(0, 1), (0, 0)],
    "gpipe": [(0, 1), (0, 0)],
    "2bw": [(1, 3), (1, 2)],
    "pipedream": [(1, 3), (0, 2)],
    "pipedream+vsync": [(1, 3), (1, 2)],
    "localsgd": [(0, 1), (0, 0)],
}


@pytest.mark.parametrize("S,expected", [(2, TABLE_S2), (4, TABLE_S4)])
def test_literal_table(S: int, expected: dict) -> None:
    got = {v: [tuple(p) for p in st.pairs()] for v, st in staleness_table([1] * S).items()}
    assert got == expected


@pytest.mark.parametrize("S", [2, 3, 4, 5, 6, 8])
def test_pipedream_matches_the_closed_form(S: int) -> None:
    st = staleness_table([1] * S, ["pipedream"])["pipedream"]
    assert [s.own for s in st.stages] == [S - 1 - s for s in range(S)]
    assert st.max_global == st.stages[0].global_ == S * S - math.ceil(S / 2)
    if S % 2 == 0:
        assert st.max_global == S * S - S // 2  # the paper's S^2 - S/2: 14 at S = 4, 60 at S = 8
    # one stage further down: its read-to-update window is 2 unit slots shorter, S/2 updates each
    g = [s.global_ for s in st.stages]
    assert all(a - b == S // 2 for a, b in zip(g, g[1:])) if S % 2 == 0 else g == sorted(g)[::-1]


def test_localsgd_divergence_and_replicated_pipelines() -> None:
    st = staleness_table([1, 1, 1], ["localsgd"], average_every=4)["localsgd"]
    assert [s.divergence for s in st.stages] == [(3 - 1) * (4 - 1)] * 3  # (R-1)(H-1), R = S
    assert st.max_own == 0
    # unequal replicas: vertical sync is left out (version numbers are not comparable)
    tab = staleness_table([2, 1])
    assert "pipedream+vsync" not in tab and tab["pipedream"].max_own >= 1


def test_own_delays_feed_the_optimizer_factory() -> None:
    assert own_delays("pipedream", [1, 1, 1, 1]) == [3, 2, 1, 0]
    assert own_delays("pipedream", [1, 1, 1], vertical_sync=True) == [2, 2, 2]
    assert own_delays("1f1b-flush", [1, 1, 1]) == [0, 0, 0]
    assert own_delays("2bw", [1, 1]) == [1, 1]


def test_format_table_is_readable() -> None:
    text = format_table(staleness_table([1, 1], ["pipedream", "1f1b-flush"]))
    assert text.splitlines()[1].split() == ["pipedream", "1/3", "0/2"]
    deep = format_table({"pipedream": [(o, 2 * o) for o in range(12)]})
    assert "worst stage" in deep and "11/22" in deep
