"""partition(): known answers, validation, two-level clusters, shared parameters."""
from __future__ import annotations


import pytest

from fxpipe.costmodel.hardware import Cluster
from fxpipe.costmodel.profile import Profile, ProfileNode
from fxpipe.errors import ConfigError, InfeasiblePlanError
from fxpipe.passes import Plan, partition, plan_for
from fxpipe.models import pipedream

PROFILES = pipedream.PROFILES  # PipeDream's published profiles, shipped (MIT)


def chain(specs: list[tuple[float, float, float]], *, shared: dict[int, tuple[str, ...]] | None = None,
          params: dict[int, tuple[str, ...]] | None = None) -> Profile:
    """A chain profile from (compute_s, parameter_bytes, activation_bytes) per node."""
    nodes = []
    for i, (c, p, a) in enumerate(specs):
        nodes.append(ProfileNode(name=f"n{i}", op="call_module", target=f"m{i}", forward_s=c / 3,
                                 backward_s=2 * c / 3, activation_bytes=a, parameter_bytes=p,
                                 inputs=(f"n{i - 1}",) if i else (),
                                 params=(params or {}).get(i, ()),
                                 shared_params=(shared or {}).get(i, ())))
    return Profile(nodes=tuple(nodes), batch_size=32)


def test_vgg16_pipedream_7_1() -> None:
    prof = Profile.from_pipedream(PROFILES / "vgg16" / "graph.txt")
    plan = partition(prof, Cluster(workers=8, bandwidth=1.25e9), sync="parameter-server")
    assert plan.replicas == [7, 1]
    assert plan.speedup_over_data_parallel > 1.0
    assert "Linear" in prof.nodes[prof.names.index(plan.stages[1].nodes[-1])].target


def test_conv_body_fc_tail() -> None:
    # lots of compute, few params, big activations except the (pooled) last one
    body = [(0.05, 1e5, 5e8)] * 7 + [(0.05, 1e5, 1e6)]
    tail = [(0.002, 4e8, 1e6), (0.001, 1e8, 1e5)]  # huge-parameter FC tail
    plan = partition(chain(body + tail), Cluster(workers=8, bandwidth="10Gbps"),
                     sync="parameter-server")
    assert len(plan.stages) == 2 and plan.replicas[0] > 1 and plan.replicas[1] == 1
    assert plan.stages[1].nodes == ("n8", "n9")
    assert plan.speedup_over_data_parallel > 1.5


def test_negligible_comm_is_data_parallel() -> None:
    prof = chain([(0.01, 1e6, 1e6)] * 6)
    plan = partition(prof, Cluster(workers=8, bandwidth=1e18))
    assert plan.replicas == [8] and plan.is_data_parallel
    assert "This plan is plain data parallelism on 8 workers: no pipeline is faster here" \
        in plan.summary()
    assert plan.noam == 1


def test_straight() -> None:
    prof = chain([(0.01, 1e6, 1e6)] * 6)
    plan = partition(prof, Cluster(workers=4, bandwidth="1Gbps"), straight=True)
    assert set(plan.replicas) == {1} and plan.workers_used == len(plan.stages) <= 4
    plan3 = partition(prof, Cluster(workers=4, bandwidth="1Gbps"), straight=True, stages=3)
    assert plan3.replicas == [1, 1, 1]


def test_forced_stages_and_limits() -> None:
    prof = chain([(0.01, 1e6, 1e6)] * 3)
    assert len(partition(prof, Cluster(workers=4), stages=2).stages) == 2
    with pytest.raises(InfeasiblePlanError, match="maximum is 3"):
        partition(prof, Cluster(workers=4), stages=4)
    with pytest.raises(InfeasiblePlanError, match="maximum is 2"):
        partition(chain([(0.01, 1e6, 1e6)] * 3), Cluster(workers=2), stages=3)
    with pytest.raises(InfeasiblePlanError, match="maximum"):
        partition(prof, Cluster(workers=4), stages=0)
    with pytest.raises(ConfigError, match="sync"):
        partition(prof, Cluster(workers=4), sync="gossip")


