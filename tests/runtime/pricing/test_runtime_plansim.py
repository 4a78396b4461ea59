"""The plan simulator: exact periods, replication, link-bound cases, bytes, traces, CLI.

Hand-made profiles with binary-exact times (1, 2, 0.25, ...) so every expectation is exact.
"""
from __future__ import annotations

import argparse
import json
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest

from fxpipe.costmodel.hardware import Cluster
from fxpipe.costmodel.profile import Profile, ProfileNode
from fxpipe.passes import partition
from fxpipe.runtime.pricing.plansim import data_parallel_plan, simulate_plan
from fxpipe.runtime.schedules.kinds import make_schedule

BW = 1e6  # bytes/s, so bytes / BW is exact for the sizes below


def chain(*nodes: tuple[float, float, float, float]) -> Profile:
    """A chain profile from (forward_s, backward_s, activation_bytes, parameter_bytes)."""
    out = []
    for i, (f, b, a, p) in enumerate(nodes):
        out.append(ProfileNode(name=f"n{i}", op="call_module", target="m", forward_s=f,
                               backward_s=b, activation_bytes=a, parameter_bytes=p,
                               inputs=(f"n{i - 1}",) if i else ()))
    return Profile(nodes=tuple(out), batch_size=4)


def two_stage(f0: float, b0: float, f1: float, b1: float, x: float, **cluster: object):
    prof = chain((f0, b0, x, 0.0), (f1, b1, 0.0, 0.0))
    plan = partition(prof, Cluster(workers=2, bandwidth=BW, **cluster), stages=2, straight=True)
    assert plan.replicas == [1, 1]
    return prof, plan


def test_two_stage_straight_exact_period_and_split() -> None:
    prof, plan = two_stage(1.0, 2.0, 0.5, 1.5, 250_000.0)  # comm 0.25 s per direction
    sim = simulate_plan(plan, prof, minibatches=40)
    assert plan.time_per_minibatch == 3.0
    assert sim.steady_state_period == pytest.approx(3.0, rel=1e-12)
    assert sim.relative_error == pytest.approx(0.0, abs=1e-12)
    assert [(c.forward_s, c.backward_s) for c in sim.costs] == [(1.0, 2.0), (0.5, 1.5)]
    assert sim.utilisation[0] == pytest.approx(1.0)
    assert sim.utilisation[1] == pytest.approx(2.0 / 3.0)
    assert sim.throughput == pytest.approx(4 / 3.0)  # batch 4, samples/s
    # without a profile: the 1:2 split of compute_s
    nop = simulate_plan(plan, None, minibatches=40)
    assert nop.costs[1].forward_s == pytest.approx(2.0 / 3.0)
    assert nop.steady_state_period == pytest.approx(3.0, rel=1e-12)


def test_replication_halves_per_replica_load() -> None:
    prof = chain((1.0, 2.0, 0.0, 0.0))
    one = simulate_plan(data_parallel_plan(prof, Cluster(workers=1, bandwidth=BW)), prof,
                        minibatches=40)
    two = simulate_plan(data_parallel_plan(prof, Cluster(workers=2, bandwidth=BW)), prof,
                        minibatches=40)
    assert one.steady_state_period == pytest.approx(3.0)
    assert two.steady_state_period == pytest.approx(1.5)
    # replicated input stage feeding a single one: [2, 1], each stage 1.5 s per minibatch
    prof2 = chain((1.0, 2.0, 0.0, 0.0), (0.5, 1.0, 0.0, 0.0))
    plan = partition(prof2, Cluster(workers=3, bandwidth=BW), stages=2)
    assert plan.replicas == [2, 1] and plan.time_per_minibatch == 1.5
    sim = simulate_plan(plan, prof2, minibatches=40)
    assert sim.steady_state_period == pytest.approx(1.5, rel=1e-12)
    assert sim.costs[0].forward_s == 1.0  # a replica runs whole minibatches


