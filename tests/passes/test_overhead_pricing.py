"""The runtime's overheads priced onto plans, on profiles small enough to price by hand.

Every expected number is worked out in the comments from the definitions in
fxpipe.costmodel.overheads: a stage replica pays, per minibatch, ``action`` + ``tensor`` per
parameter tensor it holds + ``message`` per message (2 per value crossing each of its cuts;
``value`` instead for the values beyond a cut's first where it is measured) +
``tie`` per set of stages it shares a parameter with + where its schedule stashes versions,
``stash_copy`` x its share of the parameter bytes + ``stash_tensor`` per parameter tensor; a stage
with r replicas costs the pipeline 1/r of that. The overheads use distinct powers of ten so each
term can be read off the sum.
"""
from __future__ import annotations

from dataclasses import replace

import pytest

from fxpipe.costmodel.hardware import Cluster
from fxpipe.costmodel.overheads import Overheads, with_overheads
from fxpipe.costmodel.profile import Profile, ProfileNode
from fxpipe.errors import ProfileFormatError
from fxpipe.passes import Plan, partition, plan_for
from fxpipe.passes.memory_rule import MemoryRule
from fxpipe.passes.overhead_pricing import stage_overheads, tie_sets_per_stage

FLUSH = MemoryRule(schedule="1f1b-flush", versions="none")
OV = Overheads(action_s=1.0, message_s=10.0, tensor_s=100.0, stash_copy_s=1000.0,
               stash_tensor_s=10000.0, tie_s=1e5, source="by hand")


def node(i: int, inputs: tuple[str, ...], *, c: float = 1.0, p: float = 0.0,
         params: tuple[str, ...] = (), shared: tuple[str, ...] = ()) -> ProfileNode:
    return ProfileNode(name=f"n{i}", op="call_module", target=f"m{i}", forward_s=c,
                       backward_s=0.0, activation_bytes=8.0, parameter_bytes=p, inputs=inputs,
                       params=params, shared_params=shared)


def with_ov(nodes: list[ProfileNode], ov: Overheads | None = OV) -> Profile:
    meta = with_overheads({}, ov) if ov is not None else {}
    return Profile(nodes=tuple(nodes), batch_size=4, meta=meta)


def chain4() -> Profile:
    """n0 -> n1 -> n2 -> n3, parameters: n0 one tensor of 10 bytes, n2 two of 30 in all."""
    return with_ov([node(0, (), p=10.0, params=("a",)), node(1, ("n0",)),
                    node(2, ("n1",), p=30.0, params=("b", "c")), node(3, ("n2",))])


def test_each_term_by_hand() -> None:
    """Cut before n2, stage 0 stashes (pipedream, v = 2), stage 1 does not (v = 1).
    Stage 0: action 1 + 1 tensor (100) + 1 value out (2 messages: 20) + stash: share 10/40 of
    1000 (250) + 1 tensor (10000) = 10371. Stage 1: 1 + 2 tensors (200) + 2 messages (20) = 221."""
    prof = chain4()
    assert stage_overheads(prof, [0, 2], [1, 1], [2, 1], MemoryRule()) == [10371.0, 221.0]
    # a schedule that stashes nothing pays no copy anywhere
    assert stage_overheads(prof, [0, 2], [1, 1], [2, 1], FLUSH) == [121.0, 221.0]


def test_replicas_divide_and_one_stage_sends_nothing() -> None:
    """One stage on 4 replicas: no cut, nothing stashed at v = 1: (1 + 3 tensors) / 4 = 75.25."""
    assert stage_overheads(chain4(), [0], [4], [1], MemoryRule()) == [301.0 / 4]


def test_every_value_crossing_a_cut_is_a_message_each_way() -> None:
    """n0 feeds n1 and n2 (a skip): cut before n1 carries only n0; cut before n2 carries n0 and
    n1. Stages [n0], [n1], [n2]: stage 0 sends 1 value (2 messages), stage 1 receives 1 and
    sends 2 (6), stage 2 receives 2 (4); no parameters, flush."""
    prof = with_ov([node(0, ()), node(1, ("n0",)), node(2, ("n0", "n1"))])
    got = stage_overheads(prof, [0, 1, 2], [1, 1, 1], [3, 2, 1], FLUSH)
    assert got == [1.0 + 20.0, 1.0 + 60.0, 1.0 + 40.0]


