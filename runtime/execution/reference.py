"""The single-process oracle: runs a pipeline schedule with the distributed runtime's semantics.

Same action lists, weight versions and :class:`StageReplica` compute, in one deterministic order
with an in-memory mailbox: the distributed executor must match it to rounding.
"""
from __future__ import annotations

import logging
from typing import Any, Sequence

import torch

from fxpipe.codegen.split import MODEL, StageSpec

from ..replica.clipping import stage_clipper
from ..replica.device import to_device
from ..replica.global_step import reference_step
from ..replica.mitigation import check_mitigation, make_replica
from ..replica.stage import (LossFn, StageReplica, TiedParameter, detached_values, model_env,
                             sync_components, tie_sets, tied_parameters)
from ..replica.stash import OptimizerFactory
from ..replica.step_options import DEFAULT, StepOptions
from ..schedules.schedule import SCHEDULE_KINDS, Rank, Schedule, execution_order, split_ranks
from ..schedules.spec import Mitigation
from ..schedules.staleness import own_delays
from ..schedules.stream import STREAM_KINDS, Window
from ..timeline import Recorder, TimelineEvent
from .contract import (Batch, RunResult, check_schedule, planned_reads, prepare_window,
                       tied_delay)

log = logging.getLogger(__name__)


def tied_update(totals: dict[Rank, torch.Tensor], locals_: dict[Rank, torch.Tensor],
                workers: dict[Rank, StageReplica], tied: Sequence[TiedParameter]) -> None:
    """Reference semantics of tied parameters at one update: in every rank's ``totals`` (its
    stage's replica-summed gradient buffer, with presence flags), replace the tied parameters'
    part and flags by the sum over ALL ranks holding them of their LOCAL sums and flags
    (``locals_``), in rank order: a tied parameter takes no step only when no holder had a
    gradient for it."""
    for stages, ts in tie_sets(tied).items():
        ranks = [r for r in sorted(totals) if r[0] in stages]
        seg = _sum([workers[r].segment(locals_[r], [t.names[r[0]] for t in ts], flags=True)
                    for r in ranks])
        for r in ranks:
            workers[r].put_segment(totals[r], [t.names[r[0]] for t in ts], seg,  # type: ignore
                                   flags=True)


