"""LocalSGD across stage-interleaved pipeline replicas, as a schedule (pure Python, no torch).

Randomized PipeDream's alternative to asynchrony (Ilin & Richtarik, arXiv 2606.03498): instead of
one pipeline whose stages run on stale weights, run R replicas of the WHOLE pipeline. Each replica
trains one minibatch at a time (forward through every stage, backward, update: no weight is ever
stale within a replica, so no stash is needed), the replicas train independently on their own
minibatches, and every ``average_every`` (H) updates the replicas' weights are averaged. Their
price is not staleness but divergence: between averages a replica has not seen up to
(R - 1) x (H - 1) updates the others made.

Why "stage-interleaved": with R = S replicas on S workers, replica j's stage s runs on worker
(s + j) mod S, so at any moment every worker computes for some replica and there is no pipeline
bubble (each worker holds one stage of every replica: the whole model, which is what LocalSGD
costs in memory).

As data it is an ordinary :class:`~fxpipe.runtime.schedules.schedule.Schedule` on ranks (stage,
replica): minibatch k goes to replica k % R of every stage, each rank runs ``F k, B k, U i`` for its
minibatches in order. Unlike every other kind, a ``U`` here is LOCAL (the replica steps with its
own gradient; see :class:`fxpipe.runtime.execution.localsgd_executor.LocalSGDExecutor`) and every
H-th ``U`` of a stage also averages the replicas' weights. A replica with one minibatch fewer (the
segment is not a multiple of R) gets a trailing empty ``U`` so all replicas count updates alike;
the executor skips its optimizer step.
"""
from __future__ import annotations

from dataclasses import dataclass

from fxpipe.errors import ConfigError

from .schedule import Action, Rank, Schedule, validate

LOCALSGD = "localsgd"
DEFAULT_AVERAGE_EVERY = 4


@dataclass(frozen=True)
class LocalSGDSchedule(Schedule):
    """A LocalSGD schedule: ``average_every`` (H) is the number of local updates between two
    averages of the replicas' weights."""

    average_every: int = DEFAULT_AVERAGE_EVERY


def make_localsgd_schedule(num_stages: int, replicas: int, num_minibatches: int, *,
                           average_every: int = DEFAULT_AVERAGE_EVERY) -> LocalSGDSchedule:
    """R = ``replicas`` copies of an S-stage pipeline, each running one minibatch at a time,
    averaging every ``average_every`` updates (see the module doc)."""
    for name, v in (("num_stages", num_stages), ("replicas", replicas),
                    ("average_every", average_every)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(f"localsgd {name}={v!r}", "use a positive integer")
    if isinstance(num_minibatches, bool) or not isinstance(num_minibatches, int) \
            or num_minibatches < 0:
        raise ConfigError(f"num_minibatches={num_minibatches!r}", "use 0 or more")
    rounds = -(-num_minibatches // replicas)
    acts: dict[Rank, tuple[Action, ...]] = {}
    for s in range(num_stages):
        for j in range(replicas):
            out: list[Action] = []
            mine = list(range(j, num_minibatches, replicas))
            for i, k in enumerate(mine):
                out += [Action("F", k, i), Action("B", k, i), Action("U", i, i + 1)]
            out += [Action("U", i, i + 1) for i in range(len(mine), rounds)]
            acts[(s, j)] = tuple(out)
    sched = LocalSGDSchedule(LOCALSGD, (replicas,) * num_stages, num_minibatches, acts,
                             group=1, noam=1, windows=(1,) * num_stages,
                             average_every=average_every)
    validate(sched)
    return sched


def averages_after(sched: LocalSGDSchedule, update: int) -> bool:
    """Whether the replicas average their weights right after local update ``update`` (0-based):
    every H-th update, and after the last one of the schedule (so a segment ends with one model,
    which checkpoints and evaluation see)."""
    last = -(-sched.num_minibatches // sched.replicas[0]) - 1
    return (update + 1) % sched.average_every == 0 or update == last
