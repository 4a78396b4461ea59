"""choose_by_simulation: candidates, the choice, and the compile/CLI switch."""
from __future__ import annotations

import math

import pytest

from fxpipe.api import choose_plan
from fxpipe.cli import main as cli_main
from fxpipe.costmodel.hardware import Cluster
from fxpipe.costmodel.profile import Profile, ProfileNode
from fxpipe.errors import ConfigError
from fxpipe.passes import Plan, partition
from fxpipe.runtime.pricing.plan_choice import _merge_chain, choose_by_simulation
from fxpipe.runtime.pricing.plansim import data_parallel_plan, minibatches_for, simulate_plan
from fxpipe.models import pipedream

PROFILES = pipedream.PROFILES  # PipeDream's published profiles, shipped (MIT)


def chain(n: int, f: float, b: float, act: float, par: float) -> Profile:
    return Profile(nodes=tuple(
        ProfileNode(name=f"n{i}", op="call_module", target="m", forward_s=f, backward_s=b,
                    activation_bytes=act, parameter_bytes=par, inputs=(f"n{i - 1}",) if i else ())
        for i in range(n)), batch_size=4)


def inception() -> Profile:
    return Profile.from_pipedream(PROFILES / "inception_v3" / "graph.txt")


@pytest.mark.slow
def test_simulation_rejects_the_planners_unevenly_replicated_optimum() -> None:
    """Inception-v3, 8 workers, 10 Gbps: the planner's 2-3-2-1 simulates at about twice its
    predicted time (1F1B windows, replicas waiting at updates); a 7-1 candidate does not."""
    prof, cluster = inception(), Cluster(workers=8, bandwidth="10Gbps")
    choice = choose_by_simulation(prof, cluster, sync="parameter-server")
    planner = partition(prof, cluster, sync="parameter-server")
    first = choice.candidates[0]
    assert first.replicas == tuple(planner.replicas) == (2, 3, 2, 1)
    assert first.planner_s == planner.time_per_minibatch
    assert first.simulated_s > 1.8 * first.planner_s
    assert choice.plan.replicas == [7, 1]
    assert choice.simulation.steady_state_period < 0.5 * first.simulated_s
    assert all(choice.simulation.steady_state_period <= c.simulated_s for c in choice.candidates)
    assert (8,) in {c.replicas for c in choice.candidates}  # data parallelism is a candidate
    assert "<- chosen" in choice.summary() and choice.planner_plan == first


def test_merge_chain_walks_down_to_data_parallelism() -> None:
    prof, cluster = chain(6, 1.0, 2.0, 1000.0, 8.0), Cluster(workers=6, bandwidth=1e6)
    best = partition(prof, cluster, straight=True)
    assert best.replicas == [1] * 6
    steps = _merge_chain(prof, cluster, best, {"sync": "allreduce",
                                               "optimizer_state_factor": 1.0})
    assert [len(p.stages) for p in steps] == [5, 4, 3, 2, 1]
    assert all(p.workers_used == 6 for p in steps) and steps[-1].replicas == [6]


def test_agreeing_models_keep_the_planners_choice() -> None:
    # compute-bound, negligible communication: data parallelism, exactly as planned
    prof, cluster = chain(4, 1.0, 2.0, 8.0, 8.0), Cluster(workers=4, bandwidth=1e12)
    choice = choose_by_simulation(prof, cluster)
    assert choice.plan == partition(prof, cluster) and choice.plan.replicas == [4]
    assert choice.simulation.steady_state_period == pytest.approx(3.0, rel=1e-6)


def test_forced_stages_has_one_candidate_and_bad_arguments_are_clear() -> None:
    prof, cluster = chain(4, 1.0, 2.0, 8.0, 8.0), Cluster(workers=4, bandwidth=1e6)
    choice = choose_by_simulation(prof, cluster, stages=2)
    assert len(choice.candidates) == 1 and len(choice.plan.stages) == 2
    sim = simulate_plan(choice.plan, prof)
    assert choice.simulation.steady_state_period == sim.steady_state_period
    with pytest.raises(ConfigError, match="max_stages must be a positive integer, got 0"):
        choose_by_simulation(prof, cluster, max_stages=0)
    with pytest.raises(ConfigError, match="unknown choose='fastest'"):
        choose_plan(prof, cluster, choose="fastest")


