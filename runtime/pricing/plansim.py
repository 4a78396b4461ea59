"""Simulate a :class:`~fxpipe.passes.plan.Plan` on a cluster we do not have: ``simulate_plan``.

Discrete events under the planner's cost model with the network as a resource (transfers queue on
ports, updates hold a stage's replicas), seeing what ``max(stage, cut)`` misses: start-up, windows.
"""
from __future__ import annotations

import logging
import math
from typing import Sequence

from fxpipe.costmodel.hardware import Cluster
from fxpipe.costmodel.profile import Profile
from fxpipe.errors import ConfigError, InfeasiblePlanError
from fxpipe.passes.partition import plan_for
from fxpipe.passes.plan import Plan

from ..schedules.kinds import _windows as windows
from ..schedules.kinds import make_schedule
from ..schedules.placement import PLACED_KINDS
from ..schedules.schedule import tie_delay, uneven_tied_updates
from ..schedules.stream import STREAM_KINDS
from ..timeline import busy_between
from .core import (EventLoop, PlanSimulation, StageCosts, TiedSync, cut_bandwidth, split_backward,
                   stage_costs, tied_from_profile)
from .placed_sim import simulate_placed_plan
from .sim_measure import peak_in_flight, steady_state

__all__ = ["PlanSimulation", "StageCosts", "TiedSync", "cut_bandwidth", "data_parallel_plan",
           "minibatches_for", "noam_for", "peak_in_flight", "simulate_plan", "stage_costs",
           "simulate_as_trained", "steady_state", "tied_from_profile", "trainer_window",
           "with_trainer_window", "with_window"]

log = logging.getLogger(__name__)


def minibatches_for(replicas: list[int], floor: int = 200, cap: int = 2000,
                    microbatches: int | None = None) -> int:
    """Enough minibatches to measure a plan's steady state: several whole round-robin rounds
    (8 x lcm(replicas)), at least ``floor``, at most ``cap`` (beyond it the steady state is
    measured as the slope of the running maximum, see ``steady_state``). Too few (e.g. 200 for
    64 replicas: 3 rounds) and start-up dominates the estimate. A batched schedule of
    ``microbatches`` per update gets at least 4 whole batches: its steady state is measured
    over the middle batches, and the second still carries the first's start-up."""
    n = int(min(max(floor, 8 * math.lcm(*replicas)), cap))
    if microbatches is not None and n < 4 * microbatches:
        n = 4 * microbatches
    return n


def simulate_plan(plan: Plan, profile: Profile | None = None, *, schedule: str = "pipedream",
                  minibatches: int = 200, latency_s: float | None = None,
                  duplex: bool = True, noam: int | None = None,
                  tied: Sequence[TiedSync] | None = None,
                  tied_delay: int | None = None,
                  microbatches: int | None = None, chunks: int = 2) -> PlanSimulation:
    """Event-simulate ``plan``'s schedule under the cost model (docs/design-notes.md).

    ``latency_s`` overrides the cluster's per-message latency; ``noam`` the input stage's
    admission window (more minibatches in flight hide longer communication round trips);
    ``microbatches`` the batched kinds' minibatches per update (default: the workers).
    A split backward (zero-bubble kinds) costs half the backward for B and half for W; the
    zero-bubble kinds place their W's by the plan's own stage costs.
    ``tied``: shared parameters (default: found in ``profile``); ``tied_delay``: rounds by which
    their sum lags (default: the runtime's, ``schedule.tie_delay``). The placed kinds
    (``interleaved-1f1b`` with ``chunks`` stages per process, ``zb-v``) put several of the
    plan's stages on one process: :func:`fxpipe.runtime.pricing.placed_sim.simulate_placed_plan`."""
    if schedule in PLACED_KINDS:

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
    counts = uneven_tied_updates(sched, [t.stages for t in tied])
    if counts:
        raise InfeasiblePlanError(
            f"replicas {list(plan.replicas)} cannot train under {schedule}: stages sharing a "
            f"weight update unequally often {counts}", "give the stages sharing it equal "
            "replica counts, or use a flushing schedule")
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


WINDOW_TOLERANCE = 0.02
"""Relative: a wider window is worth its memory and staleness only if it runs more than this
much faster (:func:`noam_for`)."""


def noam_for(plan: Plan, profile: Profile | None = None, *, schedule: str = "pipedream",
             most: int | None = None, tolerance: float = WINDOW_TOLERANCE,
             cap: float | None = None, held: Sequence[float] | None = None,
             beat: float | None = None, microbatches: int | None = None) -> int:
    """The fewest minibatches in flight at the input stage that make ``plan``'s pipeline as
    fast as the widest admissible window (within ``tolerance``), by simulation
    (:func:`simulate_plan`): the window the Trainer admits by default where it has a plan.

    Why not PipeDream's NOAM: ``ceil(workers / input replicas)`` keeps the pipeline full when a
    minibatch's round trip through the later stages (their forwards and backwards, and the
    activations and gradients on the links) takes no longer than the input stage's own work on
    the minibatches admitted meanwhile. On a slow link it takes longer, so the input stage idles
    each time it waits for a gradient, although the link is not the bottleneck: Little's law,
    minibatches in flight = throughput x round-trip time. Each extra one costs a stashed weight
    version on the input stage (memory) and one update of staleness there.

    Admissible: at most ``most`` (default: twice PipeDream's plus 2), a window the kind runs
    (2bw keeps two versions only), and under ``cap`` (bytes a replica may hold; default: the
    plan's cluster memory) every stage's bytes at PipeDream's window (``held``, default the
    schedule's memory rule) plus what the rule adds for the extra minibatches
    (:func:`~fxpipe.runtime.pricing.memory.schedule_memory`) fit. PipeDream's NOAM itself is
    always admitted: the plan was fitted for it. Search: PipeDream's window first (where some
    stage is busy all the time, within ``tolerance``, nothing can go faster), then the widest,
    then bisection between them, since a wider window is never slower (Little's law): a few
    simulations whatever the range. ``beat``: a caller comparing plans by their period gets the
    widest window, without the bisection, where even that is slower than ``beat`` seconds per
    minibatch (such a plan loses whatever its window). ``microbatches``: 2bw's per update."""
    return _window_search(plan, profile, schedule, minibatches_for(list(plan.replicas)),
                          microbatches, most, tolerance, cap, held, beat)[0]


