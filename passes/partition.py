"""``partition(profile, cluster)``: the passes phase's entry point, from a Profile to a Plan.

Builds the cost model's per-r coefficients, runs the exact solver, prices the overheads, and holds
all validation users can trigger, so errors speak of the model and the cluster, not of arrays.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from fxpipe.costmodel.hardware import Cluster
from fxpipe.costmodel.profile import Profile
from fxpipe.errors import ConfigError, InfeasiblePlanError
from fxpipe.units import format_bytes

from .copies import Shared
from .cuts import all_crossing_values, cut_bytes
from .memory_rule import PIPEDREAM, MemoryRule
from .overhead_pricing import stage_overheads
from .plan import Plan, StagePlan
from .feasibility import replica_state
from .made_here import per_graph
from .solver import RECOMPUTE_MODES, Solution, evaluate, minimum_memory, solve

log = logging.getLogger(__name__)

SYNC_MODELS = ("allreduce", "parameter-server")
SHARD_MODES = ("never", "optimizer", "auto")
# A sharded replica group (torch's ZeroRedundancyOptimizer) all-reduces the gradients as before
# (2 (r-1)/r P per replica on a ring) and then broadcasts each replica's share of the new
# weights to the others ((r-1)/r P more): 1.5 times the unsharded sync.
SHARD_SYNC = 1.5
# Plans within this relative distance of the optimum are ties (won by fewer stages, i.e. data
# parallelism first): profiles are measured to ~1e-3, not to the last bit.
TIE_TOLERANCE = 1e-9


def coefficients(cluster: Cluster, sync: str, shard: bool = False
                 ) -> tuple[list[float], list[float], list[float]]:
    """Per-r (index r-1) coefficients: stage time ``alpha C + beta P``, cut time ``gamma X``;
    ``shard``: replicated stages shard their optimizer state (:data:`SHARD_SYNC` times the sync).

    Two-level clusters: a stage's replicas sit in one machine while ``r <= workers_per_machine``
    and all-reduce at ``intra_bandwidth``; beyond that at the inter-machine ``bandwidth``. Cuts
    travel at ``bandwidth`` unless the whole cluster is one machine (we do not model which
    stages share a machine, so this is the conservative choice)."""
    if sync not in SYNC_MODELS:
        raise ConfigError(f"unknown sync model {sync!r}", f"use one of {', '.join(SYNC_MODELS)}")
    m = cluster.workers
    one_machine = cluster.machines == 1
    cut_bw = cluster.intra_bandwidth if one_machine else cluster.bandwidth
    alpha, beta, gamma = [], [], []
    for r in range(1, m + 1):
        bw = cluster.intra_bandwidth if (one_machine or r <= cluster.workers_per_machine) \
            else cluster.bandwidth
        alpha.append(1.0 / r)
        # a replicated stage takes whole minibatches round robin and syncs once per round of r
        # minibatches, so the sync time is divided by r like the compute
        if sync == "allreduce":  # ring all-reduce: (C + 2 (r-1)/r P/B) / r
            beta.append(2.0 * (r - 1) / r / bw / r)
        else:  # PipeDream: (C + 4 (r-1)/r P/B) / r
            beta.append(4.0 * (r - 1) / r / bw / r)
        if shard and r > 1:
            beta[-1] *= SHARD_SYNC
        gamma.append(2.0 / (cut_bw * r))
    return alpha, beta, gamma


@dataclass(frozen=True)
class _Graph:
    """The numbers the solver reads that no candidate changes, made once per graph
    (:func:`~.made_here.per_graph`): per node its compute, owned parameter bytes and held
    activation bytes, the bytes crossing each cut, the shared parameters, and what a
    recomputing stage repeats (each node's forward) and keeps per in-flight minibatch besides
    the bytes crossing into it (the model inputs it holds)."""

    compute: list[float]
    params: list[float]
    acts: list[float]
    cut_bytes: np.ndarray
    shared: tuple[Shared, ...]
    forward: list[float]
    held: list[float]

    def args(self, workers: int) -> tuple:
        """The solver's leading arguments, before the coefficients."""
        return (self.compute, self.params, self.acts, self.cut_bytes.tolist(), workers)

    def recompute_inputs(self) -> dict[str, list[float]]:
        return {"forward": self.forward, "held": self.held}


def _graph(profile: Profile) -> _Graph:
    def make() -> _Graph:
        nodes = profile.nodes
        return _Graph(compute=[nd.compute_s for nd in nodes],
                      params=[nd.parameter_bytes for nd in nodes],
                      acts=[nd.held_bytes for nd in nodes], cut_bytes=cut_bytes(profile),
                      shared=shared_parameters(profile), forward=[nd.forward_s for nd in nodes],
                      held=[nd.activation_bytes if nd.op == "placeholder" else 0.0
                            for nd in nodes])
    return per_graph(profile, "partition", make)


def shared_parameters(profile: Profile) -> tuple[Shared, ...]:
    """The parameters later nodes use besides their owner (tied weights, a reused layer), as
    the solver takes them: ``(owner, bytes, users)`` by node index, the bytes the owner's
    ``parameter_bytes`` split evenly among the parameters it owns (exact for an embedding
    owning one weight; the simulator's ties, ``tied_from_profile``, are made from these)."""
    owner: dict[str, tuple[int, float]] = {}
    users: dict[str, list[int]] = {}
    for i, nd in enumerate(profile.nodes):
        for p in nd.params:
            owner.setdefault(p, (i, nd.parameter_bytes / len(nd.params)))
        for p in nd.shared_params:
            users.setdefault(p, []).append(i)
    out = []
    for p, us in users.items():
        if p in owner:
            o, nbytes = owner[p]
            later = tuple(sorted({u for u in us if u > o}))
            if later:
                out.append((o, nbytes, later))
    return tuple(out)


def check_recompute(recompute: object) -> str:
    if recompute not in RECOMPUTE_MODES:
        raise ConfigError(f"unknown recompute={recompute!r}",
                          f"use one of {', '.join(RECOMPUTE_MODES)} (auto: recompute activations "
                          "in the stages where it makes the plan fit in memory or faster)")
    return str(recompute)


def check_shard(shard: object, sync: str, optimizer_state_factor: float,
                sharded_state: float | None) -> tuple[str, float]:
    """(the mode, the optimizer state per parameter byte a sharded replica group splits)."""
    if shard not in SHARD_MODES:
        raise ConfigError(f"unknown shard={shard!r}",
                          f"use one of {', '.join(SHARD_MODES)} (optimizer: each replicated "
                          "stage splits its optimizer state over its replicas, ZeRO-1; auto: "
                          "only where that makes the plan fit in memory or faster)")
    if shard != "never" and sync != "allreduce":
        raise ConfigError(f"shard={shard!r} with sync={sync!r}",
                          "a sharded replica group all-reduces its gradients: use "
                          "sync='allreduce'")
    split = optimizer_state_factor if sharded_state is None else sharded_state
    if not isinstance(split, (int, float)) or not 0 <= split <= optimizer_state_factor:
        raise ConfigError(f"sharded_state={sharded_state!r}",
                          f"the part of optimizer_state_factor ({optimizer_state_factor}) a "
                          "sharded replica splits: between 0 and it (float32 masters are not "
                          "split, the optimizer's moments are)")
    return str(shard), float(split)


def partition(profile: Profile, cluster: Cluster, *, sync: str = "allreduce",
              stages: int | None = None, straight: bool = False,
              optimizer_state_factor: float = 1.0, recompute: str = "never",
              memory_rule: MemoryRule = PIPEDREAM, diagnose: bool = True,
              shard: str = "never", sharded_state: float | None = None) -> Plan:
    """Minimum time-per-minibatch plan of ``profile`` on ``cluster`` (exact; see solver.py).
    ``recompute``: activation recomputation per stage, "never", "always" or "auto" (the planner
    decides per stage, recomputing only where it makes the plan fit or faster); a recomputing
    stage holds only its inputs per in-flight minibatch and pays one more forward.
    ``memory_rule``: memory as the schedule the plan is for holds it (default PipeDream's;
    ``fxpipe.runtime.pricing.memory.memory_rule(kind)`` for another), so a plan that fits only
    under a flushing schedule is found for it. ``diagnose=False``: when nothing fits, raise at
    once, without searching for the least memory that would (the error's figure; a bisection
    of full searches, minutes on a large graph with recomputation): for callers that try
    several stage counts and skip the ones that do not fit.
    ``shard``: "never", "optimizer" (every replicated stage splits ``sharded_state`` bytes per
    parameter byte of its optimizer state over its replicas, ZeRO-1, and pays
    :data:`SHARD_SYNC` times the sync) or "auto" (the faster of the two plans, the unsharded
    one on a tie: sharding only ever wins where memory needs it); ``sharded_state`` defaults
    to the whole ``optimizer_state_factor``. ``plan.shard`` says which was chosen."""
    check_recompute(recompute)
    if not isinstance(memory_rule, MemoryRule):
        raise ConfigError(f"memory_rule must be a MemoryRule, got {memory_rule!r}",
                          "make one with fxpipe.runtime.pricing.memory.memory_rule(kind)")
    if not isinstance(optimizer_state_factor, (int, float)) or optimizer_state_factor < 0:
        raise ConfigError(f"optimizer_state_factor must be >= 0, got {optimizer_state_factor!r}",
                          "e.g. 2.0 for Adam (two moments per parameter), 0 for plain SGD")
    mode, split = check_shard(shard, sync, optimizer_state_factor, sharded_state)
    kw = dict(sync=sync, stages=stages, straight=straight,
              optimizer_state_factor=optimizer_state_factor, recompute=recompute,
              memory_rule=memory_rule)
    if mode != "auto" or split == 0.0:  # auto with nothing to split: never
        return _partition(profile, cluster, diagnose=diagnose,
                          split=split if mode == "optimizer" else None, **kw)
    try:
        whole: Plan | None = _partition(profile, cluster, diagnose=False, split=None, **kw)
    except InfeasiblePlanError:
        whole = None
    try:
        sharded = _partition(profile, cluster, diagnose=diagnose and whole is None, split=split,
                             **kw)
    except InfeasiblePlanError:
        if whole is None:
            raise
        return whole
    if whole is None or (sharded.shard is not None and sharded.time_per_minibatch
                         < whole.time_per_minibatch * (1.0 - TIE_TOLERANCE)):
        log.info("sharding the optimizer state: %.4g s/minibatch against %s",
                 sharded.time_per_minibatch,
                 "no plan" if whole is None else f"{whole.time_per_minibatch:.4g} s unsharded")
        return sharded
    return whole


def _partition(profile: Profile, cluster: Cluster, *, sync: str, stages: int | None,
               straight: bool, optimizer_state_factor: float, recompute: str,
               memory_rule: MemoryRule, diagnose: bool, split: float | None) -> Plan:
    """:func:`partition` with sharding decided: ``split`` bytes per parameter byte of the
    optimizer state split over each replicated stage's replicas, None: not sharded."""
    alpha, beta, gamma = coefficients(cluster, sync, shard=split is not None)
    n, m = len(profile.nodes), cluster.workers
    if n == 0:
        raise ConfigError("the profile has no nodes")
    g = _graph(profile)
    cb = g.cut_bytes
    cuttable = int(np.isfinite(cb).sum())
    max_stages = min(m, cuttable + 1)
    if stages is not None:
        if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1 or stages > max_stages:
            raise InfeasiblePlanError(
                f"cannot make {stages!r} stages: the maximum is {max_stages} "
                f"({m} workers, {cuttable} places where the graph can be cut)",
                f"pass stages between 1 and {max_stages}, or None to let fxpipe choose")
    # compute_s = forward + backward + update: in the pipedream (1F1B) schedule every replica
    # steps after each of its backwards, so the update is stage time like F and B; acts: what
    # backward keeps, per minibatch
    args = (*g.args(m), alpha, beta, gamma)
    shared = g.shared
    rc = dict(recompute=recompute, memory_rule=memory_rule, shared=shared,
              sharded_state=split or 0.0, **g.recompute_inputs())
    try:
        sol = solve(*args, memory_cap=cluster.memory, optimizer_state_factor=optimizer_state_factor,
                    stages=stages, straight=straight, tie_tolerance=TIE_TOLERANCE, **rc)
    except InfeasiblePlanError:
        if not diagnose:
            raise
        need = minimum_memory(*args, optimizer_state_factor=optimizer_state_factor, stages=stages,
                              straight=straight, **rc)
        raise InfeasiblePlanError(
            f"no plan fits in {format_bytes(cluster.memory or 0)} per worker: the smallest-memory "
            f"plan needs {format_bytes(need)} ({need:.0f} bytes) per worker"
            f"{'' if recompute == 'never' else f' with recompute={recompute!r}'}"
            f"{'' if split is None else ' with the optimizer state sharded'}"
            f"{'' if memory_rule == PIPEDREAM else f' under {memory_rule.label()}'}",
            "use more workers or devices with more memory, a smaller batch, "
            + ("recompute='auto' (activation recomputation), " if recompute == "never" else "")
            + ("shard='auto' (the optimizer state split over a stage's replicas), "
               if split is None and optimizer_state_factor > 0 and not straight else "")
            + ("a flushing schedule (schedule='1f1b-flush': no stashed weight versions), "
               if memory_rule.schedule in ("pipedream", "2bw") else "")
            + "or optimizer_state_factor matching your optimizer") from None
    base = _baselines(profile, cluster, sync, optimizer_state_factor, memory_rule)
    plan = _make_plan(profile, cluster, sync, sol, base, alpha, optimizer_state_factor,
                      memory_rule, split)
    if stages is None and not profile.overheads.zero:
        # the overheads are priced on the solver's cuts (overhead_pricing.py): a pipeline pays
        # messages one stage does not, and a replica group an all-reduce one worker does not,
        # so the plan must beat every one-stage plan (on 1..m workers) priced the same way
        single = _one_stage(profile, cluster, sync, args, straight, recompute, alpha,
                            optimizer_state_factor, memory_rule, base, shared, split)
        if single is not None and (single.time_per_minibatch
                                   < plan.time_per_minibatch * (1.0 - TIE_TOLERANCE)
                                   or (len(sol.starts) > 1 and single.time_per_minibatch
                                       <= plan.time_per_minibatch * (1.0 + TIE_TOLERANCE))):
            log.info("the plan %s (%.4g s with the runtime's overheads) is no faster than one "
                     "stage on %d worker(s) (%.4g s): one stage", plan.replicas,
                     plan.time_per_minibatch, single.replicas[0], single.time_per_minibatch)
            return single
    return plan


def _one_stage(profile: Profile, cluster: Cluster, sync: str, args: tuple, straight: bool,
               recompute: str, alpha: list[float], optimizer_state_factor: float,
               memory_rule: MemoryRule, base: tuple[float, float],
               shared: Sequence[Shared] = (), split: float | None = None) -> Plan | None:
    """The fastest one-stage plan with the runtime's overheads, on any number of the workers
    (data parallelism on all of them, or fewer where their all-reduce costs more than it
    gains, down to one worker; one worker when ``straight``; ties go to more workers),
    recomputing only where ``recompute`` allows and it must to fit; None when none fits the
    cap."""
    best: tuple[float, Plan] | None = None
    for r in ([1] if straight else range(cluster.workers, 0, -1)):
        for flag in {"never": (False,), "always": (True,), "auto": (False, True)}[recompute]:
            one = evaluate(*args, [0], [r], recompute=[flag],
                           optimizer_state_factor=optimizer_state_factor,
                           memory_rule=memory_rule, shared=shared, sharded_state=split or 0.0,
                           **_graph(profile).recompute_inputs())
            if cluster.memory is None or one.memory[0] <= cluster.memory:
                t = _priced(profile, one, memory_rule)[1]
                if best is None or t < best[0] * (1.0 - TIE_TOLERANCE):
                    best = (t, _make_plan(profile, cluster, sync, one, base, alpha,
                                          optimizer_state_factor, memory_rule, split))
                break
    return None if best is None else best[1]


def _baselines(profile: Profile, cluster: Cluster, sync: str, optimizer_state_factor: float,
               memory_rule: MemoryRule) -> tuple[float, float]:
    """What a plan is compared with, priced like it (the runtime's overheads included): data
    parallelism on every worker, and one worker training alone (neither sharded); once per
    graph and setting, as every candidate of a choice shares them (the runtime's overheads
    are in the key: a re-priced copy of the profile shares its nodes, not its overheads)."""
    def make() -> tuple[float, float]:
        g = _graph(profile)
        plain = (*g.args(cluster.workers), *coefficients(cluster, sync))
        return tuple(_priced(profile, evaluate(  # type: ignore[return-value]
            *plain, [0], [r], optimizer_state_factor=optimizer_state_factor,
            memory_rule=memory_rule, shared=g.shared), memory_rule)[1]
            for r in (cluster.workers, 1))
    return per_graph(profile, ("baselines", cluster, sync, optimizer_state_factor, memory_rule,
                               profile.overheads), make)


def plan_for(profile: Profile, cluster: Cluster, starts: list[int], replicas: list[int], *,
             sync: str = "allreduce", optimizer_state_factor: float = 1.0,
             recompute: list[bool] | None = None,
             memory_rule: MemoryRule = PIPEDREAM, shard: str = "never",
             sharded_state: float | None = None) -> Plan:
    """The plan of a GIVEN partition (stage s starts at node ``starts[s]``, ``starts[0] == 0``,
    and runs on ``replicas[s]`` workers, recomputing its activations where ``recompute[s]``),
    costed with the planner's exact expressions: to compare plans the solver did not choose
    (benchmarks, what-if questions, choosing by simulation). ``shard`` as for
    :func:`partition`; "auto" shards where a stage would not fit the cap unsharded."""
    if recompute is not None and (len(recompute) != len(replicas)
                                  or not all(isinstance(f, bool) for f in recompute)):
        raise ConfigError(f"recompute={recompute!r} for {len(replicas)} stages",
                          "pass one bool per stage, or None (no recomputation)")
    mode, split = check_shard(shard, sync, optimizer_state_factor, sharded_state)
    n, m = len(profile.nodes), cluster.workers
    ok = (len(starts) == len(replicas) >= 1 and starts[0] == 0
          and all(a < b for a, b in zip(starts, starts[1:])) and starts[-1] < n
          and all(isinstance(r, int) and r >= 1 for r in replicas))
    if not ok:
        raise ConfigError(f"not a partition of {n} nodes: starts {starts}, replicas {replicas}",
                          "starts: increasing node indices from 0; one replica count (>= 1) "
                          "per stage")
    if sum(replicas) > m:
        raise InfeasiblePlanError(f"replicas {replicas} need {sum(replicas)} workers, the "
                                  f"cluster has {m}", "use fewer replicas or a larger Cluster")
    g = _graph(profile)
    cb = g.cut_bytes
    if not all(np.isfinite(cb[a - 1]) for a in starts[1:]):
        bad = [profile.names[a] for a in starts[1:] if not np.isfinite(cb[a - 1])]
        raise InfeasiblePlanError(f"cannot cut before {bad[0]!r}: a value that cannot be sent "
                                  "(not a tensor) is live there", "move that stage boundary")

    def priced(sharded: bool) -> tuple[Solution, list[float]]:
        alpha, beta, gamma = coefficients(cluster, sync, shard=sharded)
        sol = evaluate(*g.args(m), alpha, beta, gamma, list(starts), list(replicas),
                       optimizer_state_factor=optimizer_state_factor, recompute=recompute,
                       memory_rule=memory_rule, shared=g.shared,
                       sharded_state=split if sharded else 0.0, **g.recompute_inputs())
        return sol, alpha

    sharded = mode == "optimizer"
    sol, alpha = priced(sharded)
    if mode == "auto" and cluster.memory is not None and max(sol.memory) > cluster.memory:
        sharded = True
        sol, alpha = priced(True)
    return _make_plan(profile, cluster, sync, sol,
                      _baselines(profile, cluster, sync, optimizer_state_factor, memory_rule),
                      alpha, optimizer_state_factor, memory_rule, split if sharded else None)


def _priced(profile: Profile, sol: Solution, rule: MemoryRule) -> tuple[list[float], float]:
    """Per stage, the runtime's overheads on ``sol``'s partition, and its bottleneck with them
    (stage times plus overheads, and the cuts' times)."""
    extra = stage_overheads(profile, sol.starts, sol.replicas, sol.in_flight, rule)
    return extra, max([t + x for t, x in zip(sol.stage_times, extra)] + list(sol.cut_times))


def _make_plan(profile: Profile, cluster: Cluster, sync: str, sol: Solution,
               base: tuple[float, float], alpha: list[float], optimizer_state_factor: float,
               memory_rule: MemoryRule, split: float | None = None) -> Plan:
    names = profile.names
    held = _graph(profile).held
    bounds = list(sol.starts) + [len(names)]
    crossing = all_crossing_values(profile, [a for a in sol.starts if a > 0])
    extra, bottleneck = _priced(profile, sol, memory_rule)
    stage_plans = []
    for s, r in enumerate(sol.replicas):
        a, e = bounds[s], bounds[s + 1]
        stage_plans.append(StagePlan(
            index=s, nodes=tuple(names[a:e]), replicas=r,
            compute_s=sol.compute_times[s] + extra[s], sync_s=sol.sync_times[s],
            stage_time_s=sol.stage_times[s] + extra[s], overhead_s=extra[s],
            input_bytes=sol.cut_bytes[s], comm_s=sol.cut_times[s],
            parameter_bytes=float(sum(nd.parameter_bytes for nd in profile.nodes[a:e])),
            activation_bytes=float(sum(nd.held_bytes for nd in profile.nodes[a:e])),
            memory_bytes=sol.memory[s], in_flight=sol.in_flight[s],
            # the update is already inside compute_s (node compute_s includes it); this is the
            # same alpha C split, reported on its own
            update_s=alpha[r - 1] * sum(nd.update_s for nd in profile.nodes[a:e]),
            # evaluate() sets one flag and one time per stage, whatever the mode
            recompute=bool(sol.recompute[s]), recompute_s=sol.recompute_times[s],
            state_bytes=(float(sum(nd.parameter_bytes for nd in profile.nodes[a:e]))
                         + sol.copies[s])
                        * (2.0 + replica_state(optimizer_state_factor, split or 0.0, r)),
            copy_bytes=sol.copies[s],
            kept_input_bytes=(sol.cut_bytes[s] + float(sum(held[a:e]))
                              if sol.recompute[s] else None)))
        if a > 0:
            log.debug("stage %d receives %s", s, ", ".join(crossing[a]))
    stage_of = {nm: s for s, sp in enumerate(stage_plans) for nm in sp.nodes}
    users: dict[str, set[int]] = {}
    for nd in profile.nodes:
        for p in (*nd.params, *nd.shared_params):
            users.setdefault(p, set()).add(stage_of[nd.name])
    shared = {p: tuple(sorted(v)) for p, v in users.items() if len(v) > 1}
    workers_used = sum(sol.replicas)
    plan = Plan(stages=tuple(stage_plans), cluster=dict(cluster.to_dict()), sync=sync,
                time_per_minibatch=bottleneck, noam=math.ceil(workers_used / sol.replicas[0]),
                data_parallel_time=base[0], one_worker_time=base[1],
                batch_size=profile.batch_size,
                shared_parameters=shared,
                model_fingerprint=profile.meta.get("model_fingerprint"),
                profile_source=profile.source, workers_used=workers_used,
                memory_rule=memory_rule,
                shard="optimizer" if split is not None and workers_used > len(sol.replicas)
                else None)
    log.info("plan: replicas %s, %.4g s/minibatch (data parallel %.4g s, one worker %.4g s)",
             plan.replicas, plan.time_per_minibatch, base[0], base[1])
    return plan