def test_memory_infeasible_reports_need() -> None:
    prof = chain([(0.01, 1e9, 1e9)] * 2)
    with pytest.raises(InfeasiblePlanError, match="smallest-memory plan needs") as ei:
        partition(prof, Cluster(workers=2, memory="1GB"))
    # one node per stage, r=1 each: stage 0 holds 1e9*(3) + (2-1)*1e9 + 2*1e9 = 6e9
    assert "6 GB" in str(ei.value)
    ok = partition(prof, Cluster(workers=2, memory="6GB"))
    assert max(s.memory_bytes for s in ok.stages) <= 6e9


def test_two_level_uses_intra_bandwidth() -> None:
    prof = chain([(0.01, 5e7, 1e6)] * 4)
    slow = Cluster(workers=8, bandwidth="1Gbps", workers_per_machine=4)
    fast = Cluster(workers=8, bandwidth="1Gbps", workers_per_machine=4, intra_bandwidth="100GB/s")
    assert partition(prof, fast).time_per_minibatch < partition(prof, slow).time_per_minibatch
    p = partition(prof, fast)
    assert all(r <= 4 for r in p.replicas)  # replicas stay inside a machine when that is cheaper


def test_shared_parameters_reported() -> None:
    prof = chain([(0.01, 1e8, 1e6)] * 4, params={0: ("emb.weight",)}, shared={3: ("emb.weight",)})
    plan = partition(prof, Cluster(workers=4, bandwidth="1Gbps"), stages=2)
    assert plan.shared_parameters == {"emb.weight": (0, 1)}
    assert Plan.from_dict(plan.to_dict()) == plan


def test_a_stage_using_a_parameter_it_does_not_own_keeps_a_copy_in_its_memory() -> None:
    """A tied embedding: node 0 owns emb.weight and a second 5e7-byte weight (the owner's 1e8
    split evenly: 5e7 each), node 3 (the head) uses emb.weight. Cut 2 | 2 on 4 straight
    workers: stage 1 keeps a copy of emb.weight, 5e7 bytes, with its gradient and momentum
    (opt = 1) besides its own 2e8: state (2e8 + 5e7) x 3; memory adds v = 1 activation sets,
    no stashed version. Saved and loaded with the plan; a plan saved before loads with 0."""
    prof = chain([(0.01, 1e8, 1e6)] * 4, params={0: ("emb.weight", "emb.other")},
                 shared={3: ("emb.weight",)})
    plan = plan_for(prof, Cluster(workers=2, bandwidth="1Gbps"), [0, 2], [1, 1])
    last = plan.stages[1]
    assert (plan.stages[0].copy_bytes, last.copy_bytes) == (0.0, 5e7)
    assert last.parameter_bytes == 2e8 and last.state_bytes == (2e8 + 5e7) * 3
    assert last.memory_bytes == (2e8 + 5e7) * 3 + 2e6
    assert Plan.from_dict(plan.to_dict()) == plan
    old = plan.to_dict()
    for sd in old["stages"]:
        del sd["copy_bytes"]
    assert Plan.from_dict(old).stages[1].copy_bytes == 0.0
    one = plan_for(prof, Cluster(workers=2, bandwidth="1Gbps"), [0], [1])
    assert one.stages[0].copy_bytes == 0.0  # the owner's stage: counted once


def test_plan_for_reproduces_the_solvers_plan_and_prices_others() -> None:
    prof = chain([(0.01, 1e6, 1e5)] * 3 + [(0.04, 1e3, 1e5)])
    cluster = Cluster(workers=4, bandwidth="1Gbps")
    best = partition(prof, cluster)
    starts = [prof.names.index(sp.nodes[0]) for sp in best.stages]
    same = plan_for(prof, cluster, starts, best.replicas)
    assert same == best  # the same frozen plan, field by field
    other = plan_for(prof, cluster, [0, 3], [1, 1])  # stage 0: 3 x 10 ms, one worker
    assert other.replicas == [1, 1] and other.stages[1].nodes == ("n3",)
    assert other.time_per_minibatch == pytest.approx(max(0.03, 0.04, 2 * 1e5 / 1.25e8))
    assert other.time_per_minibatch >= best.time_per_minibatch


