"""LocalSGD on the reference executor: R independent pipeline replicas, averaged every H updates.

Each replica's ``U`` steps its own optimizer on its own gradient; every H-th update (and the last)
replaces weights and floating buffers by the replicas' mean, optimizer state staying local.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from fxpipe.codegen.split import StageSpec

from ..errors import RuntimeConfigError
from ..replica.stage import LossFn, StageReplica
from ..replica.stash import OptimizerFactory
from ..schedules.localsgd import LocalSGDSchedule, averages_after
from ..schedules.schedule import Rank
from ..timeline import Recorder
from .reference import ReferenceExecutor


class LocalSGDExecutor(ReferenceExecutor):
    """Carry out a :class:`LocalSGDSchedule` for ``stages`` in one process
    (docs/design-notes.md)."""

    def __init__(self, stages: Sequence[StageSpec], schedule: LocalSGDSchedule, loss_fn: LossFn,
                 optimizer_factory: OptimizerFactory, **options: Any) -> None:
        """``options``: the reference executor's keywords (``stashing``, ``options``,
        ``device``); no delays or mitigations (a LocalSGD copy never reads stale weights)."""
        if not isinstance(schedule, LocalSGDSchedule):
            raise RuntimeConfigError(f"LocalSGDExecutor got a {schedule.kind!r} schedule",
                                     "make it with fxpipe.runtime.schedules.localsgd.make_localsgd_schedule")
        super().__init__(stages, list(schedule.replicas), schedule, loss_fn, optimizer_factory,
                         delays=[0] * len(stages), **options)  # refuses tied weights

    def _update(self, ranks: list[Rank], recs: dict[Rank, Recorder], i: int = 0) -> None:
        """Update ``U<i>`` of every replica of one stage: each alone, then maybe the average
        (replicas never sum gradients here, so ``i``, the update's index, is not needed)."""
        for r in sorted(ranks):
            w = self.workers[r]
            t0 = recs[r].now()
            if w.count:
                w.apply_local_update()
            else:  # a replica without a minibatch in the last round: nothing to step
                w.stash.version += 1
            recs[r].add("optimizer", f"U{w.stash.version - 1}", t0, recs[r].now(),
                        stage=r[0], replica=r[1])
        update = self.workers[ranks[0]].stash.version - 1
        if averages_after(self.schedule, update):  # type: ignore[arg-type]
            self.average([self.workers[r] for r in sorted(ranks)])

    @staticmethod
    @torch.no_grad()
    def average(workers: Sequence[StageReplica]) -> None:
        """Replace the replicas' latest weights (their masters where kept, then rounded down)
        and floating buffers by their mean, in place (the optimizers keep pointing at the same
        tensors)."""
        for ts in zip(*(w.averaged() for w in workers)):
            mean = torch.stack([t.detach() for t in ts]).mean(0)
            for t in ts:
                t.copy_(mean)
        for w in workers:
            w.stash.masters.copy_down(w.stash.latest)