@pytest.mark.parametrize("sync", ["allreduce", "parameter-server"])
def test_sync_at_update_amortises_to_plan_sync(sync: str) -> None:
    prof = chain((1.0, 2.0, 0.0, 500_000.0))  # P / B = 0.5 s
    plan = data_parallel_plan(prof, Cluster(workers=2, bandwidth=BW), sync=sync)
    sim = simulate_plan(plan, prof, minibatches=40)
    # one sync per round of 2 minibatches: allreduce (3 + 2 (1/2) 0.5) / 2 = 1.75 (the update
    # holds both replicas for one ring all-reduce, 0.5 s); parameter-server (3 + 4 (1/2) 0.5) / 2
    want, ring = {"allreduce": (1.75, 0.5), "parameter-server": (2.0, 1.0)}[sync]
    assert plan.time_per_minibatch == pytest.approx(want)
    assert sim.costs[0].update_s == pytest.approx(ring)
    assert sim.costs[0].update_s == pytest.approx(2 * plan.stages[0].sync_s)
    assert sim.steady_state_period == pytest.approx(plan.time_per_minibatch, rel=1e-12)
    # ring / sharded PS: 2 (r-1) P bytes per update, one update per 2 minibatches
    assert sim.sync_bytes_per_minibatch == pytest.approx(500_000.0)
    assert sim.activation_bytes_per_minibatch == 0.0


def test_communication_bound_is_limited_by_link_time() -> None:
    prof, plan = two_stage(0.125, 0.25, 0.125, 0.25, 1_000_000.0)  # X / B = 1 s per direction
    assert plan.time_per_minibatch == pytest.approx(2.0)  # planner: 2 X / B on one link
    # enough minibatches in flight: each direction of the link carries 1 s per minibatch
    full = simulate_plan(plan, prof, minibatches=60, noam=4)
    assert full.steady_state_period == pytest.approx(1.0, rel=1e-12)
    # half-duplex ports carry both directions: the planner's cut time. First-come-first-served
    # on one shared link is not exactly periodic, so the measured slope wobbles around it.
    half = simulate_plan(plan, prof, minibatches=240, noam=4, duplex=False)
    assert half.steady_state_period == pytest.approx(2.0, rel=0.03)
    assert half.makespan / 240 == pytest.approx(2.0, rel=0.03)
    # the default window (2 in flight) cannot hide the round trip f0 + c + f1 + b1 + c + b0
    dflt = simulate_plan(plan, prof, minibatches=60)
    assert dflt.steady_state_period == pytest.approx((0.125 + 1 + 0.375 + 1 + 0.25) / 2)
    # latency lengthens that round trip by two messages
    lat = simulate_plan(plan, prof, minibatches=60, latency_s=0.5)
    assert lat.steady_state_period == pytest.approx((2.75 + 1.0) / 2)


def test_bytes_on_the_wire_exact() -> None:
    prof = chain((1.0, 2.0, 250_000.0, 100.0), (1.0, 2.0, 0.0, 300.0))
    plan = partition(prof, Cluster(workers=4, bandwidth=BW), stages=2)
    assert plan.replicas == [2, 2]
    sim = simulate_plan(plan, prof, minibatches=40)
    assert sim.activation_bytes_per_minibatch == 500_000.0   # activations + gradients
    assert sim.sync_bytes_per_minibatch == pytest.approx(2 * 1 * (100.0 + 300.0) / 2)
    assert sim.bytes_per_sample == pytest.approx(sim.bytes_per_minibatch / 4)


def test_chrome_trace_one_f_and_b_per_minibatch_per_rank(tmp_path: Path) -> None:
    prof = chain((1.0, 2.0, 1000.0, 10.0), (0.5, 1.0, 0.0, 0.0))
    plan = partition(prof, Cluster(workers=3, bandwidth=BW), stages=2)
    n = 12
    sim = simulate_plan(plan, prof, minibatches=n)
    path = sim.write_trace(tmp_path / "t.json")
    trace = json.loads(path.read_text())
    xs = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    sched = make_schedule("pipedream", plan.replicas, n)
    for g, (s, j) in enumerate(sched.ranks):
        mine = [k for k in range(n) if sched.owner(s, k) == (s, j)]
        names = Counter(e["name"] for e in xs if e["pid"] == g and e["cat"] in ("forward", "backward"))
        assert names == Counter([f"F{k}" for k in mine] + [f"B{k}" for k in mine])
        tids = {e["tid"] for e in xs if e["pid"] == g and e["cat"] == "forward"}
        assert len(tids) == 1
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in xs)
    assert {e["cat"] for e in xs} >= {"forward", "backward", "send", "allreduce"}


