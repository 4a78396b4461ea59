"""Price a plan under a placed kind (interleaved-1f1b, zb-v): ``simulate_placed_plan``.

Apart from :mod:`.plansim` because a process hosts several stages: compute is per process, messages
between its stages are free, remote ones cost bytes / bandwidth + latency, with no port queueing.
"""
from __future__ import annotations

import math

from fxpipe.costmodel.hardware import Cluster
from fxpipe.costmodel.profile import Profile
from fxpipe.errors import ConfigError
from fxpipe.passes.plan import Plan

from ..schedules.placement import (INTERLEAVED, PLACED_KINDS, V_KINDS, ZBV, make_placed_schedule,
                                  timed_placed)
from ..timeline import busy_between
from ..timeline import TimelineEvent
from .core import PlanSimulation, cut_bandwidth, split_backward, stage_costs
from .sim_measure import peak_in_flight, steady_window


def stages_per_process(kind: str, chunks: int = 2) -> int:
    """v: the stages a process hosts under ``kind`` (zb-v, dualpipev: always 2)."""
    if kind not in PLACED_KINDS:
        raise ConfigError(f"{kind!r} is not a placed kind", f"use one of {PLACED_KINDS}")
    if kind in V_KINDS:
        return 2
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise ConfigError(f"chunks={chunks!r}", "use 1 or more stages per process")
    return chunks


def virtual_cluster(cluster: Cluster, v: int) -> Cluster:
    """The cluster the planner splits for when each worker hosts ``v`` stages: v times the
    workers (and per machine), 1/v of the memory each, the same links and device."""
    mem = None if cluster.memory is None else cluster.memory / v
    return Cluster(cluster.workers * v, cluster.bandwidth, cluster.device, mem,
                   cluster.workers_per_machine * v, cluster.intra_bandwidth, cluster.latency)


def simulate_placed_plan(plan: Plan, profile: Profile | None = None, *, schedule: str,
                         minibatches: int = 200, latency_s: float | None = None,
                         microbatches: int | None = None, chunks: int = 2,
                         limit: int | None = None) -> PlanSimulation:
    """Event-simulate ``plan`` under the placed ``schedule`` (docs/design-notes.md). Every stage
    must have the same replicas R (copies of the whole placed pipeline). ``microbatches`` per
    update default to twice the processes (a multiple of the processes, as Megatron's order
    needs); ``minibatches`` is rounded up to whole batches. ``limit``: minibatches admitted per
    process by the greedy orders (default P: 1F1B's activation memory)."""
    v = stages_per_process(schedule, chunks)
    reps = list(plan.replicas)
    if len(set(reps)) > 1:
        raise ConfigError(f"{schedule} with replicas {reps}",
                          "placed kinds replicate the whole pipeline: plan equal replicas per "
                          "stage (e.g. --straight)")
    S, R = len(reps), reps[0]
    if schedule in V_KINDS and S % 2:
        raise ConfigError(f"{schedule} with {S} stages", f"{schedule} needs an even number of "
                          "stages (2 per process): plan for twice the workers")
    P = S // 2 if schedule in V_KINDS else math.ceil(S / v)
    m = microbatches if microbatches is not None else 2 * P * R
    if isinstance(minibatches, bool) or not isinstance(minibatches, int) or minibatches < 1:
        raise ConfigError(f"minibatches must be a positive integer, got {minibatches!r}")
    n = math.ceil(minibatches / m) * m
    cluster = Cluster.from_dict(dict(plan.cluster))
    latency = cluster.latency if latency_s is None else float(latency_s)
    costs = stage_costs(plan, profile)
    fbw = [(c.forward_s, *split_backward(c)) for c in costs]
    bw = cut_bandwidth(cluster)
    wire = [c.input_bytes / bw + latency for c in costs]
    placed = make_placed_schedule(schedule, P, n, num_stages=S, chunks=v, microbatches=m,
                                  replicas=R, costs=fbw, comm=wire, limit=limit)
    times = timed_placed(placed, fbw, wire, [c.update_s for c in costs])
    where = {r: p for p, h in enumerate(placed.hosts) for r in h}
    events: dict[int, list[TimelineEvent]] = {p: [] for p in range(placed.num_processes)}
    by_stage: dict[int, list[TimelineEvent]] = {s: [] for s in range(S)}
    done = [0.0] * n
    cut_bytes = 0.0
    for (p, i), (t0, t1) in sorted(times.items(), key=lambda kv: kv[1]):
        r, a = placed.order[p][i]
        cat = {"F": "forward", "B": "backward", "W": "backward", "U": "allreduce"}[a.kind]
        ev = TimelineEvent(cat, f"{a}@{r[0]}", t0, t1, {"stage": r[0], "replica": r[1]})
        events[p].append(ev)
        if r[1] == 0:
            by_stage[r[0]].append(ev)
        if a.kind != "U":
            done[a.minibatch] = max(done[a.minibatch], t1)
        s, k = r[0], a.minibatch
        if a.kind == "F" and s < S - 1 and where[placed.schedule.owner(s + 1, k)] != p:
            cut_bytes += costs[s + 1].input_bytes
        if a.kind == "B" and s > 0 and where[placed.schedule.owner(s - 1, k)] != p:
            cut_bytes += costs[s].input_bytes
    makespan = max((t1 for _, t1 in times.values()), default=0.0)
    period, lo, hi = steady_window((R,) * S, "1f1b-flush", m, done, makespan)
    updates = math.ceil(n / m)
    return PlanSimulation(
        plan=plan, schedule=schedule, minibatches=n, costs=tuple(costs), makespan=makespan,
        steady_state_period=period,
        utilisation=tuple(busy_between(by_stage[s], lo, hi) for s in range(S)),
        activation_bytes_per_minibatch=cut_bytes / n,
        sync_bytes_per_minibatch=sum(c.sync_bytes for c in costs) * updates / n,
        events={p: tuple(evs) for p, evs in events.items()},
        rank_names={p: f"process {p} (stages {', '.join(str(r[0]) for r in h)}"
                       + (f", copy {h[0][1]})" if R > 1 else ")")
                    for p, h in enumerate(placed.hosts)},
        in_flight=tuple(peak_in_flight(placed.schedule.actions[(s, 0)]) for s in range(S)))


__all__ = ["INTERLEAVED", "ZBV", "stages_per_process", "virtual_cluster", "simulate_placed_plan"]
