"""Price a plan's stages as the runtime runs them, before any distributed run.

:func:`calibrate_stages` runs the stages on a few minibatches in this process (reference
executor), rescales the profile stage by stage to their measured times and prices the same
cuts again: a stage as run costs more than its profiled share. Links and waits stay unseen."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from fxpipe.codegen.split import StageSpec
from fxpipe.costmodel import Cluster, Profile
from fxpipe.passes import Plan

from ..errors import RuntimeConfigError
from ..execution.contract import Batch
from ..execution.reference import ReferenceExecutor
from ..pricing.replan import StageTimes, after_first_update, mean_times, measure, reprice
from ..replica.stage import LossFn
from ..replica.stash import OptimizerFactory
from ..schedules.kinds import make_schedule


@dataclass(frozen=True)
class StageCalibration:
    """What :func:`calibrate_stages` measured and what the plan costs on it."""

    measured: tuple[StageTimes, ...]      # per stage: forward, backward (per minibatch), update
    factors: tuple[tuple[float, float, float], ...]  # per stage: measured / profiled, each kind
    profile: Profile                      # the profile rescaled to ``measured``
    plan: Plan                            # the same cuts and replicas, priced on ``profile``

    @property
    def time_per_minibatch(self) -> float:
        return self.plan.time_per_minibatch


def calibrate_stages(stages: Sequence[StageSpec], plan: Plan, profile: Profile,
                     loss_fn: LossFn, optimizer_factory: OptimizerFactory,
                     batches: Sequence[Batch], *, schedule: str = "pipedream"
                     ) -> StageCalibration:
    """Run ``plan``'s ``stages`` on ``batches`` in this process under ``schedule`` and price
    the plan on its profile rescaled to the measured stage times (docs/design-notes.md). The
    stages' weights are not changed (the replicas train copies). At least two updates'
    minibatches are needed: the first update is warm-up."""
    replicas = list(plan.replicas)
    if len(stages) != len(plan.stages):
        raise RuntimeConfigError(f"{len(stages)} stages for a plan of {len(plan.stages)}",
                                 "pass the stage specs split from this plan")
    sched = make_schedule(schedule, replicas, len(batches))
    timeline = ReferenceExecutor(stages, replicas, sched, loss_fn, optimizer_factory
                                 ).run_window(sched, batches, collect_params=False).timeline
    by_stage: dict[int, list[StageTimes]] = {}
    for i, rank in enumerate(sched.ranks):
        events = timeline.get(i, [])
        if len({e.args.get("update") for e in events if e.category == "optimizer"}) < 2:
            raise RuntimeConfigError(
                f"{len(batches)} minibatches give stage {rank[0]} one update or none to measure "
                "after its warm-up", "pass more minibatches (a few per replica and update)")
        by_stage.setdefault(rank[0], []).append(measure(after_first_update(events)))
    times = tuple(mean_times(ts) for _, ts in sorted(by_stage.items()))
    # the reference executor sums tied gradients inside its updates: measured with them
    scaled, factors, priced = reprice(profile, plan, times, Cluster.from_dict(dict(plan.cluster)),
                                      sync=plan.sync, ties_measured=True)
    return StageCalibration(times, factors, scaled, priced)