@pytest.mark.slow
def test_cli_plan_choose_simulation(capsys: pytest.CaptureFixture[str]) -> None:
    graph = str(PROFILES / "inception_v3" / "graph.txt")
    argv = ["plan", graph, "--workers", "8", "--bandwidth", "10Gbps", "--sync",
            "parameter-server", "--schedule", "pipedream"]
    assert cli_main(argv) == 0
    capsys.readouterr()
    assert cli_main([*argv, "--choose", "simulation"]) == 0
    out = capsys.readouterr().out
    rows = [ln.split() for ln in out.splitlines() if ln.strip()[:1].isdigit() and "node" in ln]
    assert [int(r[3]) for r in rows] == [7, 1], out  # stage, nodes, (count), replicas
    assert "simulated pipedream" in out


@pytest.mark.slow
def test_cli_simulate_choose_simulation(capsys: pytest.CaptureFixture[str]) -> None:
    graph = str(PROFILES / "inception_v3" / "graph.txt")
    argv = ["simulate", graph, "--workers", "8", "--bandwidth", "10Gbps", "--sync",
            "parameter-server", "--schedule", "pipedream"]
    speedups = {}
    for choose in ("planner", "simulation"):
        assert cli_main([*argv, "--choose", choose]) == 0
        out = capsys.readouterr().out
        rows = [ln.split() for ln in out.splitlines() if ln.strip()[:1].isdigit() and "node" in ln]
        speedups[choose] = ([int(r[3]) for r in rows],
                            float(out.rsplit("over BSP ", 1)[1].split("x")[0]))
    assert speedups["planner"][0] == [2, 3, 2, 1] and speedups["simulation"][0] == [7, 1]
    assert speedups["planner"][1] < 1.0 < speedups["simulation"][1]


def test_simulation_considers_the_schedules_it_is_given() -> None:
    """Four 1-1-2 second stages, no network: pipedream's period is a stage's F + B = 3 s; a
    flushing 1F1B batch of m = 4 takes (m + S - 1)(F + B) = 21 s, 5.25 s per minibatch (by
    hand); the zero-bubble kinds lie in between. Among schedules, the fastest pair wins."""
    prof, cluster = chain(4, 1.0, 2.0, 8.0, 8.0), Cluster(workers=4, bandwidth=1e12)
    kinds = ("1f1b-flush", "zb-h1", "zb-h2", "pipedream")
    choice = choose_by_simulation(prof, cluster, stages=4, schedules=kinds)
    got = {c.schedule: c.simulated_s for c in choice.candidates}
    assert list(got) == list(kinds) and len(choice.candidates) == 4
    assert got["1f1b-flush"] == pytest.approx(5.25) and got["pipedream"] == pytest.approx(3.0)
    assert got["pipedream"] < got["zb-h2"] < got["zb-h1"] < got["1f1b-flush"]
    assert choice.schedule == "pipedream" and "pipedream" in choice.summary()
    sync = choose_by_simulation(prof, cluster, stages=4, schedules=("1f1b-flush", "zb-h2"))
    assert sync.schedule == "zb-h2"
    assert sync.simulation.steady_state_period == pytest.approx(got["zb-h2"])
    # unconstrained: data parallelism has no bubble, so every schedule ties there at 3 s and
    # the first one given wins
    free = choose_by_simulation(prof, cluster, schedules=("zb-h1", "1f1b-flush"))
    assert free.plan.replicas == [4] and free.schedule == "zb-h1"
    with pytest.raises(ConfigError, match="schedules is empty"):
        choose_by_simulation(prof, cluster, schedules=())


def zoo_profile(name: str) -> Profile:
    """The zoo model's profile with V100 costs estimated (no measuring: the same every run)."""
    import fxpipe
    from fxpipe import models

    spec = models.get(name, size="mini")
    return fxpipe.compile(spec.model, Cluster(workers=1, device="V100"),
                          example_inputs=spec.example_inputs, loss_fn=spec.loss_fn).profile


