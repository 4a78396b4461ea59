"""The cost model on cases small enough to price by hand, with replicas (r > 1) and a two-level
cluster: every expected number below is worked out in the comments from DESIGN.md's definitions,
not taken from fxpipe.passes.

Profiles are chains whose nodes carry compute C (as forward time, backward 0, so C is exact),
parameter bytes P and activation bytes A (a node's output, which is also what crosses a cut
after it). Bandwidths are in bytes per second: 1.25e8 = 1 Gbps.
"""
from __future__ import annotations

import pytest

from fxpipe.costmodel.hardware import Cluster
from fxpipe.costmodel.profile import Profile, ProfileNode
from fxpipe.passes import partition, plan_for
from fxpipe.passes.reference_dp import pipedream_dp

GBPS = 1.25e8


def chain(*nodes: tuple[float, float, float]) -> Profile:
    """(C seconds, P bytes, A bytes) per node, each consuming the previous one."""
    return Profile(nodes=tuple(
        ProfileNode(name=f"n{i}", op="call_module", target=f"m{i}", forward_s=c, backward_s=0.0,
                    activation_bytes=a, parameter_bytes=p, inputs=(f"n{i - 1}",) if i else ())
        for i, (c, p, a) in enumerate(nodes)), batch_size=8)


# ------------------------------------------------------------------ memory and in-flight count
def test_in_flight_count_rounds_up_with_replicas() -> None:
    """v = ceil(workers from the stage on / its replicas). Two nodes of P = 10 MB, A = 20 MB per
    stage, optimizer state factor 1: memory = 3 P + (v - 1) P + v A = 60 + 20 (v - 1) + 40 v MB.
    [2, 1] on 3 workers: v = (ceil(3/2), ceil(1/1)) = (2, 1) -> (160 MB, 100 MB).
    [3, 1] on 4 workers: v = (ceil(4/3), 1) = (2, 1) -> the same; floor would give v0 = 1, 100 MB.
    """
    prof = chain(*[(1.0, 1e7, 2e7)] * 4)
    for replicas, workers in (([2, 1], 3), ([3, 1], 4)):
        plan = plan_for(prof, Cluster(workers=workers, bandwidth=GBPS), [0, 2], replicas)
        assert [s.in_flight for s in plan.stages] == [2, 1]
        assert [s.memory_bytes for s in plan.stages] == [160e6, 100e6]
        assert plan.noam == 2
    # [1, 2, 1] on 4 workers: v = (ceil(4/1), ceil(3/2), 1) = (4, 2, 1); with P = 1e7, A = 2e7
    # per node and one node per stage except the last (two): 3e7 + 3e7 + 4 * 2e7 = 1.4e8,
    # 3e7 + 1e7 + 2 * 2e7 = 8e7, 6e7 + 0 + 4e7 = 1e8
    plan = plan_for(prof, Cluster(workers=4, bandwidth=GBPS), [0, 1, 2], [1, 2, 1])
    assert [s.in_flight for s in plan.stages] == [4, 2, 1]
    assert [s.memory_bytes for s in plan.stages] == [1.4e8, 8e7, 1e8]


def test_memory_cap_counts_every_minibatch_in_flight() -> None:
    """4 workers, 150 MB each, 1 Gbps. n0 (C 2 s, A 60 MB), n1 (1 s, 60 MB), n2 (1 s,
    P 40 MB, A 1 MB). Unconstrained, [n0 n1 on 3 | n2 on 1] runs at max(3/3, 1, cut 2 * 60 MB /
    1 Gbps = 0.96) = 1 s, but its stage 0 has v = ceil(4/3) = 2 minibatches of 120 MB in
    flight: 240 MB. Any stage holding n0 and n1 has v >= 2 unless it is the whole model, and the
    whole model (r = 4) needs 3 * 40 + 121 MB. What fits: n0 | n1 | n2 on [2, 1, 1]:
    v = (2, 2, 1), memory (2 * 60, 2 * 60, 3 * 40 + 1) = (120, 120, 121) MB, every stage 1 s,
    cuts 0.96 s."""
    prof = chain((2.0, 0.0, 6e7), (1.0, 0.0, 6e7), (1.0, 4e7, 1e6))
    plan = partition(prof, Cluster(workers=4, bandwidth=GBPS, memory=150e6))
    assert plan.replicas == [2, 1, 1]
    assert [s.nodes for s in plan.stages] == [("n0",), ("n1",), ("n2",)]
    assert [s.in_flight for s in plan.stages] == [2, 2, 1]
    assert [s.memory_bytes for s in plan.stages] == [120e6, 120e6, 121e6]
    assert plan.time_per_minibatch == 1.0
    assert [s.comm_s for s in plan.stages] == pytest.approx([0.0, 0.96, 0.96], rel=1e-12)
    free = partition(prof, Cluster(workers=4, bandwidth=GBPS))
    assert free.replicas == [3, 1] and free.stages[0].memory_bytes == 240e6


