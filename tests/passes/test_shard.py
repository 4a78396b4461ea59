"""Sharded replica groups in the planner (ZeRO-1), on a case worked by hand.

Two nodes of 2 s and 1000 parameter bytes each, no activations held, 2000 bytes crossing the
cut, 2 workers on a 1000 B/s link, Adam (2 bytes of state per parameter byte, all of it the
optimizer's moments). Under PipeDream's rule:

- data parallelism, r = 2: (4 + 2 (1/2) 2000 / 1000) / 2 = 3 s; each replica 2000 x 4 = 8000 B;
- the same sharded: the sync 1.5 times (a broadcast of the new weights after the all-reduce),
  (4 + 3 (1/2) 2) / 2 = 3.5 s; each replica keeps half the moments, 2000 x (2 + 1) = 6000 B;
- the pipeline [1, 1]: stages of 2 s, the cut 2 x 2000 / 1000 = 4 s; stage 0 (v = 2)
  1000 x 4 + 1000 (a stashed version) = 5000 B, stage 1 4000 B.
"""
from __future__ import annotations

import pytest

from fxpipe.costmodel.hardware import Cluster
from fxpipe.costmodel.profile import Profile, ProfileNode
from fxpipe.errors import ConfigError, InfeasiblePlanError
from fxpipe.passes import Plan, partition
from fxpipe.passes.partition import coefficients, plan_for

ADAM = dict(optimizer_state_factor=2.0)


def case() -> Profile:
    nodes = (ProfileNode(name="n0", op="call_module", target="m0", forward_s=1.0, backward_s=1.0,
                         activation_bytes=2000.0, saved_bytes=0.0, parameter_bytes=1000.0),
             ProfileNode(name="n1", op="call_module", target="m1", forward_s=1.0, backward_s=1.0,
                         activation_bytes=0.0, saved_bytes=0.0, parameter_bytes=1000.0,
                         inputs=("n0",)))
    return Profile(nodes=nodes, batch_size=4)


def cluster(memory: float | None) -> Cluster:
    return Cluster(workers=2, bandwidth=1000.0, memory=memory)


def test_without_a_cap_sharding_only_costs_time() -> None:
    whole = partition(case(), cluster(None), **ADAM)
    assert whole.replicas == [2] and whole.shard is None
    assert whole.time_per_minibatch == 3.0 and whole.stages[0].memory_bytes == 8000.0
    assert partition(case(), cluster(None), shard="auto", **ADAM) == whole
    forced = partition(case(), cluster(None), shard="optimizer", **ADAM)
    assert forced.replicas == [2] and forced.shard == "optimizer"
    assert forced.time_per_minibatch == 3.5 and forced.stages[0].sync_s == 1.5
    assert forced.stages[0].memory_bytes == 6000.0 and forced.stages[0].state_bytes == 6000.0
    assert forced.data_parallel_time == 3.0  # compared with plain data parallelism


def test_auto_shards_where_memory_needs_it() -> None:
    """7000 B: unsharded, data parallelism (8000) does not fit and the pipeline (4 s) is the
    best; sharded data parallelism fits (6000) at 3.5 s, so auto takes it."""
    whole = partition(case(), cluster(7000.0), **ADAM)
    assert whole.replicas == [1, 1] and whole.time_per_minibatch == 4.0
    assert [s.memory_bytes for s in whole.stages] == [5000.0, 4000.0]
    auto = partition(case(), cluster(7000.0), shard="auto", **ADAM)
    assert auto.replicas == [2] and auto.shard == "optimizer" and auto.time_per_minibatch == 3.5
    assert "optimizer state sharded (ZeRO-1): each replica of stage 0 keeps 1/r" in auto.summary()
    assert "sharded" not in whole.summary()
    # a part of the state that is not the optimizer's (float32 masters) stays whole: with 1 of
    # the 2 bytes split, 2000 x (2 + 1.5) = 7000 still fits; with none split, 8000 does not
    assert partition(case(), cluster(7000.0), shard="auto", sharded_state=1.0,
                     **ADAM).stages[0].memory_bytes == 7000.0
    assert partition(case(), cluster(7000.0), shard="auto", sharded_state=0.0,
                     **ADAM).replicas == [1, 1]


def test_nothing_fits_names_the_sharded_need() -> None:
    with pytest.raises(InfeasiblePlanError) as ei:
        partition(case(), cluster(4500.0), shard="auto", **ADAM)
    assert ei.value.message == ("no plan fits in 4.5 KB per worker: the smallest-memory plan "
                                "needs 5 KB (5000 bytes) per worker with the optimizer state "
                                "sharded")
    assert "shard='auto'" not in ei.value.hint
    with pytest.raises(InfeasiblePlanError) as ei:
        partition(case(), cluster(4500.0), **ADAM)
    assert "shard='auto' (the optimizer state split over a stage's replicas)" in ei.value.hint


def test_plan_for_shards_a_given_partition_over_the_cap() -> None:
    assert plan_for(case(), cluster(7000.0), [0], [2], shard="auto", **ADAM).shard == "optimizer"
    assert plan_for(case(), cluster(9000.0), [0], [2], shard="auto", **ADAM).shard is None
    # no replicated stage: nothing to shard, whatever was asked
    assert plan_for(case(), cluster(None), [0, 1], [1, 1], shard="optimizer",
                    **ADAM).shard is None


def test_coefficients_of_a_sharded_group() -> None:
    plain, sharded = coefficients(cluster(None), "allreduce"), coefficients(cluster(None),
                                                                             "allreduce", True)
    assert sharded[0] == plain[0] and sharded[2] == plain[2]
    assert sharded[1][0] == plain[1][0] == 0.0
    assert sharded[1][1] == 1.5 * plain[1][1] == 1.5 * 2 * (1 / 2) / 1000.0 / 2


def test_bad_shard_requests_are_refused() -> None:
    with pytest.raises(ConfigError, match="unknown shard='zero3'"):
        partition(case(), cluster(None), shard="zero3")
    with pytest.raises(ConfigError, match="shard='auto' with sync='parameter-server'"):
        partition(case(), cluster(None), shard="auto", sync="parameter-server")
    with pytest.raises(ConfigError, match="sharded_state=3.0"):
        partition(case(), cluster(None), shard="auto", sharded_state=3.0, **ADAM)


def test_a_sharded_plan_round_trips_and_a_bad_field_is_refused() -> None:
    plan = partition(case(), cluster(7000.0), shard="auto", **ADAM)
    assert Plan.from_dict(plan.to_dict()) == plan
    bad = {**plan.to_dict(), "shard": "zero3"}
    with pytest.raises(Exception, match="field 'shard' must be null or \"optimizer\""):
        Plan.from_dict(bad)
    old = plan.to_dict()
    del old["shard"]  # a plan saved before the field: unsharded
    assert Plan.from_dict(old).shard is None
