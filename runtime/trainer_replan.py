"""The trainer's side of re-planning: gather every stage's measured times from the ranks'
timelines and ask :func:`.replan.propose` whether another plan would be faster.

A COLLECTIVE under the distributed executor (every rank calls it, between segments: after
``fit`` or from an ``on_checkpoint`` hook): each rank measures its own stage replica from its
timelines (``timeline=True``) and the ranks exchange the numbers, so every rank gets the same
proposal. ``trainer(replan="auto")`` calls it at a segment boundary and carries an adopted
proposal out in place (:mod:`.trainer_switch`); by hand, checkpoint and resume under the
proposed plan (:mod:`.repartition`).
"""
from __future__ import annotations

from typing import Any

from fxpipe.costmodel import Cluster

from .errors import RuntimeConfigError
from .replan import Proposal, StageTimes, after_first_update, measure, propose


def measured_stage_times(trainer: Any, skip: int = 0) -> list[StageTimes]:
    """Per stage, the mean over its replicas and over the recorded segments (but the first
    ``skip``: warm-up) of the measured forward and backward per minibatch and optimizer step per
    update. The trainer's first segment, when it is measured (``skip=0``), counts only after
    its first update (:func:`.replan.after_first_update`: the warm-up)."""
    mine: list[tuple[int, StageTimes]] = []
    segments = [after_first_update(events) if i == 0 else events
                for i, (events, _) in enumerate(trainer.timelines) if i >= skip] or [
        events for events, _ in trainer.timelines[-1:]]
    if segments:
        per = [measure(events) for events in segments]
        avg = StageTimes(*(sum(getattr(p, f) for p in per) / len(per)
                           for f in ("forward_s", "backward_s", "update_s")))
        mine = [(s, avg) for s, _ in trainer.local]
    got = trainer.backend.exchange(mine, "re-plan: measured stage times")
    by_stage: dict[int, list[StageTimes]] = {}
    for share in got:
        for s, t in share or []:
            by_stage.setdefault(s, []).append(t)
    missing = [s for s in range(len(trainer.stages)) if s not in by_stage]
    if missing:
        raise RuntimeConfigError(f"no timeline of stages {missing} to re-plan from",
                                 "train with timeline=True (distributed executor) first")
    return [StageTimes(*(sum(getattr(t, f) for t in by_stage[s]) / len(by_stage[s])
                         for f in ("forward_s", "backward_s", "update_s")))
            for s in range(len(trainer.stages))]


def propose_replan(trainer: Any, cluster: Cluster | None = None,
                   threshold: float = 0.05) -> Proposal:
    """Re-plan a compiled model's trainer from its measurements (see the module doc)."""
    plan, profile = trainer.auto_options.plan, trainer.auto_options.profile
    if plan is None or profile is None:
        raise RuntimeConfigError("re-planning needs the plan and profile the stages came from",
                                 "make the trainer with CompiledModel.trainer(...)")
    return propose(profile, plan, measured_stage_times(trainer),
                   cluster or Cluster.from_dict(dict(plan.cluster)), threshold=threshold)
