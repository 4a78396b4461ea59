"""Choose a plan by event-simulating the planner's candidates: ``choose_by_simulation``.

The analytic bottleneck misses the start-up, small windows and replicas waiting at updates, so the
candidates are simulated and the fastest steady state wins (ties: fewer stages).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

import numpy as np

from fxpipe.costmodel.hardware import Cluster
from fxpipe.costmodel.profile import Profile
from fxpipe.errors import ConfigError, InfeasiblePlanError
from fxpipe.passes.cuts import cut_bytes
from fxpipe.passes.memory_rule import PIPEDREAM, MemoryRule
from fxpipe.passes.partition import partition, plan_for
from fxpipe.passes.plan import Plan

from ..schedules.placement import PLACED_KINDS
from .plansim import (PlanSimulation, data_parallel_plan, minibatches_for, simulate_plan,
                      simulate_as_trained, tied_from_profile)

log = logging.getLogger(__name__)

TIE = 1e-9  # relative: simulated times this close are ties, won by fewer stages


@dataclass(frozen=True)
class Candidate:
    """One proposed plan under one schedule: its replicas, the planner's and the simulator's
    time per minibatch."""

    replicas: tuple[int, ...]
    planner_s: float
    simulated_s: float
    schedule: str = "pipedream"


@dataclass(frozen=True)
class SimulatedChoice:
    """The chosen plan, its simulation, and every candidate (in proposal order)."""

    plan: Plan
    simulation: PlanSimulation
    candidates: tuple[Candidate, ...]
    schedule: str = "pipedream"  # the schedule the chosen plan was simulated with

    @property
    def planner_plan(self) -> Candidate:
        """The planner's own optimum (the candidate with the smallest planner time)."""
        return min(self.candidates, key=lambda c: c.planner_s)

    def summary(self) -> str:
        lines = ["candidates (the planner's optima, copies of a straight pipeline and local "
                 "moves from the fastest, simulated):"]
        for c in self.candidates:
            mark = (" <- chosen" if c.replicas == tuple(self.plan.replicas)
                    and c.schedule == self.schedule
                    and c.simulated_s == self.simulation.steady_state_period else "")
            lines.append(f"  {'-'.join(map(str, c.replicas)):>24}  {c.schedule:<16} planner "
                         f"{c.planner_s * 1e3:9.3f} ms  simulated {c.simulated_s * 1e3:9.3f} ms"
                         f"{mark}")
        return "\n".join(lines)


