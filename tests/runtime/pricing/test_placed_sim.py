"""Pricing the placed kinds (interleaved-1f1b, zb-v): simulate_plan, choose_by_simulation and
``fxpipe simulate --schedule``, against values derived by hand."""
from __future__ import annotations


import pytest
from test_runtime_plan_choice import chain

from fxpipe.cli import main as cli_main
from fxpipe.costmodel.hardware import Cluster
from fxpipe.errors import ConfigError
from fxpipe.passes import partition
from fxpipe.runtime.pricing.placed_sim import stages_per_process, virtual_cluster
from fxpipe.runtime.pricing.plan_choice import choose_by_simulation
from fxpipe.runtime.pricing.plansim import simulate_plan
from fxpipe.models import pipedream

PROFILES = pipedream.PROFILES  # PipeDream's published profiles, shipped (MIT)


def test_choice_among_placed_and_one_stage_per_process_kinds() -> None:
    """Eight 1-1-2 second nodes on 4 workers, no network. 1f1b-flush on 4 stages of two nodes
    (F = 2, B = 4), m = 4: (m + S - 1)(F + B) = 42 s per batch, 10.5 s per minibatch.
    interleaved-1f1b: 8 one-node stages, 2 per worker, m = 8: the work is 8 x 2 x 3 = 48 s per
    process and Megatron's bubble 3(P - 1) = 9 s: 57 / 8 = 7.125 s. zb-v: no less than the work,
    6 s, and below interleaved's; it wins."""
    prof, cluster = chain(8, 1.0, 2.0, 8.0, 8.0), Cluster(workers=4, bandwidth=1e12)
    kinds = ("1f1b-flush", "zb-v", "interleaved-1f1b")
    choice = choose_by_simulation(prof, cluster, stages=4, schedules=kinds)
    got = {c.schedule: c.simulated_s for c in choice.candidates}
    assert got["1f1b-flush"] == pytest.approx(10.5)
    assert got["interleaved-1f1b"] == pytest.approx(57 / 8)
    assert 6.0 <= got["zb-v"] < got["interleaved-1f1b"]
    assert choice.schedule == "zb-v" and len(choice.plan.stages) == 8
    assert [c.replicas for c in choice.candidates][1:] == [(1,) * 8] * 2
    assert "zb-v" in choice.summary() and "<- chosen" in choice.summary()


def test_simulate_plan_prices_the_placement() -> None:
    """The same 8 stages as 4 processes: utilisation is per stage (half a process), the trace
    has one row per process, each stage holds at most P = 4 minibatches' activations."""
    prof = chain(8, 1.0, 2.0, 8.0, 8.0)
    plan = partition(prof, virtual_cluster(Cluster(workers=4, bandwidth=1e12), 2), stages=8,
                     straight=True)
    sim = simulate_plan(plan, prof, schedule="zb-v", minibatches=64)
    assert sim.schedule == "zb-v" and sim.minibatches == 64
    assert len(sim.events) == 4 and sim.rank_names[0] == "process 0 (stages 0, 7)"
    assert max(sim.in_flight) <= 4 and all(0 < u <= 0.5 for u in sim.utilisation)
    wide = simulate_plan(plan, prof, schedule="zb-v", minibatches=64, microbatches=16)
    assert max(wide.in_flight) == 4  # P admitted per process: 1F1B's memory
    from fxpipe.runtime.pricing.placed_sim import simulate_placed_plan
    more = simulate_placed_plan(plan, prof, schedule="zb-v", minibatches=64, microbatches=16,
                                limit=8)
    assert max(more.in_flight) > 4
    inter = simulate_plan(plan, prof, schedule="interleaved-1f1b", minibatches=64)
    assert inter.steady_state_period == pytest.approx(57 / 8)
    assert inter.rank_names[1] == "process 1 (stages 1, 5)"
    with pytest.raises(ConfigError, match="zb-v with 7 stages"):
        simulate_plan(partition(prof, Cluster(workers=7, bandwidth=1e12), stages=7,
                                straight=True), prof, schedule="zb-v")
    uneven = partition(prof, Cluster(workers=3, bandwidth=1e12), stages=2)
    assert sorted(uneven.replicas) == [1, 2]
    with pytest.raises(ConfigError, match="replicate the whole pipeline"):
        simulate_plan(uneven, prof, schedule="interleaved-1f1b")


def test_virtual_cluster_and_stages_per_process() -> None:
    c = virtual_cluster(Cluster(workers=4, bandwidth="10Gbps", memory="16GB",
                                workers_per_machine=2), 3)
    assert (c.workers, c.workers_per_machine, c.memory) == (12, 6, 16e9 / 3)
    assert stages_per_process("zb-v", 5) == 2 and stages_per_process("interleaved-1f1b", 3) == 3
    with pytest.raises(ConfigError, match="'gpipe' is not a placed kind"):
        stages_per_process("gpipe")


def test_cli_simulate_a_placed_kind(capsys: pytest.CaptureFixture[str]) -> None:
    """``fxpipe simulate vgg16's profile --workers 4 --straight --schedule zb-v``: the plan has
    8 stages (2 per worker), the trace rows are the 4 processes."""
    graph = str(PROFILES / "vgg16" / "graph.txt")
    assert cli_main(["simulate", graph, "--workers", "4", "--straight", "--stages", "4",
                     "--schedule", "zb-v", "--minibatches", "32"]) == 0
    out = capsys.readouterr().out
    assert "zb-v schedule, replicas [1, 1, 1, 1, 1, 1, 1, 1]" in out
    assert "BSP data parallelism on 4 workers" in out