# ------------------------------------------------------------------ cuts into replicated stages
def test_cut_into_replicated_stage_is_divided_among_its_replicas() -> None:
    """3 workers, 1 Gbps. n0 (C 1 s, P 37.5 MB, A 100 MB), n1 (2 s, nothing else). [1 | 2]:
    stage times 1 and 2/2 = 1; the cut carries 100 MB both ways into 2 replicas taking turns:
    2 * 1e8 / (1.25e8 * 2) = 0.8 s, so 1 s per minibatch. (Undivided, 1.6 s, and data
    parallelism would win: (3 + 2 * (2/3) * 3.75e7 / 1.25e8) / 3 = 1.1333 s.)"""
    prof = chain((1.0, 3.75e7, 1e8), (2.0, 0.0, 0.0))
    cluster = Cluster(workers=3, bandwidth=GBPS)
    plan = partition(prof, cluster)
    assert plan.replicas == [1, 2] and plan.time_per_minibatch == 1.0
    assert plan.stages[1].input_bytes == 1e8
    assert plan.stages[1].comm_s == pytest.approx(0.8, rel=1e-12)
    assert plan.data_parallel_time == pytest.approx(3.4 / 3, rel=1e-12)
    assert pipedream_dp(prof, cluster) == pytest.approx(1.0, rel=1e-12)
    # the same cut into 1 replica costs the full 2 X / B
    one = plan_for(prof, cluster, [0, 1], [2, 1])
    assert one.stages[1].comm_s == pytest.approx(1.6, rel=1e-12)


# ------------------------------------------------------------------ two-level cluster
TWO_LEVEL = dict(workers=8, workers_per_machine=4, bandwidth=GBPS, intra_bandwidth=1e11)


def test_replicas_that_fill_one_machine_sync_inside_it() -> None:
    """8 workers, 4 per machine: 1 Gbps between machines, 100 GB/s inside. Four nodes of
    C 10 ms, P 50 MB, A 1 MB. [n0 n1 on 4 | n2 n3 on 4]: r = 4 = workers per machine, so each
    stage's replicas share a machine: (0.02 + 2 (3/4) 1e8 / 1e11) / 4 = 5.375 ms, sync part
    2 (3/4) 1e8 / 1e11 / 4 = 0.375 ms; the cut (between machines) 2 * 1e6 / (1.25e8 * 4) = 4 ms.
    Runner-up [3, 3]: (0.02 + 2 (2/3) 1e8 / 1e11) / 3 = 7.11 ms. With r = 5 the replicas span
    two machines: one stage of everything on 5 syncs at 1 Gbps."""
    prof = chain(*[(0.01, 5e7, 1e6)] * 4)
    cluster = Cluster(**TWO_LEVEL)
    plan = partition(prof, cluster)
    assert plan.replicas == [4, 4]
    assert [s.nodes for s in plan.stages] == [("n0", "n1"), ("n2", "n3")]
    assert plan.time_per_minibatch == pytest.approx(5.375e-3, rel=1e-12)
    assert [s.sync_s for s in plan.stages] == pytest.approx([3.75e-4] * 2, rel=1e-12)
    assert plan.stages[1].comm_s == pytest.approx(4e-3, rel=1e-12)
    assert pipedream_dp(prof, cluster) == pytest.approx(5.375e-3, rel=1e-12)
    # one stage of everything: on 4 replicas inside a machine 2 (3/4) 2e8 / 1e11 / 4 = 0.75 ms;
    # on 5 they span machines: 2 (4/5) 2e8 / 1.25e8 / 5 = 0.512 s
    assert plan_for(prof, cluster, [0], [4]).stages[0].sync_s == pytest.approx(7.5e-4, rel=1e-12)
    assert plan_for(prof, cluster, [0], [5]).stages[0].sync_s == pytest.approx(0.512, rel=1e-12)


def test_one_machine_cuts_use_the_intra_bandwidth() -> None:
    """4 workers on one machine: cuts and syncs both use the 100 GB/s link. [n0 | n1] with one
    replica each: cut 2 * 1e6 / 1e11 = 20 us."""
    prof = chain((0.01, 5e7, 1e6), (0.01, 5e7, 1e6))
    cluster = Cluster(workers=4, workers_per_machine=4, bandwidth=GBPS, intra_bandwidth=1e11)
    plan = plan_for(prof, cluster, [0, 1], [1, 1])
    assert plan.stages[1].comm_s == pytest.approx(2e-5, rel=1e-12)
    # both nodes on 4 replicas: 2 (3/4) 1e8 / 1e11 / 4
    assert plan_for(prof, cluster, [0], [4]).stages[0].sync_s == pytest.approx(3.75e-4, rel=1e-12)


def test_parameter_server_syncs_twice_the_bytes() -> None:
    """PipeDream's parameter server moves 4 (r-1)/r P per round against the ring's 2 (r-1)/r P:
    one stage of 2 nodes (P 100 MB) on 4 replicas, 1 Gbps, one machine per worker:
    4 (3/4) 1e8 / 1.25e8 / 4 = 0.6 s, compute 0.02 / 4 = 5 ms."""
    prof = chain((0.01, 5e7, 1e6), (0.01, 5e7, 1e6))
    plan = plan_for(prof, Cluster(workers=4, bandwidth=GBPS), [0], [4], sync="parameter-server")
    assert plan.stages[0].sync_s == pytest.approx(0.6, rel=1e-12)
    assert plan.stages[0].compute_s == pytest.approx(5e-3, rel=1e-12)
    assert plan.time_per_minibatch == pytest.approx(0.605, rel=1e-12)
