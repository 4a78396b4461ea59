"""A process hosting several stages (interleaved-1f1b, zb-v): one :class:`RankExecutor` per stage.

The process walks its merged list, handing each action to its rank's executor; messages between
its own stages go through a local mailbox, the rest through Comm in one process-level order.
"""
from __future__ import annotations

import logging
from typing import Any, Sequence

import torch

from fxpipe.codegen.split import StageSpec

from ..errors import RuntimeConfigError
from ..replica.stage import LossFn, tied_parameters
from ..replica.stash import OptimizerFactory
from ..replica.step_options import DEFAULT, StepOptions
from ..schedules.commplan import FORWARD, Msg
from ..schedules.hosted_plan import ProcessIssuer, process_ops, rank_plans
from ..schedules.placement import PlacedSchedule
from ..schedules.schedule import Action, Rank, split_ranks
from ..timeline import Recorder
from .buckets import last_backwards
from .comm import Comm, _Pending
from .contract import Batch
from .executor import ActionHook, RankExecutor, RankResult
from .wire import WirePlan

log = logging.getLogger(__name__)

_MAX_TAG = 2**31 - 1
MailKey = tuple[Rank, Rank, int, int, int]  # (sender, receiver, direction, minibatch, value)


class _Local:
    """A receive whose sender is on this process: its tensor is in the mailbox."""


LOCAL = _Local()


def check_hostable(stages: Sequence[StageSpec], placed: PlacedSchedule, device: str,
                   options: StepOptions) -> None:
    """Refuse what the hosted runtime does not do, naming it and what to use instead."""
    if len(stages) != placed.schedule.num_stages:
        raise RuntimeConfigError(f"{len(stages)} stages for a {placed.kind} schedule of "
                                 f"{placed.schedule.num_stages}",
                                 "split the model into as many stages as the schedule places")
    if device != "cpu":
        raise RuntimeConfigError(f"{placed.kind} on device {device!r}",
                                 "processes hosting several stages run on gloo (cpu) only: the "
                                 "hosted launcher has no NCCL path yet (its message order "
                                 "passes the NCCL checker)")
    tied = tied_parameters(stages)
    if tied:
        raise RuntimeConfigError(f"{placed.kind} with parameters tied across stages "
                                 f"{[list(t.stages) for t in tied]}",
                                 "untie them, or use 1f1b-flush / zb-h2 (one stage per process)")
    if options.global_group:
        raise RuntimeConfigError(f"{placed.kind} with global gradient clipping or fp16 loss "
                                 "scaling", "use them with one stage per process (1f1b-flush, "
                                 "zb-h1, zb-h2)")