@pytest.mark.parametrize("starts, replicas, err, match", [
    ([1, 2], [1, 1], ConfigError, "not a partition"),
    ([0, 2, 1], [1, 1, 1], ConfigError, "not a partition"),
    ([0, 2], [1], ConfigError, "not a partition"),
    ([0, 2], [0, 1], ConfigError, "not a partition"),
    ([0, 9], [1, 1], ConfigError, "not a partition"),
    ([0, 2], [4, 1], InfeasiblePlanError, "need 5 workers"),
])
def test_plan_for_rejects_bad_partitions(starts: list[int], replicas: list[int], err: type,
                                          match: str) -> None:
    prof = chain([(0.01, 1e6, 1e5)] * 4)
    with pytest.raises(err, match=match):
        plan_for(prof, Cluster(workers=4, bandwidth="1Gbps"), starts, replicas)


# ----------------------------------------------------------------------------- refusals
def test_each_refusal_names_the_value_and_what_to_do() -> None:
    prof = chain([(0.01, 1e6, 1e6)] * 3)
    with pytest.raises(ConfigError) as ei:
        partition(prof, Cluster(workers=4), sync="gossip")
    assert (ei.value.message, ei.value.hint) == (
        "unknown sync model 'gossip'", "use one of allreduce, parameter-server")
    for bad in (-0.5, "2", None):
        with pytest.raises(ConfigError) as ei:
            partition(prof, Cluster(workers=4), optimizer_state_factor=bad)
        assert (ei.value.message, ei.value.hint) == (
            f"optimizer_state_factor must be >= 0, got {bad!r}",
            "e.g. 2.0 for Adam (two moments per parameter), 0 for plain SGD")
    # 0 (plain SGD keeps no state) is valid: P (2 + 0) per replica
    plan = partition(chain([(0.01, 1e6, 0.0)]), Cluster(workers=1), optimizer_state_factor=0)
    assert plan.stages[0].memory_bytes == 2e6
    with pytest.raises(ConfigError, match="^the profile has no nodes$"):
        partition(Profile(nodes=()), Cluster(workers=2))
    for bad in (True, 0, 1.0, 4):
        with pytest.raises(InfeasiblePlanError) as ei:
            partition(prof, Cluster(workers=4), stages=bad)
        assert (ei.value.message, ei.value.hint) == (
            f"cannot make {bad!r} stages: the maximum is 3 (4 workers, 2 places where the graph "
            "can be cut)", "pass stages between 1 and 3, or None to let fxpipe choose")
    assert len(partition(prof, Cluster(workers=4), stages=1).stages) == 1


def test_memory_refusal_quotes_the_cap_and_the_need() -> None:
    prof = chain([(0.01, 1e9, 1e9)] * 2)
    with pytest.raises(InfeasiblePlanError) as ei:
        partition(prof, Cluster(workers=2, memory="1GB"))
    assert ei.value.message == ("no plan fits in 1 GB per worker: the smallest-memory plan needs "
                                "6 GB (6000000000 bytes) per worker")
    assert ei.value.hint == ("use more workers or devices with more memory, a smaller batch, "
                             "recompute='auto' (activation recomputation), shard='auto' (the "
                             "optimizer state split over a stage's replicas), a flushing "
                             "schedule (schedule='1f1b-flush': no stashed weight versions), or "
                             "optimizer_state_factor matching your optimizer")


def test_coefficients_per_replica_count() -> None:
    """alpha = 1/r; beta = k (r-1)/r / B / r with B the link the replicas share; gamma =
    2 / (B_cut r); one entry per r = 1..workers."""
    from fxpipe.passes import coefficients

    c = Cluster(workers=4, workers_per_machine=2, bandwidth=10.0, intra_bandwidth=100.0)
    a, b, g = coefficients(c, "allreduce")
    assert a == [1.0, 0.5, 1 / 3, 0.25]
    assert b == pytest.approx([0.0, 2 * 0.5 / 100 / 2, 2 * (2 / 3) / 10 / 3, 2 * 0.75 / 10 / 4],
                              rel=1e-15)
    assert g == pytest.approx([2 / 10, 2 / 20, 2 / 30, 2 / 40], rel=1e-15)
    _, b_ps, _ = coefficients(c, "parameter-server")
    assert b_ps == pytest.approx([2 * x for x in b], rel=1e-15)
    with pytest.raises(ConfigError, match="unknown sync model 'ring'"):
        coefficients(c, "ring")