class ReferenceExecutor:
    """Carry out ``schedule`` for ``stages`` in one process (docs/design-notes.md).

    ``vertical_sync``: every stage uses, for minibatch k, the weight version the input stage used
    (PipeDream's vertical sync; needs equal replica counts). ``stashing=False`` is the ablation in
    which backwards use the latest weights. ``mitigation`` (pipedream only): see
    :mod:`fxpipe.runtime.replica.mitigation`; ``delays``: each stage's own-update delay, which the
    optimizer factory and the mitigations receive (default: the schedule's steady state, see
    :func:`fxpipe.runtime.schedules.staleness.own_delays`; give it when ``schedule`` is a
    placeholder).
    """

    def __init__(self, stages: Sequence[StageSpec], replicas: Sequence[int], schedule: Schedule,
                 loss_fn: LossFn, optimizer_factory: OptimizerFactory, *,
                 stashing: bool = True, vertical_sync: bool = False,
                 mitigation: Mitigation | str | None = None,
                 delays: Sequence[int] | None = None,
                 options: StepOptions = DEFAULT,
                 device: torch.device | str | None = None) -> None:
        self.stages = list(stages)
        self.options = options
        # every replica's weights on one device (the one-GPU check: the same arithmetic on
        # CUDA as on the CPU); model inputs and targets are copied there. None: the CPU.
        self.device = torch.device(device) if device is not None else None
        self.replicas = list(replicas)
        self.schedule = schedule.with_vertical_sync() if vertical_sync else schedule
        check_schedule(self.stages, self.replicas, self.schedule)
        self.mitigation = Mitigation.parse(mitigation)
        self.delays = list(delays) if delays is not None else (
            own_delays(schedule.kind, self.replicas, vertical_sync=vertical_sync,
                       microbatches=schedule.group if schedule.kind != "pipedream" else None,
                       noam=schedule.noam if schedule.kind in STREAM_KINDS else None)
            if schedule.kind in SCHEDULE_KINDS else [0] * len(self.stages))
        check_mitigation(self.mitigation, kind=schedule.kind, stashing=stashing,
                         vertical_sync=vertical_sync, stages=self.stages, delays=self.delays)
        last = len(self.stages) - 1
        detached = detached_values(self.stages)  # no gradient flows back along these
        self.workers: dict[Rank, StageReplica] = {
            rank: make_replica(self.stages[rank[0]], optimizer_factory,
                               delay=self.delays[rank[0]], mitigation=self.mitigation,
                               depth=len(self.stages),
                               loss_fn=loss_fn if rank[0] == last else None, stashing=stashing,
                               planned_reads=planned_reads(self.schedule, rank),
                               model_input_grads=False,  # dropped below: not computed
                               detached=detached, device=self.device,
                               **options.replica_kwargs(rank[0]))
            for rank in self.schedule.ranks}
        self.tied = tied_parameters(self.stages)
        self._sync = sync_components(self.tied)
        self._global = False  # set per run (see _configure_clipping)
        # what a stretch has in flight between its windows (see run_window)
        self._data: dict[int, Batch] = {}  # minibatch -> (inputs, target), until forwarded
        self._envs: dict[int, dict[str, Any]] = {}  # minibatch -> its model inputs by name
        self._acts: dict[tuple[str, int, int], torch.Tensor] = {}  # (value, k, consumer stage)
        self._grads: dict[tuple[str, int, int], torch.Tensor] = {}  # (value, k, consumer stage)
        self._pending: dict[tuple[int, int], list[Rank]] = {}  # an update's ranks so far
        self.last_losses: dict[int, float] = {}
        # delayed tied rounds (see tied_delay): (tie set, round) -> rank -> (local segment,
        # that rank's stage count of the round)
        self._rounds: dict[tuple[tuple[int, ...], int], dict[Rank, tuple[torch.Tensor, float]]] = {}

    def _input(self, x: Any) -> Any:
        """A model input or target on the replicas' device (as it is where none was named)."""
        return x if self.device is None else to_device(x, self.device)

    def step(self, inputs: Sequence[Any], targets: Sequence[Any]) -> RunResult:
        """Train on one sequence of minibatches (``inputs[k]``, ``targets[k]``)."""
        return self.run(list(zip(inputs, targets)))

    def run(self, batches: Sequence[Batch]) -> RunResult:
        """Run the whole schedule on ``batches`` (one per minibatch); weights carry over between
        runs, weight versions restart at 0."""
        check_schedule(self.stages, self.replicas, self.schedule, len(batches))
        return self.run_window(self.schedule, batches)

    def run_window(self, sched: Schedule, batches: Sequence[Batch], *,
                   collect_params: bool = True) -> RunResult:
        """Run ``sched``: a complete schedule, or a window of a stretch
        (:class:`~fxpipe.runtime.schedules.stream.Window`; ``batches`` are its new minibatches
        ``[start, stop)``), in its execution order. Activations, gradients, stashed versions
        and tied rounds in flight carry over to the stretch's next window. ``losses`` of the
        result: those of the minibatches whose forward reached the last stage in this run, in
        minibatch order (:attr:`last_losses` has them by minibatch). ``collect_params``: copy
        the latest weights into the result (the trainer does not: a copy of the whole model
        per segment)."""
        start, final = getattr(sched, "start", 0), getattr(sched, "final", True)
        if start == 0:
            self._begin(sched)
        self.schedule = sched
        for rank, w in self.workers.items():
            prepare_window(w, sched, rank)
        self._data.update((start + k, b) for k, b in enumerate(batches))
        order = (sched.order if isinstance(sched, Window)
                 else execution_order(sched, self._sync, self._delay))
        losses: dict[int, torch.Tensor] = {}
        recs = {rank: Recorder(args={"stage": rank[0], "replica": rank[1]})
                for rank in self._index}
        last = len(self.stages) - 1
        for rank, i in order:
            a = sched.actions[rank][i]
            s, st, w = rank[0], self.stages[rank[0]], self.workers[rank]
            k = a.minibatch
            t0 = recs[rank].now()
            if a.kind == "F":
                if k not in self._envs:
                    self._envs[k] = model_env(self.stages, self._data[k][0])
                ins = [self._input(self._envs[k][n]) if src == MODEL
                       else self._acts.pop((n, k, s)) for n, src in zip(st.inputs, st.sources)]
                outs, loss = w.forward(k, a.version, ins, self._input(self._data[k][1]))
                if loss is not None:
                    losses[k] = loss
                if s == last:  # every stage forwarded it: its inputs are no longer needed
                    del self._envs[k], self._data[k]
                recs[rank].add("forward", str(a), t0, recs[rank].now(), minibatch=k,
                               version=a.version)
                for n, o, cons in zip(st.outputs, outs, st.consumers):
                    for c in cons:
                        if c != MODEL:
                            self._acts[(n, k, c)] = o
            elif a.kind == "B":
                out_grads = [_sum([self._grads.pop((n, k, c), None) for c in cons if c != MODEL])
                             for n, cons in zip(st.outputs, st.consumers)]
                in_grads = w.backward(k, out_grads, split=rank in self._split)
                recs[rank].add("backward", str(a), t0, recs[rank].now(), minibatch=k,
                               version=a.version)
                for n, src, g in zip(st.inputs, st.sources, in_grads):
                    if src != MODEL and g is not None:
                        self._grads[(n, k, s)] = g
            elif a.kind == "W":
                w.backward_weight(k)
                recs[rank].add("backward", str(a), t0, recs[rank].now(), minibatch=k,
                               version=a.version)
            else:
                comp = next((c for c in self._sync if s in c), (s,)) if self._delay == 0 else (s,)
                group = self._pending.setdefault((comp[0], k), [])
                group.append(rank)
                if len(group) == sum(self.replicas[t] for t in comp):
                    self._update(group, recs, k)
                    del self._pending[(comp[0], k)]
        if final:
            if self._acts or self._grads:
                log.warning("undelivered tensors at the end: %s",
                            sorted(self._acts) + sorted(self._grads))
            self._acts.clear()
            self._grads.clear()
            self._envs.clear()
            self._data.clear()
            self._finish_tied_rounds()
        timeline = {self._index[r]: rec.finish() for r, rec in recs.items()}
        keys = sorted(losses)
        values = ([float(v) for v in torch.stack([losses[k] for k in keys]).tolist()]
                  if keys else [])
        self.last_losses = dict(zip(keys, values))
        return self.result(values, timeline, collect_params=collect_params)

    def _begin(self, sched: Schedule) -> None:
        """A new stretch (nothing in flight): its clipping, tied delay and order."""
        self._configure_clipping(sched.kind)
        self._delay = tied_delay(sched, self.tied)
        self._rounds.clear()
        self._pending.clear()
        self._split = split_ranks(sched)
        self._index = {rank: i for i, rank in enumerate(sched.ranks)}

    def _configure_clipping(self, kind: str) -> None:
        """Gradient clipping for ``kind`` (see :mod:`fxpipe.runtime.replica.clipping`): the global
        norm (and fp16 loss scaling's global inf check) puts every stage's updates together
        (``self._sync``) and is applied in :meth:`_update`; the stage scope lives in each
        replica."""
        base = sync_components(self.tied)
        self._sync = self.options.sync(kind, len(self.stages), base)
        self._global = self.options.global_step(kind)
        for r, w in self.workers.items():
            w.clip, w.clip_local = None, True
            if self.options.scope(kind) == "stage":
                w.clip = stage_clipper(self.options.clip_grad_norm,  # type: ignore[arg-type]
                                       w.stash.trainable,
                                       [t.names[r[0]] for t in self.tied if r[0] in t.names])

    def _update(self, ranks: list[Rank], recs: dict[Rank, Recorder], i: int) -> None:
        """Update ``i`` of every rank in ``ranks`` (all replicas of a set of stages updating
        together): replicas sum their gradients, tied parameters sum across stages (now, or
        ``self._delay`` rounds later: see :func:`tied_delay`). The buffers carry presence flags
        (:mod:`fxpipe.runtime.replica.stage_update`), as the distributed executor's do: a
        parameter none of the replicas had a gradient for takes no step."""
        t0 = {r: recs[r].now() for r in ranks}
        if (len(ranks) == 1 and not self._global
                and not any(ranks[0][0] in t.names for t in self.tied)):
            r = ranks[0]  # a lone untied replica: no flat buffer, as RankExecutor's update
            self.workers[r].apply_local_update()
            recs[r].add("optimizer", f"U{i}", t0[r], recs[r].now(), stage=r[0], replica=r[1],
                        update=i)
            return
        locals_ = {r: self.workers[r].local_gradient(flags=True) for r in sorted(ranks)}
        totals = {r: _sum([locals_[q] for q in sorted(ranks) if q[0] == r[0]]).clone()
                  for r in ranks}  # type: ignore[union-attr]
        if self._delay == 0:
            tied_update(totals, locals_, self.workers, self.tied)
        if self._global:  # every rank of the pipeline is in ``ranks`` (see _sync)
            grads = {r: self.workers[r].update_grads(totals[r], flags=True)
                     for r in sorted(ranks)}
            for r, g in reference_step(grads, self.workers, self.tied,
                                       self.options.clip_grad_norm).items():
                self.workers[r].step(g)
                recs[r].add("optimizer", f"U{i}", t0[r], recs[r].now(), stage=r[0],
                            replica=r[1], update=i)
            return
        for r in sorted(ranks):
            late = self._delayed_round(r, i, locals_[r], float(totals[r][-1]))
            self.workers[r].apply_update(totals[r], late, flags=True)
            recs[r].add("optimizer", f"U{i}", t0[r], recs[r].now(), stage=r[0], replica=r[1],
                        update=i)

    def _delayed_round(self, r: Rank, i: int, local: torch.Tensor, count: float
                       ) -> dict[str, torch.Tensor | None] | None:
        """Delayed tied rounds: remember rank r's local tied sums of round i; return the mean
        tied gradients of round ``i - delay`` (None values before the first one)."""
        if self._delay == 0:
            return None
        w = self.workers[r]
        out: dict[str, torch.Tensor | None] = {}
        for key, ts in tie_sets(self.tied).items():
            if r[0] not in key:
                continue
            names = [t.names[r[0]] for t in ts]
            self._rounds.setdefault((key, i), {})[r] = (w.segment(local, names, flags=True),
                                                        count)
            out.update(self._round_grads(r, key, names, i - self._delay))
        return out

    def _round_grads(self, r: Rank, key: tuple[int, ...], names: list[str], j: int
                     ) -> dict[str, torch.Tensor | None]:
        """Rank r's mean gradients of tied round j: the sum over every holder (rank order) of
        their local sums, divided by r's own count of that round."""
        if j < 0:
            return {n: None for n in names}
        got = self._rounds[(key, j)]
        total = _sum([got[q][0] for q in sorted(got)])
        assert total is not None
        count = got[r][1]
        mean = total / count if count > 0 and count != 1 else total  # flags stay > 0 or 0
        return self.workers[r].split_segment(mean, names, flags=True)

    def _finish_tied_rounds(self) -> None:
        """Segment end: apply the last ``delay`` tied rounds (tied-only steps, in order)."""
        if self._delay == 0:
            return
        for r, w in sorted(self.workers.items()):
            done = w.stash.version  # updates made this run (versions restart at 0 each run)
            sets = [(key, [t.names[r[0]] for t in ts]) for key, ts in tie_sets(self.tied).items()
                    if r[0] in key]
            for j in range(max(0, done - self._delay), done) if sets else ():
                grads: dict[str, torch.Tensor | None] = {}
                for key, names in sets:
                    grads.update(self._round_grads(r, key, names, j))
                w.apply_tied_only({n: g for n, g in grads.items() if g is not None})
        self._rounds.clear()

    def result(self, losses: list[float],
               timeline: dict[int, list[TimelineEvent]] | None = None, *,
               collect_params: bool = True) -> RunResult:
        """Package the current state (see :class:`RunResult`); ``collect_params``: copy every
        replica's latest weights into it (the trainer does not: it reads the replicas)."""
        if not collect_params:
            return RunResult(losses, [], {}, {rank: w.stash.peak_bytes
                                              for rank, w in self.workers.items()},
                             dict(timeline or {}))
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
