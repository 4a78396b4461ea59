"""The single-process oracle: runs a pipeline schedule with the distributed runtime's semantics.

Why it exists: the distributed executor is only as trustworthy as what it is compared with. This
executor carries out the SAME schedule (per-rank action lists, weight versions, explicit updates)
with the same per-replica state (each stage replica owns a copy of the stage's parameters and its
own optimizer; replicas of a stage sum their gradients at each ``U``), but in one deterministic
global order (``execution_order``: a topological order of the schedule's dependencies), with an
in-memory mailbox instead of sockets. Its compute is the shared :class:`StageReplica`, so the
distributed runtime must match it to rounding; and with one stage, or with NOAM = 1, it must match
plain single-process SGD, which checks the oracle itself.
"""
from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from fxpipe.codegen.split import MODEL, StageSpec

from .errors import RuntimeConfigError
from .schedule import Rank, Schedule, execution_order, split_ranks, validate
from .stage import (LossFn, StageReplica, TiedParameter, check_stages, model_env, sync_components,
                    tie_sets, tied_parameters)
from .stash import OptimizerFactory
from .timeline import Recorder, TimelineEvent

log = logging.getLogger(__name__)

Batch = tuple[Any, Any]
"""(model inputs: a tensor or a tuple of positional inputs, target for the loss)."""


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

    def merged_params(self) -> dict[str, torch.Tensor]:
        """Every stage's weights in one dict (the model's state after training)."""
        out: dict[str, torch.Tensor] = {}
        for p in self.params:
            out.update(p)
        return out


def planned_reads(sched: Schedule, rank: Rank) -> dict[int, int]:
    """version -> number of forwards of ``rank`` reading it (what its stash must keep)."""
    return dict(Counter(a.version for a in sched.actions[rank]
                        if a.kind == "F" and a.version is not None))


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
    for t in tied:
        counts = {rank: sum(a.kind == "U" for a in sched.actions[rank]) for rank in sched.ranks
                  if rank[0] in t.stages}
        if len(set(counts.values())) > 1:
            raise RuntimeConfigError(
                f"parameter {t.key!r} is shared by stages {list(t.stages)}, whose ranks make "
                f"different numbers of updates {counts}", "tied parameters need the same update "
                "cadence on every stage holding them: equal replica counts, or a flush schedule")
    execution_order(sched, sync_components(tied))  # raises DeadlockError if ties deadlock


def tied_update(totals: dict[Rank, torch.Tensor], locals_: dict[Rank, torch.Tensor],
                workers: dict[Rank, StageReplica], tied: Sequence[TiedParameter]) -> None:
    """Reference semantics of tied parameters at one update: in every rank's ``totals`` (its
    stage's replica-summed gradient buffer), replace the tied parameters' part by the sum over
    ALL ranks holding them of their LOCAL sums (``locals_``), in rank order."""
    for stages, ts in tie_sets(tied).items():
        ranks = [r for r in sorted(totals) if r[0] in stages]
        seg = _sum([workers[r].segment(locals_[r], [t.names[r[0]] for t in ts]) for r in ranks])
        for r in ranks:
            workers[r].put_segment(totals[r], [t.names[r[0]] for t in ts], seg)  # type: ignore


