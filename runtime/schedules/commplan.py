"""The order of every rank's point-to-point messages, as data (NCCL's rules: :mod:`.ncclcheck`).

NCCL pairs messages by issue order, not tag, so every rank issues its sends and receives in ONE
global order (:class:`StretchPlanner`), channel by channel (:class:`Issuer`), which cannot deadlock.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Sequence

from fxpipe.errors import FxpipeError

from .schedule import Action, Rank, execution_order, split_ranks
from .simulate import Clock

log = logging.getLogger(__name__)

MODEL = -1  # fxpipe.codegen.split.MODEL: a model input (as a source) or output (as a consumer)
FORWARD, BACKWARD = 0, 1
CHANNELS = {FORWARD: "activations", BACKWARD: "gradients"}
"""The channel (a world process group of its own) each direction's messages travel on."""
LEAD = 2.0
"""How early a receive is posted: once the rank's clock (its actions' start times in the plan's
timing) is within this many stage-minibatches (a forward and a backward of the slowest stage)
of the start of the action that sends it. Early enough that the sender finds the receive
posted when its data is ready; bounded, so a channel with nothing to send (stage 0's
gradients) does not post a whole segment's receive buffers at once."""


class CommOrderError(FxpipeError):
    """Recorded communication breaks NCCL's pairing rules or deadlocks under them."""


@dataclass(frozen=True)
class StageLinks:
    """The communication shape of one stage (a StageSpec without its graph)."""

    inputs: tuple[str, ...]
    sources: tuple[int, ...]
    outputs: tuple[str, ...]
    consumers: tuple[tuple[int, ...], ...]


def links_of(stages: Sequence[Any]) -> tuple[StageLinks, ...]:
    return tuple(StageLinks(tuple(st.inputs), tuple(st.sources), tuple(st.outputs),
                            tuple(tuple(c) for c in st.consumers)) for st in stages)


@dataclass(frozen=True, order=True)
class Msg:
    """One message as seen by one end: ``peer`` is the other end, ``send`` says which end we
    are. Ordered by (peer, direction, minibatch, value): the order inside a batch."""

    peer: Rank
    direction: int
    minibatch: int
    value: int  # index of ``name`` in the wire plan's values (part of the tag)
    name: str
    send: bool

    def describe(self) -> str:
        kind = "activation" if self.direction == FORWARD else "gradient"
        return f"{kind} {self.name!r} of minibatch {self.minibatch}"


Owner = Callable[[int, int], Rank]  # (stage, minibatch) -> rank


def action_messages(links: Sequence[StageLinks], owner: Owner, me: Rank, a: Action,
                    index: Mapping[str, int], grad_ok: Callable[[str, int], bool]
                    ) -> tuple[tuple[Msg, ...], tuple[Msg, ...]]:
    """(receives, sends) of action ``a`` of rank ``me``, each sorted. ``grad_ok(name, k)``:
    whether value ``name`` of minibatch k carries a gradient (floating point on the wire)."""
    if a.kind in ("U", "W"):  # an update's all-reduce is a collective; W computes only
        return (), ()
    st, k = links[me[0]], a.minibatch
    recvs: list[Msg] = []
    sends: list[Msg] = []
    if a.kind == "F":
        for n, src in zip(st.inputs, st.sources):
            if src != MODEL:
                recvs.append(Msg(owner(src, k), FORWARD, k, index[n], n, False))
        for n, cons in zip(st.outputs, st.consumers):
            sends.extend(Msg(owner(c, k), FORWARD, k, index[n], n, True)
                         for c in cons if c != MODEL)
    else:
        for n, cons in zip(st.outputs, st.consumers):
            if any(c != MODEL for c in cons) and grad_ok(n, k):
                recvs.extend(Msg(owner(c, k), BACKWARD, k, index[n], n, False)
                             for c in cons if c != MODEL)
        for n, src in zip(st.inputs, st.sources):
            if src != MODEL and grad_ok(n, k):
                sends.append(Msg(owner(src, k), BACKWARD, k, index[n], n, True))
    return tuple(sorted(recvs)), tuple(sorted(sends))


@dataclass(frozen=True)
class RankPlan:
    """One rank's messages: ``recvs[i]`` / ``sends[i]`` of its action i, and ``ops``: all of
    them in the global order (docs/design-notes.md), the order the rank issues them in, channel
    by channel. ``times[j]``: when op j's sending action starts in the plan's timing, and
    ``starts[i]`` when the rank's action i does (the :class:`Issuer` posts a receive once the
    rank is within ``lead`` of its time); empty: no timing (every receive as early as the
    order allows)."""

    recvs: tuple[tuple[Msg, ...], ...]
    sends: tuple[tuple[Msg, ...], ...]
    ops: tuple[Msg, ...]
    times: tuple[float, ...] = ()
    starts: tuple[float, ...] = ()
    lead: float = 0.0

    @property
    def receives_any(self) -> bool:
        return any(self.recvs)


