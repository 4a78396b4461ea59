"""The weight update in the partitioner: it is stage compute, reported on its own, serialised."""
from __future__ import annotations

import json
import random

import pytest

from fxpipe.costmodel.hardware import Cluster
from fxpipe.costmodel.profile import Profile, ProfileNode
from fxpipe.passes import Plan, partition
from fxpipe.passes.reference_dp import pipedream_dp

FAST_NET = Cluster(workers=2, bandwidth=1e18)


def chain(fb: list[float], updates: dict[int, float]) -> Profile:
    """Forward+backward ``fb[i]`` (1/4 forward) and update ``updates[i]`` per node."""
    return Profile(nodes=tuple(
        ProfileNode(name=f"n{i}", op="call_module", target=f"m{i}", forward_s=c / 4,
                    backward_s=3 * c / 4, activation_bytes=1.0, parameter_bytes=1.0,
                    inputs=(f"n{i - 1}",) if i else (), update_s=updates.get(i, 0.0))
        for i, c in enumerate(fb)), batch_size=8)


def test_update_of_a_parameter_heavy_tail_moves_the_cut() -> None:
    fb = [1.0, 1.0, 1.0, 1.0]
    without = partition(chain(fb, {}), FAST_NET, stages=2, straight=True)
    assert [s.nodes for s in without.stages] == [("n0", "n1"), ("n2", "n3")]
    assert without.time_per_minibatch == 2.0 and all(s.update_s == 0 for s in without.stages)
    # the last node's parameters cost 2 s to update: its stage's time grows by exactly that,
    # so the balanced cut moves towards the tail
    plan = partition(chain(fb, {3: 2.0}), FAST_NET, stages=2, straight=True)
    assert [s.nodes for s in plan.stages] == [("n0", "n1", "n2"), ("n3",)]
    tail = plan.stages[1]
    assert tail.update_s == 2.0 and tail.compute_s == 1.0 + 2.0
    assert tail.stage_time_s == 3.0 and plan.time_per_minibatch == 3.0
    assert plan.stages[0].update_s == 0.0


def test_replicated_update_is_divided_like_compute() -> None:
    prof = chain([1.0] * 4, {0: 0.5, 2: 1.5})
    plan = partition(prof, Cluster(workers=4, bandwidth=1e18))
    assert plan.replicas == [4]
    assert plan.stages[0].update_s == 2.0 / 4
    assert plan.stages[0].compute_s == pytest.approx((4.0 + 2.0) / 4, rel=1e-15)
    assert "update" in plan.summary(detail=True).splitlines()[0]  # a column in detail only
    assert "update" not in plan.summary().splitlines()[0]


def test_same_optimum_as_pipedream_dp_with_updates() -> None:
    rng = random.Random(7)
    for _ in range(20):
        n = rng.randint(2, 8)
        prof = Profile(nodes=tuple(
            ProfileNode(name=f"n{i}", op="call_module", target="m", forward_s=rng.random(),
                        backward_s=rng.random(), activation_bytes=rng.random() * 1e8,
                        parameter_bytes=rng.random() * 1e8, inputs=(f"n{i - 1}",) if i else (),
                        update_s=rng.random() * 3)
            for i in range(n)))
        cluster = Cluster(workers=rng.randint(1, 4), bandwidth="10Gbps")
        plan = partition(prof, cluster)
        assert plan.time_per_minibatch == pytest.approx(pipedream_dp(prof, cluster), rel=1e-9)


def test_plan_json_exact_round_trip_and_old_plans() -> None:
    plan = partition(chain([0.1, 0.2, 0.3, 0.7], {1: 0.1 + 0.2, 3: 1 / 3}),
                     Cluster(workers=3, bandwidth="1Gbps"), stages=2)
    assert any(s.update_s > 0 for s in plan.stages)
    d = json.loads(json.dumps(plan.to_dict()))
    assert Plan.from_dict(d) == plan
    for sd in d["stages"]:
        del sd["update_s"]  # a plan saved before the update was in the cost model
    old = Plan.from_dict(d)
    assert [s.update_s for s in old.stages] == [0.0] * len(plan.stages)
    assert old.replicas == plan.replicas and old.time_per_minibatch == plan.time_per_minibatch