class HostedRankExecutor(RankExecutor):
    """A :class:`RankExecutor` that shares its process with other ranks: messages to them go
    through ``mailbox`` (docs/design-notes.md), tags name the consumer stage."""

    def __init__(self, *args: Any, local: frozenset[Rank], mailbox: dict[MailKey, torch.Tensor],
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.local = local
        self.mailbox = mailbox

    def _tag(self, m: Msg) -> int:
        """Comm's tag times the number of stages plus the consumer stage: unique per pair of
        processes even when two hosted stages exchange the same value of a minibatch."""
        consumer = m.peer[0] if m.send == (m.direction == FORWARD) else self.me[0]
        t = self.comm.tag(m.minibatch, m.value, m.direction) * len(self.stages) + consumer
        if t > _MAX_TAG:
            raise RuntimeConfigError(f"message tag {t} overflows int32 (minibatch "
                                     f"{m.minibatch})", "run fewer minibatches per schedule")
        return t

    def _key(self, m: Msg) -> MailKey:
        return ((self.me, m.peer) if m.send else (m.peer, self.me)) + \
            (m.direction, m.minibatch, m.value)

    def _post_recv(self, m: Msg) -> None:
        if m.peer in self.local:
            self._inbox[m] = LOCAL  # type: ignore[assignment]
            return
        spec = self.wire.spec(m.name, m.minibatch)
        self._inbox[m] = self.comm.post_recv(spec, m.peer, self._tag(m), m.describe(),
                                             m.direction)

    def _post_send(self, m: Msg) -> None:
        t = self._out.get(m.name)
        if t is None:
            raise RuntimeError(f"{self.comm.who}: no {m.describe()} to send (a bug)")
        if m.peer in self.local:  # a copy: the consumer's graph must not share the producer's
            self.mailbox[self._key(m)] = t.detach().clone()
            return
        self.comm.send(t, m.peer, self._tag(m), m.describe(), self.wire.spec(m.name, m.minibatch),
                       m.direction)

    def _received(self, msgs: Sequence[Msg]) -> dict[Msg, torch.Tensor]:
        self._issuer.require([m for m in msgs if m.peer not in self.local], self._inbox)
        out: dict[Msg, torch.Tensor] = {}
        for m in msgs:
            pend = LOCAL if m.peer in self.local else self._inbox.pop(m)
            if pend is LOCAL:
                key = self._key(m)
                if key not in self.mailbox:
                    raise RuntimeError(f"{self.comm.who}: {m.describe()} from co-located "
                                       f"{m.peer} is not in the mailbox (a bug in the merged "
                                       "order)")
                out[m] = self.mailbox.pop(key)
            else:
                assert isinstance(pend, _Pending)
                out[m] = self.comm.wait(pend)
        return out


class _Require:
    """What a hosted rank's ``_received`` calls: the process issuer's check, for rank r."""

    def __init__(self, issuer: ProcessIssuer, r: Rank) -> None:
        self.issuer, self.r = issuer, r

    def require(self, msgs: Sequence[Msg], posted: Any) -> None:
        self.issuer.require(self.r, msgs)


class ProcessExecutor:
    """Carry out process ``index``'s merged list of ``placed`` (docs/design-notes.md)."""

    def __init__(self, stages: Sequence[StageSpec], placed: PlacedSchedule, index: int,
                 loss_fn: LossFn, optimizer_factory: OptimizerFactory, wire: WirePlan,
                 rank_of: dict[Rank, int], timeout_s: float, t0: float, *,
                 groups: dict[Any, Any] | None = None, device: torch.device | None = None,
                 options: StepOptions = DEFAULT, before_action: ActionHook | None = None,
                 record_comm: bool = False) -> None:
        self.placed = placed
        self.log: list[tuple] | None = [] if record_comm else None
        self.before_action = before_action  # called with (index in the merged list, action)
        self.index = index
        self.hosts = placed.hosts[index]
        self.mailbox: dict[MailKey, torch.Tensor] = {}
        local = frozenset(self.hosts)
        self.executors: dict[Rank, HostedRankExecutor] = {}
        for r in self.hosts:
            rec = Recorder(t0, args={"stage": r[0], "replica": r[1], "rank": index})
            comm = Comm(r, rank_of, len(wire.values), timeout_s, device or torch.device("cpu"),
                        groups or {}, recorder=rec, record=record_comm)
            if self.log is not None:  # one log per process: its host calls in call order
                comm.log = self.log
            self.executors[r] = HostedRankExecutor(
                stages, placed.schedule, r, loss_fn, optimizer_factory, wire, comm,
                device=device, recorder=rec, overlap_allreduce=False, options=options,
                local=local, mailbox=self.mailbox)

    def run(self, batches: Sequence[Batch]) -> dict[Rank, RankResult]:
        """Walk the merged list; then wait for every send and for all processes to finish."""
        sched = self.placed.schedule
        split = split_ranks(sched)
        losses: dict[Rank, dict[int, torch.Tensor]] = {r: {} for r in self.hosts}
        first = next(iter(self.executors.values()))
        plans = rank_plans(self.placed, first.links,
                           {n: i for i, n in enumerate(first.wire.values)}, first._grad_ok,
                           self.hosts)
        issuer = ProcessIssuer(process_ops(self.placed, plans, self.index),
                               lambda r, m: self.executors[r]._post_recv(m),
                               lambda r, m: self.executors[r]._post_send(m))
        for r, ex in self.executors.items():
            ex._delay = 0
            ex._configure(sched.kind)
            ex._final_b = last_backwards([a.kind for a in sched.actions[r]])
            ex._inbox.clear()
            ex._split = r in split
            ex._issuer = _Require(issuer, r)  # type: ignore[assignment]
        self.mailbox.clear()
        issuer.start()
        pos = {r: 0 for r in self.hosts}
        for step, (r, a) in enumerate(self.placed.order[self.index]):
            ex, i = self.executors[r], pos[r]
            if self.before_action is not None:
                self.before_action(step, a)
            pos[r] += 1
            self._step(ex, a, i, plans[r], batches, losses[r])
            for m in plans[r].sends[i]:
                if m.peer in ex.local:
                    ex._post_send(m)  # the mailbox
                else:
                    issuer.send(r, m)
        assert issuer.done and not any(ex._inbox for ex in self.executors.values()), \
            "every planned message was posted and used"
        if self.mailbox:
            raise RuntimeError(f"process {self.index}: undelivered local messages "
                               f"{sorted(self.mailbox)} (a bug in the plan)")
        for ex in self.executors.values():
            ex.comm.flush()
        next(iter(self.executors.values())).comm.barrier()  # one per process
        out: dict[Rank, RankResult] = {}
        for r, ex in self.executors.items():
            keys = sorted(losses[r])
            values = torch.stack([losses[r][k] for k in keys]).tolist() if keys else []
            out[r] = RankResult(dict(zip(keys, map(float, values))),
                                {n: t.detach().cpu() for n, t in ex.replica.parameters().items()},
                                ex.replica.stash.peak_bytes, ex._take_timeline(),
                                comm_log=None if self.log is None else list(self.log))
        return out

    @staticmethod
    def _step(ex: HostedRankExecutor, a: Action, i: int, plan: Any, batches: Sequence[Batch],
              losses: dict[int, torch.Tensor]) -> None:
        """Action i of rank ``ex.me``, as :meth:`RankExecutor.run` carries it out."""
        if a.kind == "F":
            loss = ex.forward(a, batches[a.minibatch], plan.recvs[i])
            if loss is not None:
                losses[a.minibatch] = loss
        elif a.kind == "B":
            ex.backward(a, plan.recvs[i])
        elif a.kind == "W":
            ex.weight(a)
        else:
            ex.update(a)
