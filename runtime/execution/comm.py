"""Every send, receive and collective of the runtime, posted in one place so its rules hold for all.

Every wait is bounded (a dead or hung peer becomes a :class:`PeerError`), buffers are preallocated
from known shapes, nothing is pickled; when to post is :mod:`fxpipe.runtime.schedules.commplan`'s.
"""
from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Mapping, Sequence

import torch
import torch.distributed as dist

from ..errors import PeerError, RuntimeConfigError
from ..schedules.commplan import CHANNELS
from ..schedules.schedule import Rank
from ..timeline import Recorder, TimelineEvent

log = logging.getLogger(__name__)

_MAX_TAG = 2**31 - 1
GroupKey = int | tuple[int, ...] | str  # a stage, a tied set, or a named world group
"""A stage (its replicas' group) or a sorted tuple of stages (all ranks sharing tied weights)."""


@dataclass(frozen=True)
class TensorSpec:
    """Shape and dtype of a tensor on the wire (known ahead by both ends)."""

    shape: tuple[int, ...]
    dtype: torch.dtype


def rank_name(rank: Rank, index: int) -> str:
    return f"stage {rank[0]} replica {rank[1]} (rank {index})"


@dataclass
class _Pending:
    work: Any
    tensor: torch.Tensor
    peer: Rank
    what: str
    name: str = ""  # short label for the timeline ("act h F3")
    launched: float = 0.0  # asynchronous all-reduces: posting time on the rank's clock
    completed: float | None = None  # ... and completion, stamped by the work's future
    ref: Any = None  # what the recorded log calls it (p2p op number, or (group, seq))
    tag: int = -1  # point-to-point messages: the tag