class StretchPlanner:
    """Every rank's message plan, a window at a time, in ONE global order over a stretch.

    Each message sits at its sending action's place in a timed execution order: the action's
    simulated start (:class:`~fxpipe.runtime.schedules.simulate.Clock`; unit costs unless
    ``clock`` is given), then its place in the execution order, then (receiver, direction,
    minibatch, value). Why timed: the receives a rank may post at a point are exactly those
    before its next send in the order, so the order decides how early a transfer can start; an
    order that follows the run's timing puts each receive before the sends of the actions that
    run while its data is produced (the greedy execution order put stage 0's next forward ahead
    of the gradient it waits for, so that gradient's receive was posted only once the forward
    had run, and on a slow link its whole transfer became a stall). Any topological order
    keeps NCCL's rule; this one is topological and executable: a receive comes before every
    send of the actions that wait for it, because those start after its sender started (every
    action that sends takes time). Windows of a stretch (:mod:`.stream`) are planned in turn,
    so a message a window sends may be received in a later one (the receive is posted in the
    sender's window, in the global order); ``ranks``: whose plans to make (default: all)."""

    def __init__(self, links: Sequence[StageLinks], replicas: Sequence[int],
                 index: Mapping[str, int], grad_ok: Callable[[str, int], bool], *,
                 ranks: Sequence[Rank] | None = None, clock: Clock | None = None,
                 split: frozenset[Rank] = frozenset(), sync: Sequence[Sequence[int]] = (),
                 delay: int = 0) -> None:
        self.links, self.index, self.grad_ok = links, index, grad_ok
        self.replicas = tuple(replicas)
        everyone = [(s, j) for s, r in enumerate(self.replicas) for j in range(r)]
        self.ranks = list(everyone if ranks is None else ranks)
        self.clock = clock or Clock.unit(self.replicas, split=split, sync=sync, delay=delay)
        self.lead = LEAD * max(f + b for f, b in zip(self.clock.fwd, self.clock.bwd))
        self.delay = delay
        self.position = 0  # actions planned so far (the global order's tie-break)

    def owner(self, stage: int, minibatch: int) -> Rank:
        return (stage, minibatch % self.replicas[stage])

    def window(self, sched: Any, order: Sequence[tuple[Rank, int]]) -> dict[Rank, RankPlan]:
        """The plans of ``sched``'s actions (a complete schedule, or a window of a stretch),
        executed in ``order`` ((rank, index) pairs, a valid execution order)."""
        want = set(self.ranks)
        keyed: dict[Rank, list[tuple[tuple[Any, ...], Msg]]] = {r: [] for r in self.ranks}
        starts: dict[Rank, dict[int, float]] = {r: {} for r in self.ranks}
        for rank, i in order:
            a = sched.actions[rank][i]
            start, _ = self.clock.time(rank, a)
            if rank in want:
                starts[rank][i] = start
            self.position += 1
            if a.kind in ("U", "W") or not (rank in want or self._sends_to(rank, want)):
                continue
            for m in action_messages(self.links, self.owner, rank, a, self.index,
                                     self.grad_ok)[1]:
                key = (start, self.position, m.peer, m.direction, m.minibatch, m.value)
                if rank in want:
                    keyed[rank].append((key, m))
                if m.peer in want:
                    keyed[m.peer].append((key, Msg(rank, m.direction, m.minibatch, m.value,
                                                   m.name, False)))
        self._forget(sched)
        out: dict[Rank, RankPlan] = {}
        for rank in self.ranks:
            msgs = [action_messages(self.links, self.owner, rank, a, self.index, self.grad_ok)
                    for a in sched.actions[rank]]
            keyed[rank].sort(key=lambda t: t[0])
            out[rank] = RankPlan(tuple(m[0] for m in msgs), tuple(m[1] for m in msgs),
                                 tuple(m for _, m in keyed[rank]),
                                 tuple(k[0] for k, _ in keyed[rank]),
                                 tuple(starts[rank][i] for i in range(len(msgs))), self.lead)
        return out

    def _sends_to(self, rank: Rank, want: set[Rank]) -> bool:
        """Whether ``rank`` may send to one of ``want`` (its neighbours in the stage graph)."""
        st = self.links[rank[0]]
        near = {c for cons in st.consumers for c in cons} | set(st.sources)
        return any(r[0] in near for r in want)

    def _forget(self, sched: Any) -> None:
        """A window's timing state that no later action needs (see Clock.forget_before)."""
        ahead = getattr(sched, "ahead", None)
        if not ahead:
            return
        fb = [a.minibatch for acts in ahead.values() for a in acts if a.kind != "U"]
        ups = [a.minibatch for acts in ahead.values() for a in acts if a.kind == "U"]
        self.clock.forget_before(min(fb, default=sched.num_minibatches),
                                 min(ups, default=0) - self.delay)


