"""Price a plan's stages as the runtime runs them, before any distributed run.

The profile times nodes one by one and scales the sums to one plain training step of the whole
model (``costmodel.calibrate``). A stage as the runtime runs it costs more than its share of that
step: its forward is a separate call with its own weights dict, its backward starts from the
received gradients (``torch.autograd.grad``), its update pays the stash's copy under pipedream.
On the zoo's GPT mini cut in two, the stages ran 1.29-1.35x their planned forward and backward
and 2.3-2.7x their update (BENCHMARKS ``runtime_prediction``, an earlier run): the plan promised
6.8 ms per minibatch, the run took 10.1, and only re-planning after a first distributed segment
said so. Priced on these stage times the prediction was 10.1 ms (within 1%; +9% in the latest
run). The MLP cut in two was over-predicted in some runs (by 25% in one, by 9%, 16% and, in one
round of the latest, 22% in others; the latest's median is -5%): one process alternating
between two stages whose weights and momenta (about 30 MB) do not fit its cache together
probably computes each slower than a process of its own does (not measured apart). Since the
plan prices the runtime's overheads (:mod:`fxpipe.costmodel.overheads`), the profile's own
prediction of the GPT mini in two is within 5%; the calibrated plan keeps only the messages of
them (the measured stage times hold the rest, the tied sums included: see
:meth:`~fxpipe.costmodel.overheads.Overheads.in_measured_stages`).

:func:`calibrate_stages` runs the plan's stages on a few minibatches in this process (the
reference executor: the same stage replicas, stash and optimizer as every rank, one after the
other, no links), measures each stage's forward, backward and update from its timeline (after the
first update: warm-up), rescales the profile stage by stage to them (what ``replan="auto"`` does
after a segment, :func:`fxpipe.runtime.pricing.replan.reprice`) and prices the same cuts again.
What it cannot see: links, concurrency between ranks, the executor's waits between actions.

    cal = compiled.calibrate_stages(batches[:48], lambda ps: torch.optim.SGD(ps, lr=0.01))
    cal.time_per_minibatch  # the plan's time per minibatch on the calibrated profile
    cal.factors             # per stage: measured / profiled forward, backward, update
"""
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
    the plan on its profile rescaled to the measured stage times (see the module doc). The
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