class Comm:
    """The transport of one rank: ``rank_of`` maps every (stage, replica) to its global rank."""

    def __init__(self, me: Rank, rank_of: Mapping[Rank, int], num_values: int,
                 timeout_s: float, device: torch.device,
                 groups: Mapping[GroupKey, Any] | None = None, *,
                 recorder: Recorder | None = None, record: bool = False) -> None:
        self.me = me
        self.rank_of = dict(rank_of)
        self.num_values = max(num_values, 1)
        self.timeout = timedelta(seconds=timeout_s)
        self.device = device
        self.groups = dict(groups or {})
        self.recorder = recorder or Recorder(enabled=False)
        self._sends: dict[tuple[Rank, int], _Pending] = {}  # (destination, tag) -> posted
        self.log: list[tuple] | None = [] if record else None
        """Every host call when recording (see commplan's log format), for the NCCL checker."""
        self._seq: dict[str, int] = {}
        self.background: list[TimelineEvent] = []
        """Asynchronous all-reduces, launch -> completion per bucket. Kept apart from the
        recorder's events because they overlap the backward, and a rank's timeline events never
        overlap (see :mod:`fxpipe.runtime.timeline`); merge them into a trace to see them."""

    @property
    def who(self) -> str:
        return rank_name(self.me, self.rank_of[self.me])

    def tag(self, minibatch: int, value: int, direction: int) -> int:
        t = (minibatch * self.num_values + value) * 2 + direction
        if t > _MAX_TAG:
            raise RuntimeConfigError(f"message tag {t} overflows int32 (minibatch {minibatch})",
                                     "run fewer minibatches per schedule")
        return t

    def _fail(self, pend: _Pending, err: BaseException) -> PeerError:
        peer = rank_name(pend.peer, self.rank_of[pend.peer])
        return PeerError(f"{self.who}: {pend.what} with {peer} failed "
                         f"(timeout {self.timeout.total_seconds():g} s): {err}",
                         f"look at the log of {peer}: it crashed, hung or fell behind; raise "
                         "timeout_s if it is merely slow")

    def _record(self, *event: Any) -> int:
        if self.log is None:
            return -1
        self.log.append(event)
        return len(self.log) - 1

    # ------------------------------------------------------------------ point to point
    # One operation per call, never batched: an NCCL group completes as a whole, so batching a
    # send with receives would tie the send to data the peer may post much later. The ORDER of
    # the calls is what makes them safe (see fxpipe.runtime.schedules.commplan).
    def post_recv(self, spec: TensorSpec, src: Rank, tag: int, what: str,
                  direction: int | None = None) -> _Pending:
        """Post a receive into a fresh buffer of ``spec``; :meth:`wait` returns the tensor.
        ``direction`` (FORWARD, BACKWARD) picks the channel; default: the tag's (:meth:`tag`)."""
        buf = torch.empty(spec.shape, dtype=spec.dtype, device=self.device)
        pend = _Pending(None, buf, src, f"receiving {what}", what,
                        launched=self.recorder.now() if self.recorder.enabled else 0.0)
        pend.tag = tag
        channel = CHANNELS[tag % 2 if direction is None else direction]
        self._post(pend, False, channel, self.groups.get(channel))
        return pend

    def _post(self, pend: _Pending, is_send: bool, channel: str, group: Any) -> None:
        """Record (for the NCCL checker) and post one point-to-point op: ``pend``'s tensor to or
        from its peer, with its tag, on ``channel``'s process ``group``."""
        t, peer = pend.tensor, self.rank_of[pend.peer]
        pend.ref = self._record("p2p", len(self.log or ()), ((is_send, peer, pend.tag,
                                                               tuple(t.shape), str(t.dtype)),),
                                channel)
        try:
            pend.work = (dist.isend(t, dst=peer, tag=pend.tag, group=group) if is_send else
                         dist.irecv(t, src=peer, tag=pend.tag, group=group))
        except RuntimeError as err:
            raise self._fail(pend, err) from err

    def wait(self, pend: _Pending) -> torch.Tensor:
        """Wait (at most the timeout) for a posted receive; the wait is a ``recv`` event whose
        args say when the receive was posted and which message it is (``src`` global rank,
        ``tag``), so :func:`fxpipe.runtime.timeline.wait_breakdown` can tell waiting for the
        peer's compute from waiting for a transfer that started late."""
        self._record("wait", pend.ref)
        with self.recorder.span("recv", f"recv {pend.name}", peer=str(pend.peer),
                                src=self.rank_of[pend.peer], tag=pend.tag,
                                posted=round(pend.launched, 7)):
            try:
                pend.work.wait(timeout=self.timeout)
            except RuntimeError as err:
                raise self._fail(pend, err) from err
        return pend.tensor

    def send(self, tensor: torch.Tensor, dst: Rank, tag: int, what: str,
             spec: TensorSpec | None = None, direction: int | None = None) -> tuple[int, int]:
        """Post a send; it completes when the peer receives it, and its tensor is kept until
        :meth:`complete` (the schedule proves it received) or :meth:`flush`. Not a
        timeline event of its own: the caller records the posting of an action's messages,
        with the (destination global rank, tag) pairs this returns."""
        t = tensor.detach().contiguous()
        if spec is not None and (tuple(t.shape) != spec.shape or t.dtype != spec.dtype):
            raise RuntimeConfigError(f"{self.who}: {what} is {tuple(t.shape)} {t.dtype}, the "
                                     f"wire plan says {spec.shape} {spec.dtype}",
                                     "the stage output shape depends on more than the input "
                                     "shapes; such models cannot be pipelined as is")
        pend = _Pending(None, t, dst, f"sending {what}", what, tag=tag)
        channel = CHANNELS[tag % 2 if direction is None else direction]
        self._post(pend, True, channel, self.groups.get(channel))
        if (dst, tag) in self._sends:
            raise RuntimeError(f"{self.who}: {what} sent twice with tag {tag} (a bug)")
        self._sends[(dst, tag)] = pend
        return self.rank_of[dst], tag

    def complete(self, dst: Rank, tag: int) -> None:
        """The send to ``dst`` with ``tag`` is known to have been received (the schedule proves
        it: :mod:`fxpipe.runtime.schedules.proofs`): wait for it (at once) and let its tensor go,
        rather than at the stretch's final :meth:`flush`. Gloo needs this: its sends never say
        they are completed before they are waited for (NCCL's do, but one rule for both keeps
        the recorded waits, which the NCCL checker replays, the same on both)."""
        pend = self._sends.pop((dst, tag), None)
        if pend is None:
            raise RuntimeError(f"{self.who}: the send to {dst} with tag {tag} is proven "
                               "received but was never posted (a bug in the proofs)")
        self._record("wait", pend.ref)  # the NCCL checker replays it: it must not block
        try:
            pend.work.wait(timeout=self.timeout)
        except RuntimeError as err:
            raise self._fail(pend, err) from err

    def flush(self) -> None:
        """Wait until every posted send was received (each wait bounded by the timeout)."""
        self._record("flush")
        for pend in self._sends.values():
            try:
                pend.work.wait(timeout=self.timeout)
            except RuntimeError as err:
                raise self._fail(pend, err) from err
        self._sends.clear()

    # ------------------------------------------------------------------ collectives
    def _among(self, stage: GroupKey, peers: Sequence[Rank]) -> str:
        if isinstance(stage, str):
            return f"all {len(peers)} ranks ({stage})"
        return (f"{len(peers)} replicas of stage {stage}" if isinstance(stage, int)
                else f"{len(peers)} ranks of stages {list(stage)} (tied parameters)")

    def _collective(self, buf: torch.Tensor, stage: GroupKey, peers: Sequence[Rank],
                    what: str) -> _Pending:
        """A pending collective naming its group (and a peer of it) for failure messages."""
        pend = _Pending(None, buf, peers[0] if peers[0] != self.me else peers[-1],
                        f"all-reduce of {what} among {self._among(stage, peers)}", what)
        if self.log is not None:
            key = str(stage)
            seq = self._seq[key] = self._seq.get(key, -1) + 1
            pend.ref = (key, seq)
            self._record("coll", key, seq, tuple(sorted(self.rank_of[p] for p in peers)),
                         buf.numel())
        return pend

    def all_reduce(self, buf: torch.Tensor, stage: GroupKey, peers: Sequence[Rank],
                   what: str) -> None:
        """Sum ``buf`` in place over the group ``stage``: the replicas of one stage, or (a tuple
        of stages) every rank holding a tied parameter of exactly those stages."""
        pend = self._collective(buf, stage, peers, what)
        with self.recorder.span("allreduce", f"allreduce {what}", group=str(stage)):
            try:
                pend.work = dist.all_reduce(buf, group=self.groups[stage], async_op=True)
                if pend.ref is not None:
                    self._record("cwait", *pend.ref)
                pend.work.wait(timeout=self.timeout)
            except RuntimeError as err:
                raise self._fail(pend, err) from err

    def all_reduce_async(self, buf: torch.Tensor, stage: GroupKey, peers: Sequence[Rank],
                         what: str) -> _Pending:
        """Post an in-place sum of ``buf`` over the group ``stage`` and return at once (a
        gradient bucket, from a hook in the middle of the backward); complete it with
        :meth:`wait_all_reduces`. Posting order must be the same on every rank of the group."""
        pend = self._collective(buf, stage, peers, what)
        pend.launched = self.recorder.now()
        try:
            pend.work = dist.all_reduce(buf, group=self.groups[stage], async_op=True)
        except RuntimeError as err:
            raise self._fail(pend, err) from err
        try:  # completion time for the timeline, stamped by whichever thread completes it
            pend.work.get_future().add_done_callback(
                lambda _fut: setattr(pend, "completed", self.recorder.now()))
        except (RuntimeError, AttributeError):  # a backend without futures: stamped at wait
            pass
        return pend

    def wait_all_reduces(self, pends: Sequence[_Pending], name: str, **args: Any) -> None:
        """Wait, in posting order, for asynchronous all-reduces (each wait at most the timeout;
        a failure names the group). The blocking part is one ``allreduce`` event (its args hold
        each bucket's launch and completion times); each bucket's launch -> completion interval
        goes to :attr:`background`."""
        start = self.recorder.now()
        for pend in pends:
            if pend.ref is not None:
                self._record("cwait", *pend.ref)
            try:
                pend.work.wait(timeout=self.timeout)
            except RuntimeError as err:
                raise self._fail(pend, err) from err
        end = self.recorder.now()
        done = [end if p.completed is None else min(p.completed, end) for p in pends]
        launched = [p.launched for p in pends]
        self.recorder.add("allreduce", name, start, end, buckets=len(pends),
                          launched=[round(t, 6) for t in launched],
                          completed=[round(t, 6) for t in done], **args)
        if self.recorder.enabled:
            base = {**self.recorder.base_args, **args}
            self.background.extend(
                TimelineEvent("allreduce", f"allreduce {p.name}", t0, t1,
                              {**base, "bucket": i, "numel": p.tensor.numel(), "async": True})
                for i, (p, t0, t1) in enumerate(zip(pends, launched, done)))

    # ------------------------------------------------------------------ a tie of two ranks
    # The sum of a tied parameter held by exactly two ranks, as two messages instead of an
    # all-reduce: each rank sends its part once it has it, and receives the other's on a
    # receive posted long before (its update's start), so the part that is ready first crosses
    # the link while the other rank still computes. Each direction is a channel of its own
    # (:func:`tied_channel`): one sender, one receiver, messages in update order, so NCCL's
    # rules hold whatever else is in flight. Not in :attr:`_sends`: the caller waits for each.
    def tied_recv(self, spec: TensorSpec, src: Rank, tag: int, what: str) -> _Pending:
        """Post the receive of ``src``'s part of a tied sum (see above)."""
        channel = tied_channel(self.rank_of[src], self.rank_of[self.me])
        buf = torch.empty(spec.shape, dtype=spec.dtype, device=self.device)
        pend = _Pending(None, buf, src, f"receiving {what}", what, tag=tag)
        self._post(pend, False, channel, self.groups[channel])
        return pend

    def tied_send(self, tensor: torch.Tensor, dst: Rank, tag: int, what: str) -> _Pending:
        """Post the send of this rank's part of a tied sum to ``dst``; ``tensor`` must stay
        untouched until :meth:`tied_wait` of the returned send."""
        channel = tied_channel(self.rank_of[self.me], self.rank_of[dst])
        pend = _Pending(None, tensor, dst, f"sending {what}", what, tag=tag)
        self._post(pend, True, channel, self.groups[channel])
        return pend

    def tied_wait(self, pend: _Pending, *, span: bool = True) -> torch.Tensor:
        """Wait (at most the timeout) for a tied part's receive (an ``allreduce`` event, as the
        all-reduce it stands for was) or, ``span=False``, its send."""
        self._record("wait", pend.ref)
        with (self.recorder.span("allreduce", f"allreduce {pend.name}", group="tied pair")
              if span else contextlib.nullcontext()):
            try:
                pend.work.wait(timeout=self.timeout)
            except RuntimeError as err:
                raise self._fail(pend, err) from err
        return pend.tensor

    def barrier(self) -> None:
        """All ranks: the end of a run (no rank leaves while a peer may still talk to it)."""
        pend = _Pending(None, torch.empty(0), self.me, "final barrier")
        if self.log is not None:
            seq = self._seq["world"] = self._seq.get("world", -1) + 1
            self._record("coll", "world", seq, tuple(sorted(self.rank_of.values())), 0)
            self._record("cwait", "world", seq)
        try:
            dist.barrier(async_op=True).wait(timeout=self.timeout)
        except RuntimeError as err:
            raise self._fail(pend, err) from err


