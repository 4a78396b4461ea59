"""Re-planning decisions from measurements (runtime/pricing/replan.py), on hand-made profiles whose
best partitions are worked out by hand."""
from __future__ import annotations


import pytest

from fxpipe.costmodel import Cluster, Profile, ProfileNode
from fxpipe.errors import ConfigError
from fxpipe.passes.partition import plan_for
from fxpipe.runtime.pricing.replan import StageTimes, after_first_update, measure, propose, rescale
from fxpipe.runtime.timeline import TimelineEvent
from fxpipe.runtime.training.trainer_switch import measured_stage_times

MS = 1e-3


def chain(costs: list[float]) -> Profile:
    """A chain of nodes, forward = backward = cost each, no parameters, tiny activations (the
    links cost nothing): a stage's time is the sum of its nodes' 2 x cost. Module calls (layers):
    a parameter-free function call on nothing but constants would be made again by each stage
    that reads it (fxpipe.passes.made_here)."""
    nodes, prev = [], ()
    for i, c in enumerate(costs):
        nodes.append(ProfileNode(f"n{i}", "call_module", "f", c, c, 4.0, 0.0, inputs=prev))
        prev = (f"n{i}",)
    return Profile(tuple(nodes), batch_size=1)


CLUSTER = Cluster(workers=2, bandwidth="100Gbps")


def test_a_stage_measured_4x_slower_moves_the_cut() -> None:
    """Profile [1, 1, 1, 1] ms split [2 | 2] (balanced). Measured: stage 0 takes 4x its
    prediction, so its nodes cost [4, 4] and the rescaled chain is [4, 4, 1, 1]. Current
    partition: max(2*8, 2*2) = 16 ms per minibatch. By hand the best straight 2-stage
    partition is [4 | 4, 1, 1]: max(8, 12) = 12 ms; data parallel on 2 workers (no parameters
    to sync) is 2*10/2 = 10 ms. Either way a gain over 5%: adopt."""
    profile = chain([MS] * 4)
    plan = plan_for(profile, CLUSTER, [0, 2], [1, 1])
    assert plan.time_per_minibatch == pytest.approx(4 * MS, rel=1e-3)
    got = propose(profile, plan, [StageTimes(8 * MS, 8 * MS, 0.0), StageTimes(2 * MS, 2 * MS, 0.0)],
                  CLUSTER)
    assert got.factors == ((4.0, 4.0, 1.0), (1.0, 1.0, 1.0))
    assert got.current.time_per_minibatch == pytest.approx(16 * MS, rel=1e-3)
    assert got.proposed.time_per_minibatch == pytest.approx(10 * MS, rel=1e-3)
    assert got.adopt and got.gain == pytest.approx(0.6, rel=1e-3)


def test_measurements_that_match_the_profile_keep_the_plan() -> None:
    profile = chain([MS] * 4)
    plan = plan_for(profile, CLUSTER, [0, 2], [1, 1])
    got = propose(profile, plan, [StageTimes(2 * MS, 2 * MS, 0.0)] * 2, CLUSTER)
    assert got.factors == ((1.0, 1.0, 1.0), (1.0, 1.0, 1.0))
    assert got.current.time_per_minibatch == pytest.approx(plan.time_per_minibatch)
    # data parallel (4 ms) ties with the balanced pipeline: no gain, nothing to adopt
    assert not got.adopt and got.gain == pytest.approx(0.0, abs=1e-9)


def test_gain_below_the_threshold_is_not_adopted() -> None:
    """Stage 0 measured 10% slow: [1.1, 1.1, 1, 1]; the current plan costs 4.4 ms, data
    parallel 4.2 ms: a gain of 4.8%, under a 5% threshold, over a 1% one."""
    profile = chain([MS] * 4)
    plan = plan_for(profile, CLUSTER, [0, 2], [1, 1])
    slow = [StageTimes(2.2 * MS, 2.2 * MS, 0.0), StageTimes(2 * MS, 2 * MS, 0.0)]
    assert not propose(profile, plan, slow, CLUSTER, threshold=0.05).adopt
    got = propose(profile, plan, slow, CLUSTER, threshold=0.01)
    assert got.adopt and got.gain == pytest.approx(4.4 / 4.2 - 1, rel=1e-3)


def test_rescale_keeps_kinds_that_were_not_measured_and_checks_the_stage_count() -> None:
    profile = chain([MS] * 4)
    plan = plan_for(profile, CLUSTER, [0, 2], [1, 1])
    scaled, f = rescale(profile, plan, [StageTimes(0.0, 6 * MS, 0.0), StageTimes(2 * MS, 2 * MS,
                                                                                 0.0)])
    assert f[0] == (1.0, 3.0, 1.0)
    assert [n.backward_s for n in scaled.nodes] == pytest.approx([3 * MS, 3 * MS, MS, MS])
    assert [n.forward_s for n in scaled.nodes] == pytest.approx([MS] * 4)
    with pytest.raises(ConfigError, match="1 stage measurements for a plan of 2 stages"):
        rescale(profile, plan, [StageTimes(MS, MS, 0.0)])


def test_measure_averages_spans_per_minibatch_and_per_update() -> None:
    ev = [TimelineEvent("forward", "F0", 0.0, 1.0, {"minibatch": 0}),
          TimelineEvent("forward", "F1", 1.0, 4.0, {"minibatch": 1}),
          TimelineEvent("backward", "B0", 4.0, 6.0, {"minibatch": 0}),
          TimelineEvent("optimizer", "U0 gradients", 6.0, 6.5, {"update": 0}),
          TimelineEvent("optimizer", "U0", 7.0, 8.0, {"update": 0}),
          TimelineEvent("idle", "", 8.0, 9.0, {})]
    assert measure(ev) == StageTimes(2.0, 2.0, 1.5)


