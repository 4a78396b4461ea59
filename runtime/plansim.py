"""Simulate a :class:`~fxpipe.passes.plan.Plan` on a cluster we do not have: ``simulate_plan``.

Why a second simulator next to :mod:`fxpipe.runtime.simulate`: that one times a schedule with
per-cut delays and no contention, which is enough to draw grids. Predicting a plan on a real
cluster needs the network as a *resource*: two transfers on the same link queue behind each
other, and an all-reduce holds every replica of a stage. So this is a discrete-event simulation
(a heap of timed events, resources granted first come first served) of the plan's schedule
(``make_schedule(kind, plan.replicas, minibatches)``) under the planner's cost model:

* compute: a replica runs a whole minibatch; stage s's forward+backward is ``compute_s * r_s``,
  split into forward and backward with the profile's per-node times (1:2 without a profile);
  a stage that recomputes its activations (``StagePlan.recompute``) runs its forward again at
  the start of each backward (``recompute_s * r_s``, before B's half of a split backward);
* cuts: each F sends the cut's bytes (every value live across it, ``input_bytes``) to the next
  stage's owner, each B sends as many gradient bytes back, at the cut bandwidth of
  :func:`~fxpipe.passes.partition.coefficients` plus ``latency`` per message. Links are the
  workers' network ports: a transfer holds the sender's egress and the receiver's ingress
  (``duplex=True``: full-duplex ports, so activations and gradients do not compete; with
  ``duplex=False`` one port per worker carries both directions, which is what the planner's
  ``2 X / B`` cut time assumes);
* sync: an update ``U`` holds every replica of the stage for ``r * beta_r * P`` seconds, so its
  cost amortised over the ``r`` minibatches of a pipedream round is the plan's ``sync_s``;
* tied weights (a parameter shared by several stages, e.g. GPT's embedding and output layer):
  every holder sums its gradients with the others' at each update. When the runtime does so
  synchronously (the flushing kinds, NOAM = 1) the stages' updates form ONE barrier of all
  their replicas, held for the tied all-reduce (ring: ``2 (n - 1) / n`` of the bytes per
  rank); under pipedream the runtime delays the tied sum by ``d`` rounds
  (``schedule.tie_delay``), so update i of a stage waits only for update ``i - d`` of the
  others and the all-reduce runs in the background (its bytes are counted). Pass ``tied`` or a
  profile listing shared parameters to price it; ``tied_delay=0`` prices the lockstep a
  synchronous tied all-reduce would cost;
* sends are asynchronous (the runtime posts them in the background): communication overlaps
  compute unless a rank has to wait for its data, which is exactly what the planner's
  ``max(stage times, cut times)`` cannot see (1F1B start-up, a window too small to hide a
  round trip, a link shared by two cuts).

Pure Python; no torch. The timeline uses :mod:`fxpipe.runtime.timeline`'s events and trace
writer, so predicted and measured traces open side by side in ui.perfetto.dev.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from fxpipe.costmodel.hardware import Cluster
from fxpipe.costmodel.profile import Profile
from fxpipe.errors import ConfigError
from fxpipe.passes.partition import coefficients
from fxpipe.passes.plan import Plan, StagePlan
from fxpipe.units import format_bytes, format_seconds

from .placement import PLACED_KINDS
from .plansim_events import EventLoop, StageCosts, TiedSync, split_backward
from .schedule import make_schedule, tie_delay
from .sim_measure import busy_between, peak_in_flight, steady_state
from .timeline import TimelineEvent, to_chrome_trace, write_chrome_trace

__all__ = ["PlanSimulation", "StageCosts", "TiedSync", "cut_bandwidth", "data_parallel_plan",
           "minibatches_for", "peak_in_flight", "simulate_plan", "stage_costs", "steady_state",
           "tied_from_profile"]

log = logging.getLogger(__name__)

DEFAULT_FORWARD_FRACTION = 1.0 / 3.0  # backward ~ 2x forward when no profile says otherwise


def tied_from_profile(plan: Plan, profile: Profile) -> list[TiedSync]:
    """The plan's tied parameters: a parameter a node of one stage owns and a node of another
    stage lists in ``shared_params``. Its bytes are the owner node's ``parameter_bytes`` split
    evenly among the parameters that node owns (exact for an embedding owning one weight)."""
    stage_of = {n: sp.index for sp in plan.stages for n in sp.nodes}
    owner: dict[str, tuple[int, float]] = {}
    users: dict[str, set[int]] = {}
    for node in profile.nodes:
        s = stage_of.get(node.name)
        if s is None:
            continue
        for p in node.params:
            owner[p] = (s, node.parameter_bytes / max(len(node.params), 1))
            users.setdefault(p, set()).add(s)
        for p in node.shared_params:
            users.setdefault(p, set()).add(s)
    by_set: dict[tuple[int, ...], float] = {}
    for p, stages in users.items():
        if len(stages) > 1 and p in owner:
            key = tuple(sorted(stages))
            by_set[key] = by_set.get(key, 0.0) + owner[p][1]
    return [TiedSync(k, v) for k, v in sorted(by_set.items())]


@dataclass(frozen=True)
class PlanSimulation:
    """Result of :func:`simulate_plan`. Times are seconds; ``steady_state_period`` is seconds per
    minibatch once the pipeline is full (start-up and drain excluded)."""

    plan: Plan
    schedule: str
    minibatches: int
    costs: tuple[StageCosts, ...]
    makespan: float
    steady_state_period: float
    utilisation: tuple[float, ...]           # per stage: F+B time / steady window, replica mean
    activation_bytes_per_minibatch: float    # activations forward + gradients back, all cuts
    sync_bytes_per_minibatch: float          # weight synchronisation of replicated stages
    events: Mapping[int, tuple[TimelineEvent, ...]] = field(hash=False)
    rank_names: Mapping[int, str] = field(hash=False)
    # per stage: most minibatches whose activations a replica holds at once (F until B, or
    # until W when the backward is split): the schedule's activation memory, in minibatches
    in_flight: tuple[int, ...] = ()

    @property
    def activation_memory(self) -> tuple[float, ...]:
        """Bytes of activations a replica of each stage holds at its peak (the plan's
        per-minibatch activation bytes times :attr:`in_flight`; a recomputing stage holds its
        input bytes per minibatch in flight and one minibatch's activations)."""
        return tuple(sp.input_bytes * v + sp.activation_bytes if sp.recompute
                     else sp.activation_bytes * v
                     for sp, v in zip(self.plan.stages, self.in_flight))

    @property
    def bytes_per_minibatch(self) -> float:
        return self.activation_bytes_per_minibatch + self.sync_bytes_per_minibatch

    @property
    def bytes_per_sample(self) -> float | None:
        bs = self.plan.batch_size
        return self.bytes_per_minibatch / bs if bs else None

    @property
    def throughput(self) -> float:
        """Samples/s when the plan knows its batch size, else minibatches/s (see throughput_unit)."""
        if self.steady_state_period <= 0:
            return math.inf
        return (self.plan.batch_size or 1) / self.steady_state_period

    @property
    def throughput_unit(self) -> str:
        return "samples/s" if self.plan.batch_size else "minibatches/s"

    @property
    def relative_error(self) -> float:
        """(simulated - planned) / planned time per minibatch."""
        p = self.plan.time_per_minibatch
        return (self.steady_state_period - p) / p if p > 0 else 0.0

    def to_chrome_trace(self) -> dict[str, Any]:
        return to_chrome_trace(self.events, self.rank_names)

    def write_trace(self, path: str | Path) -> Path:
        """Chrome/Perfetto JSON, same format as the runtime's measured trace."""
        return write_chrome_trace(self.events, path, self.rank_names)

    def summary(self) -> str:
        lines = [f"simulated {self.minibatches} minibatches, {self.schedule} schedule, "
                 f"replicas {self.plan.replicas} ({self.plan.sync} sync)"]
        for s, (c, u) in enumerate(zip(self.costs, self.utilisation)):
            lines.append(f"  stage {s}: x{self.plan.stages[s].replicas} fwd "
                         f"{format_seconds(c.forward_s)} bwd {format_seconds(c.backward_s)} "
                         + (f"(recompute {format_seconds(c.recompute_s)}) " if c.recompute_s
                            else "") +
                         f"update {format_seconds(c.update_s)} in {format_bytes(c.input_bytes)}"
                         f"  utilisation {u:.0%}"
                         + (f"  activations {self.in_flight[s]} x "
                            f"{format_bytes(self.plan.stages[s].activation_bytes)}"
                            if self.in_flight else ""))
        lines.append(f"steady state: {format_seconds(self.steady_state_period)} per minibatch "
                     f"(plan predicts {format_seconds(self.plan.time_per_minibatch)}, "
                     f"{self.relative_error:+.1%}); {self.throughput:.2f} {self.throughput_unit}")
        lines.append(f"bytes on the wire per minibatch: {format_bytes(self.bytes_per_minibatch)} "
                     f"(cuts {format_bytes(self.activation_bytes_per_minibatch)}, sync "
                     f"{format_bytes(self.sync_bytes_per_minibatch)})")
        lines.append(f"makespan {format_seconds(self.makespan)}")
        return "\n".join(lines)


def stage_costs(plan: Plan, profile: Profile | None = None) -> list[StageCosts]:
    """Per-stage simulation costs from the plan (and the profile's forward/backward split)."""
    cluster = Cluster.from_dict(dict(plan.cluster))
    _, beta, _ = coefficients(cluster, plan.sync)
    by_name = {n.name: n for n in profile.nodes} if profile is not None else {}
    out = []
    for sp in plan.stages:
        r = sp.replicas
        extra = sp.recompute_s * r if sp.recompute else 0.0  # the repeated forward
        total = sp.compute_s * r - extra  # the plan divides a stage's compute among its replicas
        frac = DEFAULT_FORWARD_FRACTION
        if by_name:
            missing = [n for n in sp.nodes if n not in by_name]
            if missing:
                raise ConfigError(f"the profile has no node {missing[0]!r} of stage {sp.index}",
                                  "pass the profile the plan was made from")
            f = sum(by_name[n].forward_s for n in sp.nodes)
            b = sum(by_name[n].backward_s for n in sp.nodes)
            if f + b > 0:
                frac = f / (f + b)
        out.append(StageCosts(forward_s=total * frac, backward_s=total * (1.0 - frac) + extra,
                              update_s=r * beta[r - 1] * sp.parameter_bytes if r > 1 else 0.0,
                              parameter_bytes=sp.parameter_bytes, input_bytes=sp.input_bytes,
                              sync_bytes=2.0 * (r - 1) * sp.parameter_bytes, recompute_s=extra))
    return out


def minibatches_for(replicas: list[int], floor: int = 200, cap: int = 2000) -> int:
    """Enough minibatches to measure a plan's steady state: several whole round-robin rounds
    (8 x lcm(replicas)), at least ``floor``, at most ``cap`` (beyond it the steady state is
    measured as the slope of the running maximum, see ``steady_state``). Too few (e.g. 200 for
    64 replicas: 3 rounds) and start-up dominates the estimate."""
    return int(min(max(floor, 8 * math.lcm(*replicas)), cap))


def cut_bandwidth(cluster: Cluster) -> float:
    """Bytes/s of a cut transfer: the planner's choice (inter-machine unless one machine)."""
    return cluster.intra_bandwidth if cluster.machines == 1 else cluster.bandwidth


def simulate_plan(plan: Plan, profile: Profile | None = None, *, schedule: str = "pipedream",
                  minibatches: int = 200, latency_s: float | None = None,
                  duplex: bool = True, noam: int | None = None,
                  tied: Sequence[TiedSync] | None = None,
                  tied_delay: int | None = None,
                  microbatches: int | None = None, chunks: int = 2) -> PlanSimulation:
    """Event-simulate ``plan``'s schedule under the cost model (see the module doc).

    ``latency_s`` overrides the cluster's per-message latency; ``noam`` the input stage's
    admission window (more minibatches in flight hide longer communication round trips);
    ``microbatches`` the batched kinds' minibatches per update (default: the workers).
    A split backward (zero-bubble kinds) costs half the backward for B and half for W; the
    zero-bubble kinds place their W's by the plan's own stage costs.
    ``tied``: shared parameters (default: found in ``profile``); ``tied_delay``: rounds by which
    their sum lags (default: the runtime's, ``schedule.tie_delay``). The placed kinds
    (``interleaved-1f1b`` with ``chunks`` stages per process, ``zb-v``) put several of the
    plan's stages on one process: :func:`fxpipe.runtime.placed_sim.simulate_placed_plan`."""
    if schedule in PLACED_KINDS:
        from .placed_sim import simulate_placed_plan

        return simulate_placed_plan(plan, profile, schedule=schedule, minibatches=minibatches,
                                    latency_s=latency_s, microbatches=microbatches,
                                    chunks=chunks)
    if isinstance(minibatches, bool) or not isinstance(minibatches, int) or minibatches < 1:
        raise ConfigError(f"minibatches must be a positive integer, got {minibatches!r}")
    cluster = Cluster.from_dict(dict(plan.cluster))
    latency = cluster.latency if latency_s is None else float(latency_s)
    if not (latency >= 0 and math.isfinite(latency)):
        raise ConfigError(f"latency_s must be a non-negative number, got {latency_s!r}")
    costs = stage_costs(plan, profile)
    fbw = [(c.forward_s, *split_backward(c)) for c in costs]
    bandwidth = cut_bandwidth(cluster)
    wire = [c.input_bytes / bandwidth + latency for c in costs]
    sched = make_schedule(schedule, plan.replicas, minibatches, noam=noam,
                          microbatches=microbatches if schedule != "pipedream" else None,
                          costs=fbw, comm=wire)
    if tied is None:
        tied = tied_from_profile(plan, profile) if profile is not None else []
    delay = tie_delay(sched, [t.stages for t in tied]) if tied_delay is None else tied_delay
    sim = EventLoop(sched, costs, bandwidth, latency, duplex, tied, delay)
    sim.run()
    period, lo, hi = steady_state(sched, sim.done, sim.makespan)
    util = []
    for s, r in enumerate(sched.replicas):
        fr = [busy_between(sim.events[sim.gid[(s, j)]], lo, hi) for j in range(r)]
        util.append(sum(fr) / r)
    n = minibatches
    log.info("simulated replicas %s: %.4g s/minibatch (plan %.4g s)", plan.replicas, period,
             plan.time_per_minibatch)
    return PlanSimulation(
        plan=plan, schedule=sched.kind, minibatches=n, costs=tuple(costs),
        in_flight=tuple(max(peak_in_flight(sched.actions[(s, j)]) for j in range(r))
                        for s, r in enumerate(sched.replicas)),
        makespan=sim.makespan, steady_state_period=period, utilisation=tuple(util),
        activation_bytes_per_minibatch=sim.cut_bytes / n, sync_bytes_per_minibatch=sim.sync_bytes / n,
        events={g: tuple(sorted(evs, key=lambda e: (e.start, e.end))) for g, evs in sim.events.items()},
        rank_names={g: f"stage {s} replica {j}" for (s, j), g in sim.gid.items()})


def data_parallel_plan(profile: Profile, cluster: Cluster, *, sync: str = "allreduce",
                       workers: int | None = None) -> Plan:
    """BSP data parallelism as a one-stage plan on ``workers`` (default: all) replicas, costed
    with the planner's formulas, so the simulator can time the baseline the same way."""
    r = cluster.workers if workers is None else workers
    if not 1 <= r <= cluster.workers:
        raise ConfigError(f"workers={r} outside 1..{cluster.workers}")
    alpha, beta, _ = coefficients(cluster, sync)
    c, p = profile.total_compute_s, profile.total_parameter_bytes
    a = sum(n.activation_bytes for n in profile.nodes)
    compute, sync_s = alpha[r - 1] * c, beta[r - 1] * p
    st = StagePlan(index=0, nodes=tuple(profile.names), replicas=r, compute_s=compute,
                   sync_s=sync_s, stage_time_s=compute + sync_s, input_bytes=0.0, comm_s=0.0,
                   parameter_bytes=p, activation_bytes=a, memory_bytes=3 * p + a, in_flight=1)
    return Plan(stages=(st,), cluster=dict(cluster.to_dict()), sync=sync,
                time_per_minibatch=compute + sync_s, noam=1, data_parallel_time=compute + sync_s,
                batch_size=profile.batch_size, profile_source=profile.source, workers_used=r)