def test_values_beyond_a_cuts_first_cost_value_s() -> None:
    """The same skip with ``value_s`` = 0.5: the first value across each cut, each way, costs
    message_s (10), every further one value_s. Stage 0: 1 value out (20); stage 1: 1 in (20),
    2 out (20 + 2 x 0.5); stage 2: 2 in (20 + 1). Without value_s (an older profile) every
    message is message_s, as before."""
    ov = Overheads(action_s=1.0, message_s=10.0, value_s=0.5, source="by hand")
    prof = with_ov([node(0, ()), node(1, ("n0",)), node(2, ("n0", "n1"))], ov)
    got = stage_overheads(prof, [0, 1, 2], [1, 1, 1], [3, 2, 1], FLUSH)
    assert got == [1.0 + 20.0, 1.0 + 40.0 + 1.0, 1.0 + 20.0 + 1.0]
    assert Overheads.from_dict(ov.to_dict()) == ov
    assert Overheads.from_dict({"message_s": 10.0}).further_s == 10.0
    with pytest.raises(ProfileFormatError):
        Overheads(value_s=-1.0)


def test_a_parameter_shared_across_stages_costs_an_all_reduce_each() -> None:
    """Tied "w": owned by n0, used again by n3. Stages [n0, n1] and [n2, n3] share it: one tie
    set each, on top of the cut's two messages."""
    prof = with_ov([node(0, (), p=4.0, params=("w",)), node(1, ("n0",)), node(2, ("n1",)),
                    node(3, ("n2",), shared=("w",))])
    assert tie_sets_per_stage(prof, [0, 2, 4]) == [1, 1]
    assert tie_sets_per_stage(prof, [0, 4]) == [0]
    # each stage holds "w": 1 + 100 + 2 x 10 + 1e5
    assert stage_overheads(prof, [0, 2], [1, 1], [2, 1], FLUSH) == [100121.0, 100121.0]


def test_a_stage_pays_for_the_values_it_makes_again_from_the_inputs() -> None:
    """ids -> pos (arange, from nothing: 3 s) ; mask(ids) (5 s) ; both(mask, pos) (7 s), all
    function calls on the inputs alone; n0(ids) a layer; n1(n0, both); n2(n1, mask).
    Stages [ids .. n0], [n1], [n2]: stage 1 reads both, so it makes both, mask and pos again
    (15 s); stage 2 reads only mask (5 s); stage 0 made them in place (its nodes' own times).
    With 2 replicas stage 1 costs the pipeline half; with no overheads they are all there is."""
    def call(name: str, inputs: tuple[str, ...], c: float) -> ProfileNode:
        return ProfileNode(name=name, op="call_function", target=f"torch.ops.aten.{name}.default",
                           forward_s=c, backward_s=0.0, activation_bytes=8.0, parameter_bytes=0.0,
                           inputs=inputs)

    ids = ProfileNode(name="ids", op="placeholder", target="ids", forward_s=0.0,
                      backward_s=0.0, activation_bytes=8.0, parameter_bytes=0.0)
    nodes = [ids, call("pos", (), 3.0), call("mask", ("ids",), 5.0),
             call("both", ("mask", "pos"), 7.0), node(0, ("ids",), p=4.0, params=("w",)),
             node(1, ("n0", "both")), node(2, ("n1", "mask"))]
    assert stage_overheads(with_ov(nodes, None), [0, 5, 6], [1, 2, 1], [3, 1, 1], FLUSH) \
        == [0.0, 15.0 / 2, 5.0]
    # with the overheads, stage 1 also pays 1 action and 8 messages: n0 and ids cross in, n1
    # and ids cross on (a model input a later stage reads counts as crossing, passes/cuts)
    assert stage_overheads(with_ov(nodes), [0, 5, 6], [1, 2, 1], [3, 1, 1], FLUSH)[1] \
        == (1.0 + 80.0) / 2 + 15.0 / 2


def test_no_overheads_no_change() -> None:
    """A profile without overheads (or with zero ones) plans exactly as before."""
    nodes = list(chain4().nodes)
    cluster = Cluster(workers=2)
    bare = plan_for(with_ov(nodes, None), cluster, [0, 2], [1, 1])
    zero = plan_for(with_ov(nodes, Overheads()), cluster, [0, 2], [1, 1])
    assert bare == zero and [s.overhead_s for s in bare.stages] == [0.0, 0.0]
    assert bare.time_per_minibatch == 2.0 and "overheads" not in bare.summary(detail=True)