def test_pipedream_vgg16_compute_bound_plan_matches() -> None:
    from fxpipe.models import pipedream

    path = pipedream.profile_path("vgg16")
    prof = Profile.from_pipedream(path)
    plan = partition(prof, Cluster(workers=8, bandwidth="10Gbps"), sync="parameter-server")
    sim = simulate_plan(plan, prof)
    assert plan.replicas == [7, 1]
    assert abs(sim.relative_error) < 0.01


def test_cli_simulate(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from fxpipe.cli_simulate import add_simulate_parser

    prof = chain((1.0, 2.0, 1000.0, 10.0), (0.5, 1.0, 0.0, 0.0))
    prof.save(tmp_path / "p.json")
    parser = argparse.ArgumentParser(prog="fxpipe")
    add_simulate_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["simulate", str(tmp_path / "p.json"), "--workers", "3",
                              "--bandwidth", "1MB/s", "--trace", str(tmp_path / "t.json"),
                              "--minibatches", "24"])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "steady state" in out and "BSP" in out
    assert json.loads((tmp_path / "t.json").read_text())["traceEvents"]


@pytest.mark.parametrize("noam, window, period", [(None, 3, "2 s"), ("pipedream", None, "2.5 s"),
                                                  ("4", 4, "2 s")])
def test_cli_simulate_runs_the_trainers_window(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                               noam: str | None, window: int | None,
                                               period: str) -> None:
    """`fxpipe simulate` simulates the window a trainer admits (two 2 s stages, a 0.5 s cut
    each way: 3 in flight run at 2 s, PipeDream's 2 at 2.5 s), unless --noam says otherwise."""
    from fxpipe.cli_simulate import add_simulate_parser

    prof = Profile(nodes=tuple(
        ProfileNode(name=f"n{i}", op="call_module", target="m", forward_s=1.0, backward_s=1.0,
                    activation_bytes=0.5e6 if i == 0 else 0.0, parameter_bytes=5e6,
                    inputs=(f"n{i - 1}",) if i else ()) for i in range(2)), batch_size=4)
    prof.save(tmp_path / "p.json")
    parser = argparse.ArgumentParser(prog="fxpipe")
    add_simulate_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["simulate", str(tmp_path / "p.json"), "--workers", "2",
                              "--bandwidth", "1MB/s", "--stages", "2", "--straight",
                              "--schedule", "pipedream", *(["--noam", noam] if noam else [])])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    lines = [ln for ln in out.splitlines() if ln.startswith("in flight at the input stage")]
    if window is None:
        assert lines == []
    else:
        assert lines == [f"in flight at the input stage: {window} minibatches (PipeDream's NOAM: 2"
                         + ("; what the trainer admits: the fewest that hide the plan's round "
                            "trips)" if noam is None else ")")]
    assert f"steady state: {period} per minibatch" in out