def choose_by_simulation(profile: Profile, cluster: Cluster, *, sync: str = "allreduce",
                         stages: int | None = None, straight: bool = False,
                         optimizer_state_factor: float = 1.0, max_stages: int = 8,
                         exact_up_to: int = 16, minibatches: int = 200,
                         schedules: Sequence[str] = ("pipedream",),
                         recompute: str = "never", memory_rule: MemoryRule = PIPEDREAM,
                         microbatches: int | None = None, shard: str = "never",
                         sharded_state: float | None = None,
                         keep: Callable[[Plan], bool] | None = None) -> SimulatedChoice:
    """The planner's candidates (see docs/design-notes.md; only the ``stages``-stage optimum when
    ``stages`` is given), each simulated with each of ``schedules`` (e.g. the synchronous
    ``1f1b-flush`` and zero-bubble ``zb-h1``/``zb-h2`` next to ``pipedream``: the best plan
    depends on the schedule's bubble) for at least ``minibatches`` (more for many replicas:
    ``plansim.minibatches_for``); returns the fastest (plan, schedule) in steady state.
    ``memory_rule``: the memory every candidate is fitted with (default PipeDream's; e.g.
    ``memory.memory_rule("1f1b-flush")`` when only that schedule will run); ``microbatches``:
    per update, for the batched kinds (default the workers); ``shard``, ``sharded_state``: as
    :func:`fxpipe.passes.partition.partition` takes them, for every candidate. ``keep``: the
    candidates that may be chosen (e.g. those whose walked peaks fit the cap); the others are
    not simulated, and :class:`InfeasiblePlanError` is raised when it keeps none."""
    if not schedules:
        raise ConfigError("schedules is empty", "give at least one schedule kind to simulate")
    for name, v in (("max_stages", max_stages), ("exact_up_to", exact_up_to),
                    ("minibatches", minibatches)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(f"{name} must be a positive integer, got {v!r}")
    kw: dict[str, Any] = dict(sync=sync, optimizer_state_factor=optimizer_state_factor,
                              memory_rule=memory_rule, shard=shard, sharded_state=sharded_state)
    best = partition(profile, cluster, stages=stages, straight=straight,  # raises if none
                     recompute=recompute, **kw)
    plans = [best]
    if stages is None:
        if not straight:
            plans += _merge_chain(profile, cluster, best, kw, recompute)
        if cluster.workers <= exact_up_to:
            for s in range(1, min(max_stages, cluster.workers) + 1):
                try:
                    plans.append(partition(profile, cluster, stages=s, straight=straight,
                                           recompute=recompute, diagnose=False, **kw))
                except InfeasiblePlanError:  # more stages than cut points, or memory
                    continue
        alone = plan_for(profile, cluster, [0], [1], **kw)  # fewer workers may be faster
        if cluster.memory is None or alone.stages[0].memory_bytes <= cluster.memory:
            plans.append(alone)
    if not straight:
        plans += _copies(profile, cluster, stages, max_stages, kw, recompute)
    seen: set[tuple] = set()
    sims: list[tuple[Plan, str, PlanSimulation]] = []
    one_per_process = [k for k in schedules if k not in PLACED_KINDS]
    refused = 0
    for p in plans:
        key = (tuple(_starts(profile, p)), tuple(p.replicas))
        if key not in seen:
            seen.add(key)
            if keep is not None and not keep(p):
                refused += 1
                continue
            for k in one_per_process:
                n = minibatches_for(p.replicas, floor=minibatches,
                                    microbatches=_per_update(k, microbatches, p.replicas))
                try:
                    sims.append((p, k, simulate_as_trained(  # the window the Trainer admits
                        p, profile, k, minibatches=n,
                        microbatches=microbatches if k not in ("pipedream",) else None,
                        beat=min((c[2].steady_state_period for c in sims), default=None))))
                except InfeasiblePlanError as err:  # tied stages updating unequally often
                    log.info("candidate %s left out: %s", p.replicas, err)
    for k in schedules:
        if k in PLACED_KINDS:
            sims.extend(_placed_candidates(profile, cluster, k, stages, kw, recompute,
                                           minibatches, microbatches))
    if not sims and refused:
        raise InfeasiblePlanError(f"keep refused all {refused} candidates (e.g. their walked "
                                  "peaks are over the memory cap)", "plan for a lower cap")
    if not sims:
        raise InfeasiblePlanError(f"no plan for the schedules {list(schedules)}",
                                  "the placed kinds need a straight plan of v x workers stages, "
                                  "pipedream equal replica counts on stages sharing a weight; "
                                  "add a kind such as 1f1b-flush")
    fastest = min(s.steady_state_period for _, _, s in sims)
    order = {k: i for i, k in enumerate(schedules)}  # ties: fewer stages, then schedule order
    plan, kind, sim = min((c for c in sims if c[2].steady_state_period <= fastest * (1 + TIE)),
                          key=lambda c: (len(c[0].stages), order[c[1]], c[2].steady_state_period))
    if len(plan.stages) > 1:
        placed = kind in PLACED_KINDS  # equal replicas, split for the virtual cluster
        for better in _refined(profile, Cluster.from_dict(dict(plan.cluster)) if placed
                               else cluster, plan, kind, sim, kw, recompute,
                               straight or placed, microbatches, minibatches, keep):
            sims.append(better)
            plan, kind, sim = better
    cands = tuple(Candidate(tuple(p.replicas), p.time_per_minibatch, s.steady_state_period, k)
                  for p, k, s in sims)
    first = next((f"{c[2].steady_state_period:.4g} s simulated" for c in sims if c[0] is best),
                 "not kept")
    log.info("chose replicas %s with %s by simulation (%.4g s/minibatch; the planner's optimum "
             "%s: %s)", plan.replicas, kind, sim.steady_state_period, best.replicas, first)
    return SimulatedChoice(plan, sim, cands, kind)


def _placed_candidates(profile: Profile, cluster: Cluster, kind: str, stages: int | None,
                       kw: dict, recompute: str, minibatches: int,
                       microbatches: int | None = None
                       ) -> list[tuple[Plan, str, PlanSimulation]]:
    """A placed kind's candidate: the planner's straight plan of v x P stages on the virtual
    cluster of v x workers (P: ``stages``, else every worker), in W / P copies where P divides
    the W workers, simulated on P processes per copy with ``microbatches`` per update; none
    when the model has too few cut points or it does not fit in memory."""
    from .placed_sim import stages_per_process, virtual_cluster

    v = stages_per_process(kind)
    P = stages or cluster.workers
    virtual = virtual_cluster(cluster, v)
    try:
        p = partition(profile, virtual, straight=True, stages=v * P, recompute=recompute, **kw)
    except (InfeasiblePlanError, ConfigError) as err:
        log.info("no %s candidate: %s", kind, err)
        return []
    if cluster.workers % P == 0 and cluster.workers > P:
        copies = _fitted(profile, virtual, _starts(profile, p), [cluster.workers // P] * (v * P),
                         kw, recompute, virtual.memory)
        p = copies if copies is not None else p
    return [(p, kind, simulate_plan(p, profile, schedule=kind, minibatches=minibatches,
                                    microbatches=microbatches))]


def _copies(profile: Profile, cluster: Cluster, stages: int | None, max_stages: int, kw: dict,
            recompute: str) -> list[Plan]:
    """Copies of a straight pipeline: for each stage count S dividing the workers (``stages``
    only, when given; up to ``max_stages``), the planner's straight S-stage optimum with every
    stage on W / S workers, the layout pipeline and data parallelism compose to. The analytic
    objective prices a replicated stage by PipeDream's rule, which under a flushing schedule
    can rank unequal replica counts above it where the simulation does not."""
    W = cluster.workers
    out = []
    for S in ([stages] if stages is not None else range(2, min(max_stages, W) + 1)):
        if S < 2 or W % S or S == W:
            continue
        try:
            line = partition(profile, cluster, stages=S, straight=True, recompute=recompute,
                             diagnose=False, **kw)
        except InfeasiblePlanError:
            continue
        p = _fitted(profile, cluster, _starts(profile, line), [W // S] * S, kw, recompute,
                    cluster.memory)
        if p is not None:
            out.append(p)
    return out


REFINE_ROUNDS = 4  # local moves tried from the chosen candidate, each round the best one


def _refined(profile: Profile, cluster: Cluster, plan: Plan, kind: str, sim: PlanSimulation,
             kw: dict, recompute: str, straight: bool, microbatches: int | None,
             minibatches: int, keep: Callable[[Plan], bool] | None = None
             ) -> list[tuple[Plan, str, PlanSimulation]]:
    """Local moves from the chosen ``plan``, each simulated under ``kind``: a worker moved
    between adjacent stages (unless ``straight``), and a cut moved to the nearest valley of
    the bytes crossing on either side (where a block ends its bytes fall to one tensor: a cut
    inside it often carries two). The analytic objective prices neither a flushing
    schedule's all-reduce at the batch's end nor the link shared by a stage's replicas, so the
    simulation arbitrates. Each round simulates every move on a short run and keeps the
    fastest if its full run is faster; returns the plans kept, in order (none when no move
    helps; the fastest move ``keep`` keeps is tried, ``keep`` asked fastest first)."""
    cb = cut_bytes(profile)
    cap = cluster.memory
    kept: list[tuple[Plan, str, PlanSimulation]] = []
    best, best_t = plan, sim.steady_state_period
    seen = {(tuple(_starts(profile, plan)), tuple(plan.replicas))}
    m = microbatches if kind != "pipedream" else None

    def run(p: Plan, floor: int) -> PlanSimulation:
        return simulate_as_trained(p, profile, kind, microbatches=m, minibatches=minibatches_for(
            p.replicas, floor=floor, microbatches=_per_update(kind, m, p.replicas)))

    for _ in range(REFINE_ROUNDS):
        starts, reps = _starts(profile, best), list(best.replicas)
        moves = []
        for i in range(len(reps) - 1):
            if not straight:
                for d in (-1, 1):
                    r2 = reps[:i] + [reps[i] + d, reps[i + 1] - d] + reps[i + 2:]
                    if min(r2) >= 1:
                        moves.append((starts, r2))
            lo = starts[i] + 1
            hi = starts[i + 2] - 1 if i + 2 < len(starts) else len(profile.nodes) - 1
            for step in (-1, 1):
                p = _valley(cb, starts[i + 1], step, lo, hi)
                if p is not None:
                    moves.append((starts[:i + 1] + [p] + starts[i + 2:], reps))
        trials = []
        for s2, r2 in moves:
            if (tuple(s2), tuple(r2)) in seen:
                continue
            seen.add((tuple(s2), tuple(r2)))
            p2 = _fitted(profile, cluster, s2, r2, kw, recompute, cap)
            if p2 is None:
                continue
            try:  # screened on a short run: a few batches or rounds past the start-up
                s = run(p2, 8 * len(r2))
            except InfeasiblePlanError:  # tied stages updating unequally often
                continue
            trials.append((s.steady_state_period, p2))
        trials.sort(key=lambda x: x[0])  # the fastest move that ``keep`` keeps (asked in order)
        p2 = next((p for _, p in trials if keep is None or keep(p)), None)
        if p2 is None:
            break
        s = run(p2, minibatches)
        if s.steady_state_period >= best_t * (1 - TIE):
            break
        best, best_t = p2, s.steady_state_period
        kept.append((p2, kind, s))
    return kept


def _valley(cb: np.ndarray, p: int, step: int, lo: int, hi: int) -> int | None:
    """The nearest cut position from ``p`` in direction ``step`` (within ``lo..hi``) at the
    bottom of a valley of the bytes crossing (``cb[q - 1]`` at position q): past the rise or
    plateau next to ``p``, down the next descent. None when the range ends first."""
    q = p + step
    while lo <= q <= hi and cb[q - 1] >= cb[q - 1 - step]:
        q += step
    if not lo <= q <= hi:
        return None
    while lo <= q + step <= hi and cb[q + step - 1] <= cb[q - 1]:
        q += step
    return q


def _fitted(profile: Profile, cluster: Cluster, starts: list[int], reps: list[int], kw: dict,
            recompute: str, cap: float | None) -> Plan | None:
    """:func:`_with_recompute` of a move; None when it does not fit or a stage would compute
    nothing (a view or a flatten alone)."""
    p = _with_recompute(profile, cluster, starts, reps, kw, recompute, cap)
    if cap is not None and any(sp.memory_bytes > cap for sp in p.stages):
        return None
    if any(sp.compute_s <= 0 for sp in p.stages):  # a worker that only relays
        return None
    return p


def _with_recompute(profile: Profile, cluster: Cluster, starts: list[int], reps: list[int],
                    kw: dict, recompute: str, cap: float | None) -> Plan:
    """``plan_for`` of a partition, recomputing as ``recompute`` allows: every stage under
    "always", exactly the stages over ``cap`` without it under "auto"."""
    flags = [True] * len(reps) if recompute == "always" else None
    p = plan_for(profile, cluster, starts, reps, **kw, recompute=flags)
    if recompute == "auto" and cap is not None and any(sp.memory_bytes > cap for sp in p.stages):
        p = plan_for(profile, cluster, starts, reps, **kw,
                     recompute=[sp.memory_bytes > cap for sp in p.stages])
    return p


def _per_update(kind: str, microbatches: int | None, replicas: Sequence[int]) -> int | None:
    """Minibatches per update under ``kind`` (None for pipedream, which updates after each;
    a batched kind's default is the workers, as ``make_schedule``'s)."""
    return None if kind == "pipedream" else microbatches or sum(replicas)


def _starts(profile: Profile, plan: Plan) -> list[int]:
    index = {n: i for i, n in enumerate(profile.names)}
    return [index[sp.nodes[0]] for sp in plan.stages]


def _merge_chain(profile: Profile, cluster: Cluster, plan: Plan, kw: dict,
                 recompute: str = "never") -> list[Plan]:
    """From ``plan``, repeatedly merge the adjacent pair of stages (replicas summed) whose merged
    plan the planner rates fastest, down to one stage. Merges that do not fit in memory are
    skipped; the chain stops when none fits. (Dropping a boundary of a valid plan keeps the
    others valid and the worker count, so ``plan_for`` accepts every merge.) ``recompute``:
    "always" recomputes every merged stage, "auto" exactly the stages over the cap without."""
    out: list[Plan] = []
    cap = cluster.memory
    starts, reps = _starts(profile, plan), list(plan.replicas)
    while len(starts) > 1:
        options = []
        for i in range(len(starts) - 1):
            s2 = starts[:i + 1] + starts[i + 2:]
            r2 = reps[:i] + [reps[i] + reps[i + 1]] + reps[i + 2:]
            p = _with_recompute(profile, cluster, s2, r2, kw, recompute, cap)
            if cap is None or all(sp.memory_bytes <= cap for sp in p.stages):
                options.append((p.time_per_minibatch, i, p, s2))
        if not options:
            break
        _, _, nxt, starts = min(options, key=lambda o: o[:2])  # ties: the leftmost merge
        out.append(nxt)
        reps = list(nxt.replicas)
    return out


def priced_by_simulation(choice: SimulatedChoice, profile: Profile, cluster: Cluster, *,
                         sync: str = "allreduce", microbatches: int | None = None) -> Plan:
    """The chosen plan with its time, its data parallelism's and one worker's as simulated under
    the chosen schedule (``time_source``), so ``plan.summary()`` and its speedups speak of the
    schedule that will run: bubble and start-up included, the baselines timed the same way."""
    kind = choice.schedule
    if kind in PLACED_KINDS:  # several stages per process: the plan's own figures stand
        return choice.plan
    m = None if kind == "pipedream" else microbatches
    base = []
    for workers in (cluster.workers, 1):  # data parallelism on every worker, and one worker
        p = data_parallel_plan(profile, cluster, sync=sync, workers=workers)
        base.append(simulate_plan(p, profile, schedule=kind, microbatches=m,
                                  minibatches=minibatches_for(
                                      p.replicas, microbatches=_per_update(kind, m, p.replicas))
                                  ).steady_state_period)
    return replace(choice.plan, time_per_minibatch=choice.simulation.steady_state_period,
                   data_parallel_time=base[0], one_worker_time=base[1],
                   time_source=f"simulated {kind}")


def splits_tied(plan: Plan, profile: Profile) -> bool:
    """Whether ``plan`` puts a parameter shared by several nodes on more than one stage."""
    return len(plan.replicas) > 1 and bool(tied_from_profile(plan, profile))


# How much slower than its analytic time a pipedream optimum may simulate before ``auto`` picks
# by simulation instead: the planner's noise is a few percent (BENCHMARKS simulator-validation).
SIMULATED_TOLERANCE = 0.05


def unpriced_by_planner(plan: Plan, profile: Profile) -> str | None:
    """Why the planner's pipedream optimum ``plan`` is not priced by its objective (then
    ``choose="auto"`` simulates its candidates instead), or None where it is.

    The analytic bottleneck leaves out what the event simulation of the schedule sees: a
    shared parameter on two stages (its gradient sum crosses the link every update), round
    trips longer than PipeDream's window hides, replicas of a stage waiting for each other. So
    the optimum is simulated under pipedream, and a plan more than 5% slower there than planned
    is not taken on the planner's word. It is simulated with the window the Trainer admits
    (:func:`~fxpipe.runtime.pricing.plansim.simulate_as_trained`): the cluster benchmark's VGG
    on 2 hosts at 50 Mbit/s, planned at 41.9 ms per minibatch, simulated at 50.1 ms with
    PipeDream's NOAM of 2 (the round trip; one worker 49.8 ms), measured there at 0.99x one
    process, is 37.5 ms with the 3 minibatches in flight the Trainer now admits
    (``benchmarks/pipeline-cluster.md``). A case the window does not rescue: the mini VGG16 on
    8 V100s at 10 Gbps, planned 3-3-1-1 at 193 us, simulated at 270 us whatever the window,
    where the simulation picks 6-1-1 at 214 us with 3 in flight (7-1 at 224 us, PipeDream's
    own choice for VGG16 there, with PipeDream's window; docs/planning.md)."""
    if len(plan.replicas) < 2:
        return None
    if splits_tied(plan, profile):
        return "it puts a shared parameter on two stages"
    try:
        period = simulate_as_trained(plan, profile, "pipedream", minibatches=minibatches_for(
            list(plan.replicas))).steady_state_period
    except (ConfigError, InfeasiblePlanError) as err:  # nothing to hold the planner to
        log.debug("the planner's optimum does not simulate under pipedream: %s", err)
        return None
    if period > plan.time_per_minibatch * (1 + SIMULATED_TOLERANCE):
        return (f"it simulates at {period * 1e3:.4g} ms per minibatch under pipedream, planned "
                f"{plan.time_per_minibatch * 1e3:.4g} ms (round trips longer than PipeDream's "
                f"window, replicas waiting for each other: what the bottleneck leaves out)")
    return None