def check_priced_under(prof: Profile, cluster: Cluster, kind: str) -> Plan:
    """The plan made for ``kind`` at its default microbatches: never simulated slower than BSP
    data parallelism (simulated the same way), and the time its summary states within 10% of
    an independent simulation twice as long."""
    plan = choose_plan(prof, cluster, schedule=kind)
    assert plan.time_source == f"simulated {kind}"
    assert plan.time_per_minibatch <= plan.data_parallel_time * (1 + 1e-9), plan
    assert plan.speedup_over_data_parallel >= 1 - 1e-9
    again = simulate_plan(plan, prof, schedule=kind, minibatches=2 * minibatches_for(
        plan.replicas)).steady_state_period
    assert abs(plan.time_per_minibatch - again) <= 0.10 * again
    dp = simulate_plan(data_parallel_plan(prof, cluster), prof, schedule=kind,
                       minibatches=minibatches_for([cluster.workers])).steady_state_period
    assert math.isclose(plan.data_parallel_time, dp, rel_tol=1e-9)
    assert f"simulated {kind}" in plan.summary()
    return plan


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["1f1b-flush", "zb-h2"])
@pytest.mark.parametrize("workers", [8, 16])
def test_a_plan_made_for_a_schedule_is_priced_and_chosen_under_it(kind: str,
                                                                   workers: int) -> None:
    """Issue 26's check on PipeDream's VGG-16 profile (the zoo's GPT and VGG-mini and more
    profiles: ``python -m bench.schedule_plans``, benchmarks/schedule-plans.md)."""
    prof = Profile.from_pipedream(PROFILES / "vgg16" / "graph.txt")
    check_priced_under(prof, Cluster(workers=workers, bandwidth="10Gbps"), kind)


@pytest.mark.slow
def test_a_zoo_gpt_plan_made_for_1f1b_flush() -> None:
    check_priced_under(zoo_profile("gpt"), Cluster(workers=8, bandwidth="10Gbps", device="V100"),
                       "1f1b-flush")


@pytest.mark.slow
def test_the_planners_optimum_promises_what_zb_h2_does_not_give() -> None:
    """Issue 26's example, ``fxpipe simulate gpt --device V100 --workers 8 --bandwidth 10Gbps
    --straight --stages 8 --schedule zb-h2``: the analytic plan (PipeDream's schedule) promises
    a speedup over data parallelism that zb-h2 does not deliver; the plan made for zb-h2 says so
    (its time is zb-h2's simulated one, compared with data parallelism simulated the same way)."""
    prof, cluster = zoo_profile("gpt"), Cluster(workers=8, bandwidth="10Gbps", device="V100")
    planner = choose_plan(prof, cluster, stages=8, straight=True, schedule="zb-h2",
                          choose="planner")
    made = choose_plan(prof, cluster, stages=8, straight=True, schedule="zb-h2")
    assert planner.time_source == "planner" and planner.speedup_over_data_parallel > 1
    assert made.time_per_minibatch > 1.3 * planner.time_per_minibatch  # the bubble, priced
    assert made.speedup_over_data_parallel < 1  # 8 straight stages lose to data parallelism
    free = choose_plan(prof, cluster, schedule="zb-h2")  # left free, it does not
    assert free.speedup_over_data_parallel >= 1 - 1e-9


def test_candidates_keep_refuses_are_neither_simulated_nor_chosen() -> None:
    # compute-bound: data parallelism wins unless it is refused (as a plan whose walked peaks
    # do not fit would be); refusing every candidate is an InfeasiblePlanError
    from fxpipe.errors import InfeasiblePlanError

    prof, cluster = chain(4, 1.0, 2.0, 8.0, 8.0), Cluster(workers=4, bandwidth=1e12)
    free = choose_by_simulation(prof, cluster)
    assert free.plan.replicas == [4]
    seen: list[list[int]] = []

    def keep(p: Plan) -> bool:
        seen.append(list(p.replicas))
        return len(p.stages) > 1

    kept = choose_by_simulation(prof, cluster, keep=keep)
    assert len(kept.plan.stages) > 1 and [4] in seen
    assert all(len(c.replicas) > 1 for c in kept.candidates)
    with pytest.raises(InfeasiblePlanError, match="keep refused all .* candidates"):
        choose_by_simulation(prof, cluster, keep=lambda p: False)
