"""LocalSGD across stage-interleaved pipeline replicas, as a schedule (pure Python, no torch).

R replicas of the WHOLE pipeline train their own minibatches (k to replica k % R) with LOCAL
updates, no stale weights, and average their weights every ``average_every`` updates and at the end.
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
    averaging every ``average_every`` updates (docs/design-notes.md)."""
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