def test_tied_weights_are_priced_lockstep_when_synchronous_and_free_when_delayed() -> None:
    """4 unit stages, a 1000-byte weight owned by n0 (stage 0) and shared by n3 (stage 3).
    Synchronous tied sum: the last stage's update i waits for stage 0's update i, i.e. for
    F3 + B3 + B2 + B1 + B0 = 5 s per minibatch, plus the 1 ms that stage 0's part of the sum
    takes to reach stage 3 (1000 B at 1 MB/s: a tie of two ranks is two messages, each sent at
    its holder's update; the 2-holder ring all-reduce cost the same 1 ms). The runtime's pipedream delay (3 rounds): 2 s,
    as without the tie. Bytes: each of the two holders sends 1000 B per update."""
    from fxpipe.runtime.pricing.plansim import TiedSync, tied_from_profile

    nodes = [ProfileNode(name=f"n{i}", op="call_module", target="m", forward_s=1.0,
                         backward_s=1.0, activation_bytes=0.0,
                         parameter_bytes=1000.0 if i == 0 else 0.0,
                         inputs=(f"n{i - 1}",) if i else (), params=("w",) if i == 0 else (),
                         shared_params=("w",) if i == 3 else ()) for i in range(4)]
    prof = Profile(nodes=tuple(nodes), batch_size=4)
    plan = partition(prof, Cluster(workers=4, bandwidth=BW), stages=4, straight=True)
    assert plan.replicas == [1, 1, 1, 1]
    assert tied_from_profile(plan, prof) == [TiedSync((0, 3), 1000.0)]
    untied = simulate_plan(plan, prof, minibatches=200, tied=[])
    lockstep = simulate_plan(plan, prof, minibatches=200, tied_delay=0)
    delayed = simulate_plan(plan, prof, minibatches=200)
    assert untied.steady_state_period == pytest.approx(2.0, rel=1e-12)
    assert lockstep.steady_state_period == pytest.approx(5.001, rel=1e-9)
    assert delayed.steady_state_period == pytest.approx(2.0, rel=1e-12)
    assert delayed.sync_bytes_per_minibatch == pytest.approx(2000.0)
    flush = simulate_plan(plan, prof, schedule="1f1b-flush", minibatches=200)
    assert flush.sync_bytes_per_minibatch > 0  # synchronous there: priced as a barrier


@pytest.mark.parametrize("x, period2, want", [(0.0, 3.0, 2), (750_000.0, 3.75, 3),
                                              (1_500_000.0, 4.5, 3)])
def test_the_window_that_hides_a_round_trip(x: float, period2: float, want: int) -> None:
    """Two stages of 3 s per minibatch, one-way transfers T = x / B: stage 0 needs minibatch k's
    gradient T + 3 + T after its forward, while PipeDream's NOAM of 2 gives it only the 3 s of
    one other minibatch, so the period is (3 + 3 + 2T) / 2 (by hand: 3.75 at T = 0.75, 4.5 at
    T = 1.5) though no link is busier than 1.5 s per 3 s; 3 in flight restore the 3 s and
    noam_for picks the fewest that do (2 when nothing is on the wire)."""
    from fxpipe.runtime.pricing.plansim import noam_for

    prof, plan = two_stage(1.0, 2.0, 1.0, 2.0, x)
    assert simulate_plan(plan, prof, minibatches=200).steady_state_period == \
        pytest.approx(period2, rel=1e-9)
    assert simulate_plan(plan, prof, noam=3, minibatches=200).steady_state_period == \
        pytest.approx(3.0, rel=1e-9)
    assert noam_for(plan, prof) == want


@pytest.mark.parametrize("cuts, replicas", [  # found: 4, 5, 5, 2, 4, 4 (PipeDream's: 4 4 4 2 3 2)
    ((0.4e6, 0.1e6, 0.9e6), (1, 1, 1, 1)), ((1.5e6, 0.0, 0.3e6), (1, 1, 1, 1)),
    ((1.2e6, 1.2e6, 1.2e6), (1, 1, 1, 1)), ((0.8e6, 0.5e6), (2, 1, 1)),
    ((1.4e6, 1.4e6), (1, 1, 1)), ((2.9e6,), (1, 1))])