def tied_channel(src: int, dst: int) -> str:
    """The channel (a process group of the two ranks) that carries the parts of a tied sum
    from global rank ``src`` to ``dst``."""
    return f"tied {src}->{dst}"


def make_groups(replicas: Sequence[int], rank_of: Mapping[Rank, int],
                tie_stage_sets: Sequence[tuple[int, ...]], timeout_s: float,
                extra: Sequence[str] = ()) -> dict[GroupKey, Any]:
    """Create the process groups of a run: one per replicated stage (its replicas) and one per
    set of stages sharing tied parameters (every replica of those stages: exactly the ranks that
    hold a copy). Every rank must call this with the same arguments, since ``new_group`` is
    collective over the world; the order is fixed (stages, then sorted tie sets)."""
    groups: dict[GroupKey, Any] = {}
    timeout = timedelta(seconds=timeout_s)
    for s, r in enumerate(replicas):
        if r > 1:
            groups[s] = dist.new_group([rank_of[(s, j)] for j in range(r)], timeout=timeout)
    for stages in sorted(tie_stage_sets):
        members = sorted(rank_of[(s, j)] for s in stages for j in range(replicas[s]))
        groups[tuple(stages)] = dist.new_group(members, timeout=timeout)
        log.debug("tied-parameter group of stages %s: ranks %s", list(stages), members)
        if len(members) == 2:  # a tie of two ranks: a channel each way (Comm.tied_send)
            for src, dst in (members, members[::-1]):
                groups[tied_channel(src, dst)] = dist.new_group(members, timeout=timeout)
    for name in (*extra, *CHANNELS.values()):  # every rank of the pipeline: the gradient
        # norm's all-reduce, and the two directions of point-to-point messages (see CHANNELS)
        groups[name] = dist.new_group(sorted(set(rank_of.values())), timeout=timeout)
    return groups


def synchronized_start(timeout_s: float) -> float:
    """Barrier over the world, then the local clock: the timeline's common origin (the ranks
    leave the barrier within a network latency of each other)."""
    dist.barrier(async_op=True).wait(timeout=timedelta(seconds=timeout_s))
    return time.perf_counter()