def comm_plans(links: Sequence[StageLinks], sched: Any, index: Mapping[str, int],
               grad_ok: Callable[[str, int], bool], sync: Sequence[Sequence[int]] = (),
               delay: int = 0, ranks: Sequence[Rank] | None = None) -> dict[Rank, RankPlan]:
    """The plans of ``ranks`` (default: all) for carrying out the complete schedule ``sched``
    (linear in its size): :class:`StretchPlanner`'s one-window case, unit costs.
    ``sync``/``delay``: tied stages, as for ``execution_order``: the global order must be an
    order the ranks can really run in, collectives included."""
    planner = StretchPlanner(links, sched.replicas, index, grad_ok, ranks=ranks,
                             split=split_ranks(sched), sync=sync, delay=delay)
    return planner.window(sched, execution_order(sched, sync, delay))


def require_posted(msgs: Iterable[Msg], posted: Mapping[Msg, Any]) -> None:
    """Each of ``msgs``, about to be waited for, must be posted already; raises
    :class:`CommOrderError` naming the first that is not (a receive behind one of the rank's
    own later sends could never arrive)."""
    for m in msgs:
        if m not in posted:
            raise CommOrderError(f"{m.describe()} from {m.peer} is needed before it may be "
                                 "posted: the message order is not executable",
                                 "a bug in the message order: report it")


class Issuer:
    """Issues one rank's messages in its plan's order, channel by channel (docs/design-notes.md).

    Call :meth:`at` before each action i (the rank's clock moves to its start,
    ``RankPlan.starts[i]``), :meth:`send` for each send of an action right after its compute (in ``RankPlan.sends[i]``
    order) and :meth:`finish` after the last. ``post_recv(m)`` / ``post_send(m)`` post.

    Activations and gradients travel on channels of their own (a process group each,
    :data:`CHANNELS`), so the order binds within a channel only: each channel's ops are issued
    in the global order restricted to it, a send when its action has computed, and a receive
    as soon as everything before it on its channel is issued and the rank's clock is within
    ``lead`` of its time (``RankPlan.times``; without times, at once). NCCL's argument carries
    over channel by channel: the first unfinished message is at the head of its channel's
    stream at both ends, and both ends have issued it (its receiver's clock passed its time
    before waiting for anything later in the order; every send before it in the order comes
    from an action before the one waiting for it, which the timed order gives: see
    :class:`StretchPlanner`)."""

    def __init__(self, plan: RankPlan, post_recv: Callable[[Msg], None],
                 post_send: Callable[[Msg], None]) -> None:
        self.ops = plan.ops
        self.post_recv, self.post_send = post_recv, post_send
        times = plan.times or (float("-inf"),) * len(plan.ops)
        self._streams: dict[int, list[tuple[float, Msg]]] = {}
        for t, m in zip(times, plan.ops):
            self._streams.setdefault(m.direction, []).append((t, m))
        self._ptr = {d: 0 for d in self._streams}
        self._lead = plan.lead
        self._starts = plan.starts
        self._now = float("-inf")

    def start(self) -> None:
        """Post what is due before the first action (everything, without times)."""
        for d in self._streams:
            self._receives(d)

    def at(self, i: int) -> None:
        """The rank is about to start its action i: post the receives due by its start."""
        if self._starts:
            self._now = max(self._now, self._starts[i])
        self.start()

    def finish(self) -> None:
        """After the rank's last action: post the receives still due later (a window's last
        messages, waited for in the next window)."""
        self._now = float("inf")
        self.start()

    def require(self, msgs: Iterable[Msg], posted: Mapping[Msg, Any]) -> None:
        """An action is about to wait for ``msgs``: each must be posted already (it is, when
        the order is the global one; a receive behind one of this rank's own later sends could
        never arrive)."""
        require_posted(msgs, posted)

    def send(self, m: Msg) -> None:
        ops, i = self._streams.get(m.direction, []), self._ptr.get(m.direction, 0)
        if i >= len(ops) or ops[i][1] != m:
            got = ops[i][1] if i < len(ops) else None
            raise CommOrderError(f"send of {m.describe()} to {m.peer} out of the global order "
                                 f"(next on its channel: {got})", "a bug: report it")
        self.post_send(m)
        self._ptr[m.direction] = i + 1
        self._receives(m.direction)

    def _receives(self, d: int) -> None:
        """The receives of channel ``d`` up to its next send that are due."""
        ops, due = self._streams[d], self._now + self._lead
        while self._ptr[d] < len(ops) and not ops[self._ptr[d]][1].send and \
                ops[self._ptr[d]][0] <= due:
            self.post_recv(ops[self._ptr[d]][1])
            self._ptr[d] += 1

    @property
    def done(self) -> bool:
        return all(self._ptr[d] == len(ops) for d, ops in self._streams.items())