def test_ties_are_within_one_part_in_a_billion() -> None:
    """Two nodes of 1 s on 2 workers, 1 GB/s, nothing crossing the cut: [1 | 1] takes 1 s, data
    parallelism 1 + P / (2 B). P = 1 byte: 1 + 5e-10, a tie (relative gap below 1e-9), so data
    parallelism; P = 3 bytes: 1 + 1.5e-9, the pipeline is faster."""
    def two(p: float) -> Profile:
        return chain([(1.0, p / 2, 0.0), (1.0, p / 2, 0.0)])
    c = Cluster(workers=2, bandwidth=1e9)
    assert partition(two(1.0), c).replicas == [2]
    assert partition(two(3.0), c).replicas == [1, 1]


@pytest.mark.parametrize("starts, replicas, match", [
    ([0, 2, 2], [1, 1, 1], "not a partition of 4 nodes: starts [0, 2, 2], replicas [1, 1, 1]"),
    ([0, 4], [1, 1], "not a partition of 4 nodes: starts [0, 4], replicas [1, 1]"),
])
def test_plan_for_refuses_empty_stages(starts: list[int], replicas: list[int], match: str) -> None:
    with pytest.raises(ConfigError) as ei:
        plan_for(chain([(0.01, 1e6, 1e5)] * 4), Cluster(workers=4), starts, replicas)
    assert ei.value.message == match
    assert ei.value.hint == ("starts: increasing node indices from 0; one replica count (>= 1) "
                             "per stage")


def test_plan_for_refuses_cuts_where_a_value_cannot_be_sent() -> None:
    """n0 -> t (a tuple: not sendable) -> n2 -> n3 -> n4: cutting before n2 would send t."""
    nodes = list(chain([(0.01, 0.0, 1e5)] * 5).nodes)
    nodes[1] = ProfileNode(name="t", op="call_function", target="t", forward_s=0.01,
                           backward_s=0.0, activation_bytes=1e5, parameter_bytes=0.0,
                           inputs=("n0",), sendable=False)
    nodes[2] = ProfileNode(name="n2", op="call_module", target="m", forward_s=0.01,
                           backward_s=0.0, activation_bytes=1e5, parameter_bytes=0.0,
                           inputs=("t",))
    prof = Profile(nodes=tuple(nodes))
    ok = plan_for(prof, Cluster(workers=3), [0, 1, 3], [1, 1, 1])
    assert [s.nodes for s in ok.stages] == [("n0",), ("t", "n2"), ("n3", "n4")]
    for starts in ([0, 2], [0, 1, 2], [0, 2, 3]):
        with pytest.raises(InfeasiblePlanError) as ei:
            plan_for(prof, Cluster(workers=3), starts, [1] * len(starts))
        assert ei.value.message == ("cannot cut before 'n2': a value that cannot be sent (not "
                                    "a tensor) is live there")
        assert ei.value.hint == "move that stage boundary"
    with pytest.raises(InfeasiblePlanError) as ei:
        plan_for(prof, Cluster(workers=3), [0, 1], [4, 1])
    assert (ei.value.message, ei.value.hint) == (
        "replicas [4, 1] need 5 workers, the cluster has 3", "use fewer replicas or a larger Cluster")


def test_only_parameters_of_several_stages_are_shared_and_the_fingerprint_is_kept() -> None:
    prof = chain([(0.01, 1e8, 1e6)] * 4, params={0: ("emb.weight",), 1: ("w",)},
                 shared={3: ("emb.weight",)})
    prof = Profile(nodes=prof.nodes, batch_size=32, meta={"model_fingerprint": "abc123"})
    plan = partition(prof, Cluster(workers=4, bandwidth="1Gbps"), stages=2)
    assert plan.shared_parameters == {"emb.weight": (0, 1)}  # w lives in stage 0 alone
    assert plan.model_fingerprint == "abc123"