def small(ov: Overheads) -> Profile:
    """Four nodes of 1 ms each, one parameter tensor of 4 bytes on n0 (nothing to sync over a
    fast link), overheads ``ov``."""
    return with_ov([node(0, (), c=1e-3, p=4.0, params=("a",)), node(1, ("n0",), c=1e-3),
                    node(2, ("n1",), c=1e-3), node(3, ("n2",), c=1e-3)], ov)


def test_the_plan_states_its_overheads() -> None:
    """Two straight stages of 2 ms, action 0.1 ms, message 0.2 ms, 0.01 ms per tensor:
    stage 0 = 2 + 0.1 + 0.01 + 2 x 0.2 = 2.51 ms; stage 1 = 2 + 0.1 + 0.4 = 2.5 ms."""
    ov = Overheads(action_s=1e-4, message_s=2e-4, tensor_s=1e-5)
    plan = plan_for(small(ov), Cluster(workers=2), [0, 2], [1, 1],
                    memory_rule=FLUSH)
    assert [s.overhead_s for s in plan.stages] == pytest.approx([5.1e-4, 5e-4])
    assert [s.compute_s for s in plan.stages] == pytest.approx([2.51e-3, 2.5e-3])
    assert [s.stage_time_s for s in plan.stages] == pytest.approx([2.51e-3, 2.5e-3])
    assert plan.time_per_minibatch == pytest.approx(2.51e-3)
    assert ("(compute includes the runtime's overheads per minibatch: stage 0 510 us, stage 1 "
            "500 us;") in plan.summary(detail=True)
    assert "overheads" not in plan.summary()  # the first screen leaves them to detail
    assert Plan.from_dict(plan.to_dict()) == plan


def test_a_pipeline_must_beat_one_stage_with_the_overheads() -> None:
    """Two straight workers. Without overheads the solver cuts in two (2 ms against 4 ms for one
    stage). With 1 ms per message the pipeline's stages cost 2 + 2 x 1 = 4 ms plus the action,
    no less than one stage's 4 ms plus the action: one stage. At 0.5 ms per message the pipeline
    (2 + 1 = 3 ms) still wins."""
    cluster = Cluster(workers=2)
    two = partition(small(Overheads()), cluster, straight=True)
    assert len(two.stages) == 2 and two.time_per_minibatch == pytest.approx(2e-3)
    one = partition(small(Overheads(action_s=1e-4, message_s=1e-3)), cluster, straight=True)
    assert len(one.stages) == 1 and one.time_per_minibatch == pytest.approx(4.1e-3)
    still = partition(small(Overheads(action_s=1e-4, message_s=5e-4)), cluster, straight=True)
    assert len(still.stages) == 2 and still.time_per_minibatch == pytest.approx(3.1e-3)
    # a forced stage count is the user's: kept even when one stage would be faster
    forced = partition(small(Overheads(action_s=1e-4, message_s=1e-3)), cluster, stages=2,
                       straight=True)
    assert len(forced.stages) == 2 and forced.time_per_minibatch == pytest.approx(4.1e-3)


def test_one_stage_is_kept_out_when_it_does_not_fit() -> None:
    """The one-stage plan must fit the memory cap too. Four nodes of 1 GB of parameters, flush's
    rule (no stashed version), state 3 bytes per parameter byte: 12 GB in one stage, 6 GB per
    half (plus 8-byte activations). Under an 8 GB cap only the halves fit, so the pipeline stays
    although its messages (1 ms each) make it slower than one stage would be."""
    nodes = [node(i, (f"n{i - 1}",) if i else (), c=1e-3, p=1e9, params=(f"p{i}",))
             for i in range(4)]
    prof = with_ov(nodes, Overheads(action_s=1e-4, message_s=1e-3))
    plan = partition(prof, Cluster(workers=2, memory=8e9), straight=True, memory_rule=FLUSH)
    assert len(plan.stages) == 2


def test_old_plans_load_without_overheads() -> None:
    plan = plan_for(chain4(), Cluster(workers=2), [0, 2], [1, 1])
    d = plan.to_dict()
    for st in d["stages"]:
        del st["overhead_s"]
    assert [s.overhead_s for s in Plan.from_dict(d).stages] == [0.0, 0.0]


def test_bad_overheads_are_profile_errors() -> None:
    with pytest.raises(ProfileFormatError, match="message_s=-1"):
        Overheads(message_s=-1)
    with pytest.raises(ProfileFormatError, match="action_s=True"):
        Overheads(action_s=True)
    with pytest.raises(ProfileFormatError, match="malformed overheads"):
        Overheads.from_dict({"latency_s": 1.0})
    assert Overheads.from_dict(None) == Overheads() and Overheads().zero
    assert Overheads.from_dict(OV.to_dict()) == OV