class ReferenceExecutor:
    """Carry out ``schedule`` for ``stages`` in one process (see the module doc).

    ``vertical_sync``: every stage uses, for minibatch k, the weight version the input stage used
    (PipeDream's vertical sync; needs equal replica counts). ``stashing=False`` is the ablation in
    which backwards use the latest weights.
    """

    def __init__(self, stages: Sequence[StageSpec], replicas: Sequence[int], schedule: Schedule,
                 loss_fn: LossFn, optimizer_factory: OptimizerFactory, *,
                 stashing: bool = True, vertical_sync: bool = False) -> None:
        self.stages = list(stages)
        self.replicas = list(replicas)
        self.schedule = schedule.with_vertical_sync() if vertical_sync else schedule
        check_schedule(self.stages, self.replicas, self.schedule)
        last = len(self.stages) - 1
        self.workers: dict[Rank, StageReplica] = {
            rank: StageReplica(self.stages[rank[0]], optimizer_factory,
                               loss_fn=loss_fn if rank[0] == last else None, stashing=stashing,
                               planned_reads=planned_reads(self.schedule, rank))
            for rank in self.schedule.ranks}
        self.tied = tied_parameters(self.stages)
        self._sync = sync_components(self.tied)
        self._runs = 0

    def step(self, inputs: Sequence[Any], targets: Sequence[Any]) -> RunResult:
        """Train on one sequence of minibatches (``inputs[k]``, ``targets[k]``)."""
        return self.run(list(zip(inputs, targets)))

    def run(self, batches: Sequence[Batch]) -> RunResult:
        """Run the whole schedule on ``batches`` (one per minibatch); weights carry over between
        runs, weight versions restart at 0."""
        sched = self.schedule
        check_schedule(self.stages, self.replicas, sched, len(batches))
        if self._runs:
            for rank, w in self.workers.items():
                w.stash.rebase()
                w.stash.set_planned_reads(planned_reads(sched, rank))
        self._runs += 1
        envs: dict[int, dict[str, Any]] = {}
        acts: dict[tuple[str, int, int], torch.Tensor] = {}  # (value, minibatch, consumer stage)
        grads: dict[tuple[str, int, int], torch.Tensor] = {}  # (value, minibatch, consumer stage)
        losses: dict[int, float] = {}
        pending: dict[tuple[int, int], list[Rank]] = {}
        index = {rank: i for i, rank in enumerate(sched.ranks)}
        split = split_ranks(sched)
        recs = {rank: Recorder(args={"stage": rank[0], "replica": rank[1]}) for rank in index}
        for rank, i in execution_order(sched, self._sync):
            a = sched.actions[rank][i]
            s, st, w = rank[0], self.stages[rank[0]], self.workers[rank]
            k = a.minibatch
            t0 = recs[rank].now()
            if a.kind == "F":
                if k not in envs:
                    envs[k] = model_env(self.stages, batches[k][0])
                ins = [envs[k][n] if src == MODEL else acts.pop((n, k, s))
                       for n, src in zip(st.inputs, st.sources)]
                outs, loss = w.forward(k, a.version, ins, batches[k][1])
                if loss is not None:
                    losses[k] = loss
                recs[rank].add("forward", str(a), t0, recs[rank].now(), minibatch=k,
                               version=a.version)
                for n, o, cons in zip(st.outputs, outs, st.consumers):
                    for c in cons:
                        if c != MODEL:
                            acts[(n, k, c)] = o
            elif a.kind == "B":
                out_grads = [_sum([grads.pop((n, k, c), None) for c in cons if c != MODEL])
                             for n, cons in zip(st.outputs, st.consumers)]
                in_grads = w.backward(k, out_grads, split=rank in split)
                recs[rank].add("backward", str(a), t0, recs[rank].now(), minibatch=k,
                               version=a.version)
                for n, src, g in zip(st.inputs, st.sources, in_grads):
                    if src != MODEL and g is not None:
                        grads[(n, k, s)] = g
            elif a.kind == "W":
                w.backward_weight(k)
                recs[rank].add("backward", str(a), t0, recs[rank].now(), minibatch=k,
                               version=a.version)
            else:
                comp = next((c for c in self._sync if s in c), (s,))
                group = pending.setdefault((comp[0], k), [])
                group.append(rank)
                if len(group) == sum(self.replicas[t] for t in comp):
                    self._update(group, recs)
                    del pending[(comp[0], k)]
        if acts or grads:
            log.warning("undelivered tensors at the end: %s", sorted(acts) + sorted(grads))
        timeline = {index[r]: rec.finish() for r, rec in recs.items()}
        return self.result([losses[k] for k in range(sched.num_minibatches)], timeline)

    def _update(self, ranks: list[Rank], recs: dict[Rank, Recorder]) -> None:
        """One update of every rank in ``ranks`` (all replicas of a set of stages updating
        together): replicas sum their gradients, tied parameters sum across stages."""
        t0 = {r: recs[r].now() for r in ranks}
        locals_ = {r: self.workers[r].local_gradient() for r in sorted(ranks)}
        totals = {r: _sum([locals_[q] for q in sorted(ranks) if q[0] == r[0]]).clone()
                  for r in ranks}  # type: ignore[union-attr]
        tied_update(totals, locals_, self.workers, self.tied)
        for r in sorted(ranks):
            self.workers[r].apply_update(totals[r])
            recs[r].add("optimizer", f"U{self.workers[r].stash.version - 1}", t0[r],
                        recs[r].now(), stage=r[0], replica=r[1])

    def result(self, losses: list[float],
               timeline: dict[int, list[TimelineEvent]] | None = None) -> RunResult:
        """Package the current state (see :class:`RunResult`)."""
        rp = {rank: w.parameters() for rank, w in self.workers.items()}
        return RunResult(losses, [rp[(s, 0)] for s in range(len(self.stages))], rp,
                         {rank: w.stash.peak_bytes for rank, w in self.workers.items()},
                         dict(timeline or {}))


def _sum(ts: Sequence[torch.Tensor | None]) -> torch.Tensor | None:
    """Sum in list order (the order the distributed runtime uses too); None if all are None."""
    out: torch.Tensor | None = None
    for t in ts:
        if t is not None:
            out = t if out is None else out + t
    return out
