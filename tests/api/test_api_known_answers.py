"""Known answers through the public API, on a model whose costs are estimated (deterministic):
a convolutional body with a big fully-connected tail."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

import fxpipe


def body_and_tail() -> nn.Sequential:
    """Six 64-channel convolutions (compute-heavy, 0.2M parameters) then a 10M-parameter MLP."""
    torch.manual_seed(0)
    body: list[nn.Module] = [nn.Conv2d(3, 64, 3, padding=1), nn.ReLU()]
    for _ in range(5):
        body += [nn.Conv2d(64, 64, 3, padding=1), nn.ReLU()]
    return nn.Sequential(*body, nn.MaxPool2d(4), nn.Flatten(),                 # nodes _0 .. _13
                         nn.Linear(64 * 8 * 8, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(),
                         nn.Linear(2048, 10))                                   # nodes _14 .. _18


X = torch.randn(64, 3, 32, 32)


def _plan(bandwidth: object, **kw: object) -> fxpipe.Plan:
    cluster = fxpipe.Cluster(workers=8, bandwidth=bandwidth, device="V100")
    return fxpipe.compile(body_and_tail(), cluster, example_inputs=(X,), **kw).plan


@pytest.mark.slow
def test_communication_bound_replicates_the_body_and_isolates_the_tail() -> None:
    plan = _plan("10Gbps", schedule="pipedream")  # PipeDream's schedule, priced by its planner
    assert plan.replicas == [7, 1]
    assert plan.stages[0].nodes[-1] == "_13" and plan.stages[1].nodes[0] == "_14"  # cut at the MLP
    assert plan.speedup_over_data_parallel > 5
    assert plan.noam == 2  # ceil(8 workers / 7 input replicas)


@pytest.mark.slow
def test_the_default_prices_the_same_split_as_the_default_trainer_runs_it() -> None:
    """The default plan is priced as the default trainer trains (1F1B with a flush, each
    minibatch cut into one microbatch per worker): the same split, its bubble included, so a
    smaller speedup than PipeDream's asynchronous schedule, and one worker slower still."""
    plan, async_plan = _plan("10Gbps"), _plan("10Gbps", schedule="pipedream")
    assert plan.replicas == [7, 1] and plan.time_source == "simulated 1f1b-flush"
    assert 1 < plan.speedup_over_data_parallel < async_plan.speedup_over_data_parallel
    assert plan.one_worker_time > plan.data_parallel_time > plan.time_per_minibatch


@pytest.mark.slow
def test_negligible_communication_is_data_parallel_and_says_so() -> None:
    plan = _plan(1e15)
    assert plan.replicas == [8] and plan.is_data_parallel
    assert "plain data parallelism" in plan.summary()


@pytest.mark.slow
def test_straight_is_one_worker_per_stage() -> None:
    plan = _plan("10Gbps", straight=True)
    assert set(plan.replicas) == {1} and plan.workers_used == len(plan.stages) >= 2
    plan = _plan("10Gbps", straight=True, stages=8)
    assert plan.replicas == [1] * 8


@pytest.mark.slow
def test_forced_stage_count() -> None:
    assert len(_plan("10Gbps", stages=3).stages) == 3


@pytest.mark.slow
def test_plan_round_trips_and_is_tied_to_its_model(tmp_path: Path) -> None:
    compiled = fxpipe.compile(body_and_tail(), fxpipe.Cluster(workers=8, device="V100"),
                              example_inputs=(X,))
    compiled.plan.save(tmp_path / "plan.json")
    loaded = fxpipe.Plan.load(tmp_path / "plan.json")
    assert loaded == compiled.plan
    again = fxpipe.compile(body_and_tail(), fxpipe.Cluster(workers=8, device="V100"),
                           example_inputs=(X,), plan=loaded)
    assert again.plan.replicas == compiled.plan.replicas
    other = nn.Sequential(nn.Linear(4, 4))
    with pytest.raises(fxpipe.PlanFormatError, match="different model"):
        fxpipe.compile(other, fxpipe.Cluster(workers=8), example_inputs=(torch.randn(2, 4),), plan=loaded)


# --- bad input: a specific fxpipe error with the offending value and a hint -------------------

class DataDependent(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:  # data-dependent control flow: neither tracer can capture it
            return x * 2
        return x


def test_untraceable_model() -> None:
    with pytest.raises(fxpipe.TracingError, match=r"if x.sum\(\) > 0"):
        fxpipe.compile(DataDependent(), 2, example_inputs=(torch.randn(3),))


def test_example_inputs_that_do_not_fit() -> None:
    with pytest.raises(fxpipe.InputMismatchError, match=r"\(2, 5\)"):
        fxpipe.compile(nn.Linear(4, 3), 2, example_inputs=(torch.randn(2, 5),))


@pytest.mark.parametrize("kwargs, needle", [
    (dict(workers=0), "workers must be a positive integer, got 0"),
    (dict(workers=-2), "got -2"),
    (dict(workers=2, bandwidth=0), "bandwidth must be positive"),
    (dict(workers=2, bandwidth="-1Gbps"), "-1Gbps"),
    (dict(workers=2, bandwidth="10 parsecs"), "10 parsecs"),
    (dict(workers=2, device="TPU9"), "unknown device 'TPU9'"),
    (dict(workers=2, memory="lots"), "lots"),
])
def test_bad_cluster(kwargs: dict, needle: str) -> None:
    with pytest.raises(fxpipe.ConfigError) as e:
        fxpipe.Cluster(**kwargs)
    assert needle in str(e.value)


def test_memory_no_plan_fits_says_what_the_smallest_needs() -> None:
    with pytest.raises(fxpipe.InfeasiblePlanError) as e:
        fxpipe.compile(
            body_and_tail(), fxpipe.Cluster(workers=8, device="V100", memory="1MB"),
            example_inputs=(X,))
    assert "needs" in str(e.value) and "MB" in str(e.value)


def test_more_stages_than_the_graph_can_be_cut_into() -> None:
    with pytest.raises(fxpipe.InfeasiblePlanError, match="stages"):
        fxpipe.compile(nn.Sequential(nn.Linear(4, 4), nn.ReLU()), fxpipe.Cluster(workers=8),
                       example_inputs=(torch.randn(2, 4),), stages=8)


def test_malformed_profile_and_plan_files(tmp_path: Path) -> None:
    bad = tmp_path / "graph.txt"
    bad.write_text("node1 -- Input -- forward_compute_time=abc\n")
    with pytest.raises(fxpipe.ProfileFormatError, match="graph.txt"):
        fxpipe.Profile.from_pipedream(bad)
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"format": "something else"}))
    with pytest.raises(fxpipe.PlanFormatError, match="plan.json"):
        fxpipe.Plan.load(plan)
    plan.write_text("{not json")
    with pytest.raises(fxpipe.PlanFormatError, match="plan.json"):
        fxpipe.Plan.load(plan)
