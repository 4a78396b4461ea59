"""The staleness report (fxpipe.runtime.schedules.staleness) against literal tables and the paper's
closed form.

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

from fxpipe.runtime.schedules.staleness import format_table, own_delays, staleness_table

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


def _row(text: str, name: str) -> list[str]:
    """The cells of the table row of schedule ``name`` in a printed report."""
    return next(line.split()[1:] for line in text.splitlines() if line.split()[:1] == [name])


def _profile():
    from fxpipe.costmodel.profile import Profile, ProfileNode

    nodes = tuple(ProfileNode(name=f"n{i}", op="call_module", target="m", forward_s=1e-3,
                              backward_s=2e-3, activation_bytes=1e3, parameter_bytes=1e4,
                              inputs=(f"n{i - 1}",) if i else ()) for i in range(6))
    return Profile(nodes=nodes, batch_size=8)


def test_plan_json_carries_the_table_and_old_plans_still_load(tmp_path) -> None:
    import json
    from dataclasses import replace

    from fxpipe.costmodel.hardware import Cluster
    from fxpipe.errors import PlanFormatError
    from fxpipe.passes import Plan, partition
    from fxpipe.runtime.schedules.staleness import plan_staleness

    plan = partition(_profile(), Cluster(workers=3, bandwidth="1Gbps"), stages=3, straight=True)
    assert plan.staleness == {} and "staleness" not in plan.summary()  # passes cannot compute it
    full = replace(plan, staleness=plan_staleness(plan.replicas))
    assert full.staleness["pipedream"] == ((2, 7), (1, 6), (0, 4))
    assert _row(full.summary(detail=True), "pipedream") == ["2/7", "1/6", "0/4"]
    assert "staleness" not in full.summary()  # the first screen leaves it to detail
    d = json.loads(json.dumps(full.to_dict()))
    assert d["staleness"]["pipedream"] == [[2, 7], [1, 6], [0, 4]]
    assert Plan.from_dict(d) == full
    d.pop("staleness")  # a plan file written before the field existed
    assert Plan.from_dict(d).staleness == {}
    for bad in ({"pipedream": [[1, 2]]}, {"pipedream": [[1, -2]] * 3}, [1], {"x": "y"}):
        with pytest.raises(PlanFormatError, match="staleness"):
            Plan.from_dict({**d, "staleness": bad}, origin="p.json")


def test_fxpipe_simulate_reports_staleness(tmp_path, capsys) -> None:
    import argparse

    from fxpipe.cli_simulate import add_simulate_parser

    _profile().save(tmp_path / "p.json")
    parser = argparse.ArgumentParser(prog="fxpipe")
    add_simulate_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["simulate", str(tmp_path / "p.json"), "--workers", "2",
                              "--straight", "--stages", "2", "--minibatches", "24",
                              "--schedule", "pipedream"])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "weight staleness" in out and _row(out, "pipedream") == ["1/3", "0/2"]
    assert "weight staleness of pipedream: worst stage 1 own updates, 3 global" in out