def test_measured_stage_times_still_miss_only_the_messages() -> None:
    """A re-plan's stage times come from the runtime: its calls and copies are in them; the
    reference executor's updates hold the tied sums too."""
    assert OV.in_measured_stages() == Overheads(message_s=10.0, tie_s=1e5,
                                                source="by hand; messages only")
    assert OV.in_measured_stages(ties=True) == Overheads(message_s=10.0,
                                                         source="by hand; messages only")


def test_the_one_stage_plan_recomputes_as_asked() -> None:
    """``recompute="always"``: every stage, the one-stage plan included, runs its forward twice
    (all compute is forward here: 4 nodes of 1 ms). Two stages at 1 ms per message: 2 x 2 ms +
    2 messages + the action = 6.1 ms, against one stage's 8 + 0.1: two stages. At 3 ms per
    message two stages cost 4 + 6 + 0.1 = 10.1 ms: one stage, recomputing as asked."""
    cluster = Cluster(workers=2)
    two = partition(small(Overheads(action_s=1e-4, message_s=1e-3)), cluster, straight=True,
                    recompute="always")
    assert len(two.stages) == 2 and two.recompute == [True, True]
    assert two.time_per_minibatch == pytest.approx(6.1e-3)
    one = partition(small(Overheads(action_s=1e-4, message_s=3e-3)), cluster, straight=True,
                    recompute="always")
    assert one.recompute == [True] and one.time_per_minibatch == pytest.approx(8.1e-3)


def test_fewer_workers_are_a_candidate_when_faster() -> None:
    """Two nodes of 2 ms, 1 MB of weights on the first, 2 workers over 1 MB/s, messages of
    3 ms and actions of 0.1 ms (no stash copies: a flushing rule). Without the overheads the
    2-stage pipeline wins (2 ms a stage, an 8-byte cut at 16 us). With them each of its stages
    pays 0.1 + 2 x 3 ms: 8.1 ms; data parallelism on 2 syncs 1 MB over 1 MB/s, (4 + 0.1) / 2 +
    2 (1/2) 1 s / 2 = 502 ms; one worker alone pays its action only: 4.1 ms. The plan is one
    worker, says so, and is compared with data parallelism on both workers."""
    ov = Overheads(action_s=1e-4, message_s=3e-3, source="by hand")
    nodes = [node(0, (), c=2e-3, p=1e6, params=("w",)), node(1, ("n0",), c=2e-3)]
    cluster = Cluster(workers=2, bandwidth=1e6)
    bare = partition(with_ov(nodes, None), cluster, memory_rule=FLUSH)
    assert bare.replicas == [1, 1]
    plan = partition(with_ov(nodes, ov), cluster, memory_rule=FLUSH)
    assert plan.replicas == [1] and plan.workers_used == 1
    assert plan.time_per_minibatch == pytest.approx(4.1e-3)
    assert plan.one_worker_time == pytest.approx(4.1e-3)
    assert plan.data_parallel_time == pytest.approx(0.50205)
    text = plan.summary()
    assert ("speedup: 122.45x over data parallelism on 2 workers (502 ms per minibatch), 1.00x "
            "over one worker (4.1 ms)") in text.splitlines()
    assert "This plan uses 1 of the 2 workers: none on more is faster here" in text
    two = plan_for(with_ov(nodes, ov), cluster, [0, 1], [1, 1], memory_rule=FLUSH)
    assert two.time_per_minibatch == pytest.approx(8.1e-3)
    assert two.speedup_over_one_worker == pytest.approx(4.1 / 8.1)


def test_a_repriced_copy_sharing_the_nodes_gets_its_own_baselines() -> None:
    # the graph's facts are kept per node tuple; a copy with other overheads shares the tuple,
    # and its data parallelism and one worker must be priced with its own overheads
    bare = with_ov([node(0, (), p=10.0, params=("a",)), node(1, ("n0",))], None)
    priced = replace(bare, meta=with_overheads({}, OV))
    assert priced.nodes is bare.nodes
    cluster = Cluster(workers=2, bandwidth=1e9)
    first = partition(bare, cluster)
    again = partition(priced, cluster)
    fresh = partition(Profile.from_dict(priced.to_dict()), cluster)  # nodes of its own
    assert (again.data_parallel_time, again.one_worker_time) == \
        (fresh.data_parallel_time, fresh.one_worker_time)
    assert again.one_worker_time > first.one_worker_time
