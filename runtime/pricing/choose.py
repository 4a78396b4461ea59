"""Planning: a Profile and a Cluster (with what was measured about the run, as numbers) in, a
Plan out. The planner's optimum or the fastest of its candidates by simulation, fitted to the
memory cap by walking each stage's peak through the schedule. Torch-free: what ``compile``
measures (the runtime's overheads, the optimizer's state) arrives in the profile and as
arguments."""
from __future__ import annotations

import logging

from fxpipe.costmodel.hardware import Cluster
from fxpipe.costmodel.profile import Profile
from fxpipe.errors import ConfigError, InfeasiblePlanError
from fxpipe.passes.memory_rule import PIPEDREAM
from fxpipe.passes.partition import partition
from fxpipe.passes.plan import Plan

from ..schedules.spec import priced_kind
from ..schedules.placement import PLACED_KINDS
from .memory import SHAPES, memory_rule, placed_memory_rule
from .peak_fit import Keep, fit_peaks
from .plan_choice import choose_by_simulation, priced_by_simulation, unpriced_by_planner

__all__ = ["CHOOSERS", "choose_fitted_plan", "choose_plan"]

log = logging.getLogger(__name__)

CHOOSERS = ("auto", "planner", "simulation")


def choose_plan(profile: Profile, cluster: Cluster, *, sync: str = "allreduce",
                stages: int | None = None, straight: bool = False,
                choose: str = "auto", schedule: str = "auto",
                recompute: str = "never", microbatches: int | None = None,
                optimizer_state_factor: float = 1.0, shard: str = "never",
                sharded_state: float | None = None, keep: Keep | None = None) -> Plan:
    """``planner``: the analytic optimum (``fxpipe.passes.partition``, milliseconds), priced as
    PipeDream's schedule runs (no flush). ``simulation``: the planner's candidates, each
    event-simulated with ``schedule``, the fastest kept (:mod:`.plan_choice`; seconds at 16
    workers): it sees the 1F1B start-up, a flushing schedule's bubble and replicas
    waiting for each other, which the analytic bottleneck does not; the plan's time and its data
    parallelism's are then the simulated ones under ``schedule`` (``plan.time_source``), and
    data parallelism is among the candidates, so the plan is never slower than it. ``auto``
    (default): the planner for ``pipedream``, the simulation for every other schedule
    (``"auto"``, the default, is priced as the default trainer trains: see
    :func:`fxpipe.compile`).
    Under ``auto`` a pipedream optimum is chosen by simulation too where the planner's
    objective does not price it (:func:`.plan_choice.unpriced_by_planner`): it puts a shared
    parameter (tied embeddings) on two stages, whose gradient sum crosses the link at every
    update (on a slow link that can make the pipeline slower than one worker), or its
    simulation under pipedream is more than 5% slower than the planner says (round trips longer
    than PipeDream's window, replicas waiting for each other).
    ``schedule``'s memory is what the plans are fitted with (``microbatches`` per update);
    ``optimizer_state_factor``: state bytes per parameter byte beyond weights and gradients
    (``runtime.replica.state_size``); ``shard`` ("never", "optimizer", "auto") and
    ``sharded_state``: a replicated stage's optimizer state split over its replicas (ZeRO-1,
    :func:`fxpipe.passes.partition.partition`). ``keep``: which candidates the choice by
    simulation may pick (those whose walked peaks fit, :func:`.peak_fit.fit_peaks`)."""
    if choose not in CHOOSERS:
        raise ConfigError(f"unknown choose={choose!r}", f"use one of {', '.join(CHOOSERS)}")
    schedule = priced_kind(schedule)
    rule = memory_rule(schedule, microbatches) if schedule in SHAPES else PIPEDREAM
    if schedule in PLACED_KINDS:  # the kind's own order, on P processes per pipeline copy
        P = stages or cluster.workers
        copies = cluster.workers // P if cluster.workers % P == 0 else 1
        rule = placed_memory_rule(schedule, P, microbatches // copies if microbatches else None)
    if choose == "planner" or (choose == "auto" and schedule == "pipedream"):
        plan = partition(profile, cluster, sync=sync, stages=stages, straight=straight,
                         recompute=recompute, memory_rule=rule,
                         optimizer_state_factor=optimizer_state_factor, shard=shard,
                         sharded_state=sharded_state)
        if choose == "planner":
            return plan
        why = unpriced_by_planner(plan, profile)
        if why is None:
            return plan
        log.info("the planner's optimum %s: %s; choosing by simulation", plan.replicas, why)
    try:
        choice = choose_by_simulation(profile, cluster, sync=sync, stages=stages,
                                      straight=straight, schedules=(schedule,),
                                      recompute=recompute, memory_rule=rule,
                                      microbatches=microbatches,
                                      optimizer_state_factor=optimizer_state_factor,
                                      shard=shard, sharded_state=sharded_state, keep=keep)
    except InfeasiblePlanError as err:
        if choose != "auto" or schedule != "pipedream":
            raise
        # e.g. stages forced and every such plan has tied stages with unequal replica counts
        log.warning("no candidate simulates under pipedream (%s); keeping the planner's plan, "
                    "which a flushing schedule trains", err)
        return plan
    log.info("%s", choice.summary())
    return priced_by_simulation(choice, profile, cluster, sync=sync, microbatches=microbatches)


def choose_fitted_plan(profile: Profile, cluster: Cluster, *, sync: str = "allreduce",
                       stages: int | None = None, straight: bool = False,
                       choose: str = "auto", schedule: str = "auto",
                       recompute: str = "never", microbatches: int | None = None,
                       optimizer_state_factor: float = 1.0,
                       temporaries: tuple[float, float] = (0.0, 0.0), shard: str = "never",
                       sharded_state: float | None = None) -> Plan:
    """:func:`choose_plan`, with the cluster's memory cap held against each stage's peak walked
    through ``schedule`` (:func:`~.peak_fit.fit_peaks`: the fastest candidate whose peaks fit;
    where none does, planned again for the highest lower cap the planner's optimum fits), the
    walked peaks recorded on the plan: what ``compile``, ``fxpipe plan`` and ``fxpipe
    simulate`` plan with. ``temporaries``: the optimizer step's ``(per_byte, per_largest)``
    (:func:`fxpipe.runtime.replica.state_size.temporaries_for`; none where no optimizer is
    known)."""
    schedule = priced_kind(schedule)
    kw = dict(sync=sync, stages=stages, straight=straight, schedule=schedule,
              recompute=recompute, microbatches=microbatches,
              optimizer_state_factor=optimizer_state_factor, shard=shard,
              sharded_state=sharded_state)

    def chosen(c: Cluster, keep: Keep | None) -> Plan:
        return choose_plan(profile, c, choose=choose, keep=keep, **kw)

    def planned(c: Cluster) -> Plan:
        return choose_plan(profile, c, choose="planner", **kw)

    return fit_peaks(chosen, profile, cluster, schedule, microbatches, temporaries,
                     search=None if choose == "planner" else planned)
