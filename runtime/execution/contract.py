"""The run contract both executors keep: ``Batch`` in, :class:`RunResult` out, schedules checked.

Kept apart from :mod:`fxpipe.runtime.execution.reference` so the distributed executor and the
trainer's backends depend on the contract, not on the oracle's implementation.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from fxpipe.codegen.split import StageSpec

from ..errors import RuntimeConfigError
from ..replica.stage import (StageReplica, TiedParameter, check_stages, sync_components,
                             tied_parameters)
from ..schedules.localsgd import LOCALSGD
from ..schedules.schedule import (Action, Rank, Schedule, execution_order, tie_delay,
                                 uneven_tied_updates, validate)
from ..timeline import TimelineEvent

Batch = tuple[Any, Any]
"""(model inputs: a tensor or a tuple of positional inputs, target for the loss). A rank that
needs only one of them (a middle stage needs neither) holds None for the other."""


@dataclass
class RunResult:
    """What a run produced.

    ``losses[k]``: loss of minibatch k. ``params[s]``: stage s's latest weights by the model's own
    names (replica 0; replicas of a stage stay equal). ``replica_params`` and ``peak_bytes``
    (weights held by the stash, peak) per rank. ``timeline``: global rank index (position in
    ``schedule.ranks``) -> its events (see :mod:`fxpipe.runtime.timeline`). ``background``: the
    same for work that overlaps the rank's own events (bucketed gradient all-reduces launched
    during a backward), kept apart so ``timeline`` stays sequential per rank.
    """

    losses: list[float]
    params: list[dict[str, torch.Tensor]]
    replica_params: dict[Rank, dict[str, torch.Tensor]] = field(default_factory=dict)
    peak_bytes: dict[Rank, int] = field(default_factory=dict)
    timeline: dict[int, list[TimelineEvent]] = field(default_factory=dict)
    background: dict[int, list[TimelineEvent]] = field(default_factory=dict)
    comm_logs: dict[int, list[tuple]] = field(default_factory=dict)
    """Distributed runs with ``record_comm``: every rank's log (see ncclcheck.check_logs)."""

    def merged_params(self) -> dict[str, torch.Tensor]:
        """Every stage's weights in one dict (the model's state after training)."""
        out: dict[str, torch.Tensor] = {}
        for p in self.params:
            out.update(p)
        return out


def reads(actions: Sequence[Action]) -> dict[int, int]:
    """version -> number of the forwards among ``actions`` reading it."""
    return dict(Counter(a.version for a in actions if a.kind == "F" and a.version is not None))


def planned_reads(sched: Schedule, rank: Rank) -> dict[int, int]:
    """version -> number of forwards of ``rank`` reading it (what its stash must keep)."""
    return reads(sched.actions[rank])


def prepare_window(replica: StageReplica, sched: Schedule, rank: Rank) -> None:
    """Before ``rank`` runs ``sched`` (a complete schedule, or a window of a stretch): a
    stretch's first window counts weight versions from 0 again; the stash learns the versions
    the forwards of the window and of its lookahead (``Window.ahead``) will read, so none is
    dropped before a later window reads it; weight prediction learns its horizons."""
    acts = (*sched.actions[rank], *getattr(sched, "ahead", {}).get(rank, ()))
    if getattr(sched, "start", 0) == 0:
        replica.stash.rebase()
    replica.stash.set_planned_reads(reads(acts))
    prepare = getattr(replica, "prepare", None)  # a MitigatedReplica's (weight prediction)
    if prepare is not None:
        prepare(acts)


def tied_delay(sched: Schedule, tied: Sequence[TiedParameter]) -> int:
    """Rounds by which a tied parameter's update lags its gradient (0: synchronous).

    Why: stages sharing a weight (GPT's ``wte``/``lm_head`` on stage 0 and the last stage) must
    apply the same gradient sum at every update, and under ``pipedream`` the last stage reaches
    update i long before stage 0 does (stage 0 still has that minibatch's backward ahead). A
    synchronous tied all-reduce at every update puts the two in lockstep: the pipeline then runs
    at the pace of a full round trip (2.5x the untied time per minibatch on 4 unit-time stages,
    see ``simulate(sync=..., delay=...)``). So under pipedream each holder posts round i's sum
    asynchronously at its update i and applies round ``i - d``'s at that update: the copies still
    receive the same sequence of summed gradients (they stay identical after equally many
    updates), only later; the last ``d`` rounds are applied at the segment end (tied-only steps).
    ``d`` = the difference of the in-flight windows of the lowest and highest stage sharing a
    weight (0 with NOAM = 1, where the pipeline has nothing in flight, so plain SGD is kept).
    Flushing schedules update every stage at the batch end anyway: synchronous (d = 0)."""
    return tie_delay(sched, [t.stages for t in tied])


def check_schedule(stages: Sequence[StageSpec], replicas: Sequence[int], sched: Schedule,
                   num_batches: int | None = None) -> None:
    """The schedule must be valid and made for these stages, replicas and batches, and stages
    sharing a tied parameter must update equally often (their updates are one all-reduce)."""
    check_stages(stages, replicas)
    if tuple(sched.replicas) != tuple(replicas):
        raise RuntimeConfigError(f"schedule is for replicas {list(sched.replicas)}, the pipeline "
                                 f"has {list(replicas)}", "make the schedule with the same replicas")
    if num_batches is not None and num_batches != sched.num_minibatches:
        raise RuntimeConfigError(f"{num_batches} batches for a schedule of "
                                 f"{sched.num_minibatches} minibatches",
                                 "pass exactly schedule.num_minibatches batches")
    validate(sched)
    tied = tied_parameters(stages)
    if tied and sched.kind == LOCALSGD:
        raise RuntimeConfigError(
            f"LocalSGD with parameter {tied[0].key!r} tied across stages {list(tied[0].stages)}",
            "not supported: use a pipeline schedule, or untie the parameter")
    for t in tied:
        counts = uneven_tied_updates(sched, [t.stages])
        if counts:
            raise RuntimeConfigError(
                f"parameter {t.key!r} is shared by stages {list(t.stages)}, whose ranks make "
                f"different numbers of updates {counts}", "tied parameters need the same update "
                "cadence on every stage holding them: equal replica counts, or a flush schedule")
    # raises DeadlockError if ties deadlock
    execution_order(sched, sync_components(tied), tied_delay(sched, tied))