def test_the_window_search_is_the_scan(cuts: tuple[float, ...], replicas: tuple[int, ...]) -> None:
    """noam_for's search (PipeDream's window, the widest, bisection between) finds what scanning
    every window finds: the fewest whose simulated period is within 2% of the widest's, on
    chains of 1 s + 2 s nodes with uneven cuts and a replicated input stage."""
    from fxpipe.passes.partition import plan_for
    from fxpipe.runtime.pricing.plansim import noam_for

    prof = chain(*[(1.0, 2.0, c, 1e3) for c in cuts], (1.0, 2.0, 0.0, 1e3))
    plan = plan_for(prof, Cluster(workers=sum(replicas), bandwidth=BW),
                    list(range(len(replicas))), list(replicas))
    base = -(-sum(replicas) // replicas[0])
    periods = {w: simulate_plan(plan, prof, noam=w, minibatches=200).steady_state_period
               for w in range(base, 2 * base + 3)}
    widest = periods[2 * base + 2]
    assert all(periods[w] >= periods[w + 1] * (1 - 1e-9) for w in range(base, 2 * base + 2))
    want = min(w for w, p in periods.items() if p <= widest * 1.02)
    assert noam_for(plan, prof) == want


def _tied_pair(weight_bytes: float, cut_bytes: float) -> Profile:
    """4 nodes of 0.5 + 0.5 s; n0 owns a ``weight_bytes`` parameter that n3 shares; the cut
    between n1 and n2 carries ``cut_bytes`` each way."""
    return Profile(nodes=tuple(
        ProfileNode(name=f"n{i}", op="call_module", target="m", forward_s=0.5, backward_s=0.5,
                    activation_bytes=cut_bytes if i == 1 else 0.0,
                    parameter_bytes=weight_bytes if i == 0 else 0.0,
                    inputs=(f"n{i - 1}",) if i else (), params=("w",) if i == 0 else (),
                    shared_params=("w",) if i == 3 else ()) for i in range(4)), batch_size=4)


@pytest.mark.parametrize("w, x", [(1000.0, 0.0), (3e6, 0.0), (3e6, 5e5), (3e6, 1e6)])
def test_a_lagged_tied_sum_shares_the_link_with_the_cuts(w: float, x: float) -> None:
    """Two stages of 2 s per minibatch sharing a w-byte weight (pipedream: the sum lags d = 1
    round, in the background). Each way the link carries the 2-holder ring's w bytes plus the
    x-byte cut per minibatch, so by hand the period is at least max(2, (w + x) / B), and no more
    than that plus one piece of the ring (TIED_CHUNKS pieces) per cut message waiting behind it
    (two per minibatch). Before the sum took the ports, the period was 2 s whatever w was."""
    from fxpipe.runtime.pricing.core import TIED_CHUNKS

    prof = _tied_pair(w, x)
    plan = partition(prof, Cluster(workers=2, bandwidth=BW), stages=2, straight=True)
    sim = simulate_plan(plan, prof, minibatches=200)
    bound = max(2.0, (w + x) / BW)
    assert bound <= sim.steady_state_period <= bound + 2 * (w / BW) / TIED_CHUNKS + 1e-9
    assert sim.sync_bytes_per_minibatch == pytest.approx(2 * w)
    if w == 3e6 and x > 0:  # link-bound: well above the 2 s of compute
        assert sim.steady_state_period >= 3.5


@pytest.mark.parametrize("w, want", [(5e5, 3.0), (2e6, 3.5)])
def test_a_synchronous_tied_pair_sends_the_part_ready_first(w: float, want: float) -> None:
    """1f1b-flush, m = 2, two stages of F 1 s and B 1 s, no cut bytes, a w-byte tie (T = w / B
    each way), summed as the runtime sums a tie of two ranks: each stage sends its part at its
    update and updates once the other's has arrived. By hand: stage 1 reaches U at 5 s and
    stage 0 at 6 s, so stage 0 has stage 1's part at 5 + T and updates at max(6, 5 + T), and
    stage 1 gets stage 0's at 6 + T, which delays its next forward (due at 7) only when T > 1.
    T = 0.5: 6 s per update as without the tie (3 s per minibatch; the barrier priced before,
    both updates after the later arrival plus T, said 3.25). T = 2: stage 0 waits 1 s for
    the part, and in steady state updates every 7 s (3.5 per minibatch; the barrier: 4.0).
    Each stage sends w per update: w per minibatch in all."""
    prof = _tied_pair(w, 0.0)
    plan = partition(prof, Cluster(workers=2, bandwidth=BW), stages=2, straight=True)
    sim = simulate_plan(plan, prof, schedule="1f1b-flush", microbatches=2, minibatches=200)
    assert sim.steady_state_period == pytest.approx(want, rel=1e-9)
    assert sim.sync_bytes_per_minibatch == pytest.approx(w)


def test_auto_choice_simulates_a_pipedream_plan_that_splits_tied_weights() -> None:
    """The planner splits the 4 s of compute into two 2 s stages (it prices the empty cut, not
    the 6 MB tied sum: 6 s per update on the link); one worker takes 4 s. choose="auto" sees the
    tie and simulates, so it keeps one worker; "planner" keeps the pipeline (PipeDream's own
    choice); without the tie both agree on two stages."""
    from fxpipe.api import choose_plan
    from fxpipe.runtime.pricing.plan_choice import splits_tied

    cluster = Cluster(workers=2, bandwidth=BW)
    prof = _tied_pair(6e6, 0.0)
    planner = choose_plan(prof, cluster, choose="planner")
    assert planner.replicas == [1, 1] and splits_tied(planner, prof)
    auto = choose_plan(prof, cluster)
    assert auto.replicas == [1]
    assert auto.time_per_minibatch == pytest.approx(4.0)
    untied = Profile(nodes=tuple(replace(n, shared_params=()) for n in prof.nodes), batch_size=4)
    assert choose_plan(untied, cluster).replicas == [1, 1]


@pytest.mark.parametrize("cut_s, capped, stalls",
                         [(0.5, True, True), (0.5, False, False), (0.05, True, False)])
def test_auto_choice_simulates_a_pipedream_plan_whose_round_trips_are_not_hidden(
        cut_s: float, capped: bool, stalls: bool) -> None:
    """Two nodes of 1 s forward + 1 s backward, a cut of ``cut_s`` seconds on the link each
    way, 5 MB of weights each (data parallelism: 7 s). The planner's optimum is two 2 s stages.
    With PipeDream's 2 minibatches in flight, a minibatch's round trip takes 4 s of compute and
    2 cut_s of transfer, so by Little's law the period is (4 + 2 cut_s) / 2 = 2 + cut_s: 2.5 s,
    25% over the plan. The Trainer admits 3 (noam_for: 3 x 2 s covers the 5 s round trip), at
    which the plan runs at its planned 2 s, so auto keeps the planner's word; under a memory cap
    that holds PipeDream's window but not one more version, it admits 2 and auto prices the plan
    by simulation (one worker: 4 s, so the pipeline stays, at its true time); at 0.05 s, capped
    too, the 2.5% gap is within the planner's tolerance and its plan and time stand."""
    from fxpipe.api import choose_plan
    from fxpipe.runtime.pricing.plan_choice import unpriced_by_planner
    from fxpipe.runtime.pricing.plansim import noam_for, trainer_window, with_trainer_window

    prof = Profile(nodes=tuple(
        ProfileNode(name=f"n{i}", op="call_module", target="m", forward_s=1.0, backward_s=1.0,
                    activation_bytes=cut_s * BW if i == 0 else 0.0, parameter_bytes=5e6,
                    inputs=(f"n{i - 1}",) if i else ()) for i in range(2)), batch_size=4)
    free = choose_plan(prof, Cluster(workers=2, bandwidth=BW), choose="planner",
                       schedule="pipedream")
    # the cap: what PipeDream's window holds on the fuller stage, and 1 MB (< a version) more
    cap = max(sp.memory_bytes for sp in free.stages) + 1e6
    cluster = Cluster(workers=2, bandwidth=BW, memory=cap if capped else None)
    planner = choose_plan(prof, cluster, choose="planner", schedule="pipedream")
    assert planner.replicas == [1, 1] and planner.time_per_minibatch == pytest.approx(2.0)
    sim = simulate_plan(planner, prof, minibatches=200).steady_state_period
    assert sim == pytest.approx(2.0 + cut_s, rel=1e-9)
    # a third minibatch gains cut_s / (2 + cut_s): 20% at 0.5 s, 2.4% at 0.05 s (over 2%)
    assert noam_for(planner, prof, cap=float("inf")) == 3
    assert trainer_window(planner, prof, "pipedream") == (2 if capped else 3)
    # what compile records: the window where it is wider, and pipedream's staleness for it
    # (stage 0's forward of k reads version k - window + 1: own delay window - 1)
    shown = with_trainer_window(planner, prof)
    assert shown.window == (None if capped else 3)
    assert [own for own, _ in shown.staleness["pipedream"]] == ([1, 0] if capped else [2, 0])
    assert shown.staleness["1f1b-flush"] == planner.staleness.get("1f1b-flush",
                                                                  ((0, 1), (0, 0)))
    auto = choose_plan(prof, cluster, schedule="pipedream")
    assert auto.replicas == [1, 1]
    if stalls:
        why = unpriced_by_planner(planner, prof) or ""
        assert "simulates at 2500 ms per minibatch under pipedream, planned 2000 ms" in why
        assert auto.time_source == "simulated pipedream"
        assert auto.time_per_minibatch == pytest.approx(2.5, rel=1e-9)
    else:
        assert unpriced_by_planner(planner, prof) is None
        assert auto.time_per_minibatch == pytest.approx(2.0) and auto.time_source == "planner"


def test_tied_stages_with_unequal_replicas_are_not_simulated_under_pipedream() -> None:
    """Replicas [2, 1] with a weight shared by both stages: under pipedream stage 0 updates once
    per 2 minibatches, stage 1 every minibatch, and their updates are one all-reduce, so the
    runtime refuses the plan (contract.check_schedule); the simulator says so instead of pricing
    it (it used to, and the chooser could pick it), and 1f1b-flush, where every rank updates
    once per batch, is priced."""
    from fxpipe.errors import InfeasiblePlanError
    from fxpipe.passes.partition import plan_for

    prof = _tied_pair(1000.0, 0.0)
    plan = plan_for(prof, Cluster(workers=3, bandwidth=BW), [0, 2], [2, 1])
    with pytest.raises(InfeasiblePlanError, match=r"update unequally often .*\(0, 0\): 50"):
        simulate_plan(plan, prof, minibatches=100)
    assert simulate_plan(plan, prof, schedule="1f1b-flush", minibatches=100).steady_state_period > 0


def test_a_sharded_group_syncs_half_as_much_again() -> None:
    """Data parallelism on 2 workers of 1000 B/s over 2000 parameter bytes (tests/passes/
    test_shard.py's case): the replicas' ring all-reduce sends 2 (r-1)/r P = 2000 bytes each,
    2 s per update; sharded (ZeRO-1) each also broadcasts its share of the new weights, 1000
    bytes more: 3 s, and 6000 bytes on the wire per update instead of 4000."""
    from fxpipe.passes.partition import plan_for
    from fxpipe.runtime.pricing.core import stage_costs

    nodes = tuple(ProfileNode(name=f"n{i}", op="call_module", target=f"m{i}", forward_s=1.0,
                              backward_s=1.0, activation_bytes=0.0, parameter_bytes=1000.0,
                              inputs=(f"n{i - 1}",) if i else ()) for i in range(2))
    prof, cl = Profile(nodes=nodes, batch_size=4), Cluster(workers=2, bandwidth=1000.0)
    whole = plan_for(prof, cl, [0], [2], optimizer_state_factor=2.0)
    sharded = plan_for(prof, cl, [0], [2], optimizer_state_factor=2.0, shard="optimizer")
    assert sharded.shard == "optimizer" and whole.shard is None
    (w,), (s,) = stage_costs(whole, prof), stage_costs(sharded, prof)
    assert (w.update_s, w.sync_bytes) == (2.0, 4000.0)
    assert (s.update_s, s.sync_bytes) == (3.0, 6000.0)