def _window_search(plan: Plan, profile: Profile | None, schedule: str, n: int,
                   microbatches: int | None, most: int | None, tolerance: float,
                   cap: float | None, held: Sequence[float] | None, beat: float | None
                   ) -> tuple[int, dict[int, PlanSimulation]]:
    """:func:`noam_for`'s window and the simulations (``n`` minibatches) it made, by window."""
    from .memory import schedule_memory

    base = max(1, math.ceil(sum(plan.replicas) / plan.replicas[0]))
    cap = plan.cluster.get("memory") if cap is None else cap
    m = microbatches if schedule != "pipedream" else None
    widest = base
    need0: Sequence[float] = ()
    start: Sequence[float] = ()
    for w in range(base, max(most if most is not None else 2 * base + 2, base) + 1):
        if schedule != "pipedream":
            try:  # 2bw keeps two versions only: not every window runs
                make_schedule(schedule, plan.replicas, n, noam=w, microbatches=m)
            except ConfigError:
                break
        if cap is not None:  # each stage's window (pipedream's rule) says what it holds
            need = schedule_memory(plan.stages, schedule, windows(list(plan.replicas), w)[1])
            if w == base:
                need0 = need
                start = tuple(held) if held is not None else need
            if any(h + b - b0 > cap for h, b, b0 in zip(start, need, need0)):
                log.info("noam %d left out: a stage would hold more than the cap, %.4g bytes",
                         w, cap)
                break
        widest = w
    sims: dict[int, PlanSimulation] = {}

    def period(w: int) -> float:
        if w not in sims:
            sims[w] = simulate_plan(plan, profile, schedule=schedule, noam=w, minibatches=n,
                                    microbatches=m)
        return sims[w].steady_state_period

    period(base)
    if widest == base or max(sims[base].utilisation) >= 1 - tolerance:
        return base, sims
    best = period(widest) * (1 + tolerance)
    if beat is not None and period(widest) > beat:
        return widest, sims
    if period(base) <= best:
        return base, sims
    lo, hi = base, widest  # lo too slow, hi fast enough
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if period(mid) <= best else (mid, hi)
    return hi, sims


def trainer_window(plan: Plan, profile: Profile | None, kind: str) -> int | None:
    """The window the Trainer admits at the input stage of ``kind`` by default for ``plan``
    (:func:`noam_for` for the asynchronous kinds; None, the schedule's own, for the rest)."""
    if kind not in STREAM_KINDS or len(plan.replicas) < 2:
        return None
    try:
        return noam_for(plan, profile, schedule=kind)
    except InfeasiblePlanError:  # the kind cannot train this plan (the trainer says why)
        return None


def with_trainer_window(plan: Plan, profile: Profile | None) -> Plan:
    """``plan`` with the window the Trainer admits under pipedream and its staleness table for
    that window (:func:`with_window` of :func:`trainer_window`), so the summary speaks of what
    will run."""
    return with_window(plan, trainer_window(plan, profile, "pipedream"))


def with_window(plan: Plan, window: int | None) -> Plan:
    """``plan`` with ``window`` minibatches in flight at its input stage under pipedream
    (``Plan.window``; None where it is PipeDream's NOAM) and the staleness table
    (``Plan.staleness``) for it."""
    from dataclasses import replace

    from ..schedules.staleness import plan_staleness

    wider = window if window is not None and window != plan.noam else None
    return replace(plan, window=wider, staleness=plan_staleness(plan.replicas, noam=wider))


def simulate_as_trained(plan: Plan, profile: Profile | None, kind: str, *, minibatches: int,
                        microbatches: int | None = None, beat: float | None = None
                        ) -> PlanSimulation:
    """``plan`` simulated under ``kind`` with the window the Trainer admits
    (:func:`trainer_window`), so that what is simulated to choose a plan or a schedule is what
    will run. Where PipeDream's window already keeps a stage busy all the time no wider one is
    tried (it cannot go faster), so a full pipeline costs one simulation. ``beat``: see
    :func:`noam_for` (a plan slower than it at its widest window is simulated there)."""
    if kind not in STREAM_KINDS or len(plan.replicas) < 2:
        return simulate_plan(plan, profile, schedule=kind, minibatches=minibatches,
                             microbatches=microbatches)
    window, sims = _window_search(plan, profile, kind, minibatches, microbatches, None,
                                  WINDOW_TOLERANCE, None, None, beat)
    return sims[window]


def data_parallel_plan(profile: Profile, cluster: Cluster, *, sync: str = "allreduce",
                       workers: int | None = None) -> Plan:
    """BSP data parallelism as a one-stage plan on ``workers`` (default: all) replicas, costed
    with the planner's formulas and the runtime's overheads (:func:`~fxpipe.passes.partition.
    plan_for`), so the simulator times the baseline as it times the plans it is compared with."""
    r = cluster.workers if workers is None else workers
    if not 1 <= r <= cluster.workers:
        raise ConfigError(f"workers={r} outside 1..{cluster.workers}")
    return plan_for(profile, cluster, [0], [r], sync=sync)