@pytest.mark.multiprocess
def test_torchrun_ranks_measure_their_stages_and_agree_on_one_proposal(tmp_path) -> None:
    """2 ranks, a compiled 2-stage MLP with timelines: every rank gets the same proposal, and
    each stage's forward/backward factor is that stage's own measured mean over its predicted
    time (the rank's timeline, read here independently of the exchange)."""
    import sys

    from rt_procs import HERE, _port, _run

    out = tmp_path / "got"
    res = _run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
                "--master-addr=127.0.0.1", f"--master-port={_port()}",
                str(HERE / "replan_job.py"), str(out)])
    assert res.returncode == 0, res.stdout[-3000:]
    import torch

    got = [torch.load(f"{out}.{r}.pt", weights_only=False) for r in range(2)]
    assert got[0]["factors"] == got[1]["factors"] and got[0]["gain"] == got[1]["gain"]
    assert got[0]["current"] == [1, 1]
    for g in got:
        s, own = g["stage"], g["own"]
        assert len(own) >= 1
        for k in range(2):  # forward, backward
            mean = sum(o[k] for o in own) / len(own)
            assert g["factors"][s][k] == pytest.approx(mean / g["predicted"][s][k], rel=1e-9)


def test_a_running_job_keeps_all_its_workers() -> None:
    """Two nodes with 100 MB of parameters each on 3 workers at 1 Gbps: replicating a stage
    costs an all-reduce of 100 MB, far more than the 1 + 3 ms of compute, so the solver uses 2
    workers ([1 | 1]). A running job cannot hand its third process back: use_all_workers (and
    propose(workers=3)) adds it to a stage; both replicated stages pay the same all-reduce, and
    stage 0 has less compute to share, so by hand the spare joins stage 0: replicas [2, 1],
    the cut unchanged."""
    from fxpipe.passes.partition import partition
    from fxpipe.runtime.pricing.replan import stage_starts, use_all_workers

    nodes = (ProfileNode("n0", "call_function", "f", MS, MS, 4.0, 1e8, inputs=()),
             ProfileNode("n1", "call_function", "f", 3 * MS, 3 * MS, 4.0, 1e8, inputs=("n0",)))
    profile = Profile(nodes, batch_size=1)
    cluster = Cluster(workers=3, bandwidth="1Gbps")
    best = partition(profile, cluster)
    assert best.replicas == [1, 1]
    full = use_all_workers(profile, cluster, best, 3)
    assert full.replicas == [2, 1] and stage_starts(profile, full) == [0, 1]
    assert full.time_per_minibatch > best.time_per_minibatch  # the price of keeping them
    got = propose(profile, best, [StageTimes(MS, MS, 0.0), StageTimes(3 * MS, 3 * MS, 0.0)],
                  cluster, workers=3)
    assert sum(got.proposed.replicas) == 3 and got.current.replicas == [1, 1]
    assert not got.adopt  # keeping the 2-worker plan beats any 3-worker one: nothing to gain


def _update(k: int, t: float, f: float, b: float, u: float, mbs: list[int]) -> tuple[
        list[TimelineEvent], float]:
    """One flushed update ``k`` from time ``t``: F then B of each minibatch, then U."""
    out = []
    for m in mbs:
        out.append(TimelineEvent("forward", f"F{m}", t, t + f, {"minibatch": m}))
        out.append(TimelineEvent("backward", f"B{m}", t + f, t + f + b, {"minibatch": m}))
        t += f + b
    out.append(TimelineEvent("optimizer", f"U{k}", t, t + u, {"update": k}))
    return out, t + u


def test_the_first_update_of_the_first_segment_is_warm_up() -> None:
    """Update 0: F 10, B 30, U 5 per minibatch (first use); update 1: F 1, B 2, U 0.5. The
    rank's times count from the end of U0: exactly update 1's; a segment of one update keeps
    everything (nothing else to measure)."""
    u0, t = _update(0, 0.0, 10.0, 30.0, 5.0, [0, 1])
    u1, _ = _update(1, t, 1.0, 2.0, 0.5, [2, 3])
    assert measure(after_first_update(u0 + u1)) == StageTimes(1.0, 2.0, 0.5)
    assert measure(u0 + u1) == StageTimes(5.5, 16.0, 2.75)  # the mean the warm-up inflates
    assert after_first_update(u0) == u0
    assert after_first_update(u0[:2]) == u0[:2]  # no update recorded


def test_a_trainer_measures_its_first_segment_after_its_warm_up() -> None:
    """measured_stage_times on a 1-stage trainer with two recorded segments of two updates:
    skip=0 uses the first segment after its first update (1, 2, 0.5) and all of the second
    (means 4, 5, 2): (2.5, 3.5, 1.25); skip=1 only the second, whole."""
    u0, t = _update(0, 0.0, 10.0, 30.0, 5.0, [0, 1])
    u1, _ = _update(1, t, 1.0, 2.0, 0.5, [2, 3])
    u2, t = _update(2, 0.0, 3.0, 4.0, 1.5, [4, 5])
    u3, _ = _update(3, t, 5.0, 6.0, 2.5, [6, 7])
    timelines = [(u0 + u1, []), (u2 + u3, [])]
    one = lambda mine, what: [mine]  # noqa: E731 - one rank: the exchange gives its own back
    assert measured_stage_times(timelines, [0], 1, one, skip=0) == [StageTimes(2.5, 3.5, 1.25)]
    assert measured_stage_times(timelines, [0], 1, one, skip=1) == [StageTimes(4.0, 5.0, 2.0)]
