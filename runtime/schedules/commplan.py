"""The order of every rank's point-to-point messages, as data, and a checker of NCCL's rules.

Why this exists: NCCL ignores tags. A rank's sends and receives run on a CUDA stream in the order
they were issued (one stream per rank pair by default; with an eagerly initialised process group
ONE stream for all of the rank's point-to-point traffic), a send does not complete before its
receive has started, and the i-th send from A to B is paired with the i-th receive at B from A
whatever their tags. A rank that posts a gradient receive ahead of an activation send its peer is
waiting for (what pre-posting receives used to do) therefore deadlocks on a GPU, while gloo,
which matches by tag, runs it fine.

The rule, correct by construction: all ranks agree on ONE global order of all messages (the
position of a message is that of its sending action in the schedule's execution order
``execution_order``, a topological order, then the message's sort key), and every rank issues its
own sends and receives in that order. A send is issued right after its action's compute; the
receives before it (in the order) are issued first, and after each send every receive up to the
rank's next send is issued at once (so data arrives while the rank computes). Why this cannot
deadlock, even with one stream per rank: the first unfinished message in the global order is at
the head of both its ends' streams, both ends have issued it (the sender computed its action,
whose inputs are earlier messages; the receiver issues receives in order before it waits on any),
so it completes; by induction all do.

:func:`check_logs` replays every rank's recorded host calls under the strictest of these rules
(one stream per rank) and proves that the sends of each ordered rank pair meet the receives of
the other in order with equal tags, shapes and dtypes, and that nothing waits forever.

Pure Python (no torch): the executor, the tests and the checker build the same plan.
"""
from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Sequence

from fxpipe.errors import FxpipeError

from .schedule import Action, Rank, execution_order

log = logging.getLogger(__name__)

MODEL = -1  # fxpipe.codegen.split.MODEL: a model input (as a source) or output (as a consumer)
FORWARD, BACKWARD = 0, 1


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
    them in the global order (see the module doc), the order the rank issues them in."""

    recvs: tuple[tuple[Msg, ...], ...]
    sends: tuple[tuple[Msg, ...], ...]
    ops: tuple[Msg, ...]

    @property
    def receives_any(self) -> bool:
        return any(self.recvs)


def comm_plans(links: Sequence[StageLinks], sched: Any, index: Mapping[str, int],
               grad_ok: Callable[[str, int], bool], sync: Sequence[Sequence[int]] = (),
               delay: int = 0, ranks: Sequence[Rank] | None = None) -> dict[Rank, RankPlan]:
    """The plans of ``ranks`` (default: all) for carrying out ``sched`` (linear in its size).
    ``sync``/``delay``: tied stages, as for ``execution_order``: the global order must be an
    order the ranks can really run in, collectives included."""
    order = execution_order(sched, sync, delay)
    when: dict[tuple[Rank, str, int], int] = {}
    for pos, (rank, i) in enumerate(order):
        a = sched.actions[rank][i]
        if a.kind != "U":
            when[(rank, a.kind, a.minibatch)] = pos
    out: dict[Rank, RankPlan] = {}
    for rank in (sched.ranks if ranks is None else ranks):
        acts = sched.actions[rank]
        msgs = [action_messages(links, sched.owner, rank, a, index, grad_ok) for a in acts]
        keyed: list[tuple[tuple[int, Rank, int, int, int], Msg]] = []
        for a, (recvs, sends) in zip(acts, msgs):
            if a.kind == "U":
                continue
            # key: (position of the sending action, receiver, direction, minibatch, value),
            # which both ends compute alike (a receive's sender is m.peer)
            pos = when[(rank, a.kind, a.minibatch)]
            keyed.extend(((pos, m.peer, m.direction, m.minibatch, m.value), m) for m in sends)
            keyed.extend(((when[(m.peer, a.kind, a.minibatch)], rank, m.direction, m.minibatch,
                           m.value), m) for m in recvs)
        keyed.sort(key=lambda t: t[0])
        out[rank] = RankPlan(tuple(m[0] for m in msgs), tuple(m[1] for m in msgs),
                             tuple(m for _, m in keyed))
    return out


class Issuer:
    """Issues one rank's messages in its plan's order (see the module doc): call :meth:`start`
    before the first action, :meth:`send` for each send of an action right after its compute
    (in ``RankPlan.sends[i]`` order). ``post_recv(m)`` / ``post_send(m)`` do the posting."""

    def __init__(self, plan: RankPlan, post_recv: Callable[[Msg], None],
                 post_send: Callable[[Msg], None]) -> None:
        self.ops, self.i = plan.ops, 0
        self.post_recv, self.post_send = post_recv, post_send

    def start(self) -> None:
        self._receives()

    def require(self, msgs: Iterable[Msg], posted: Mapping[Msg, Any]) -> None:
        """An action is about to wait for ``msgs``: each must be posted already (it is, when
        the order is the global one; a receive behind one of this rank's own later sends could
        never arrive)."""
        for m in msgs:
            if m not in posted:
                raise CommOrderError(f"{m.describe()} from {m.peer} is needed before it may be "
                                     "posted: the message order is not executable",
                                     "a bug in the message order: report it")

    def send(self, m: Msg) -> None:
        if self.i >= len(self.ops) or self.ops[self.i] != m:
            got = self.ops[self.i] if self.i < len(self.ops) else None
            raise CommOrderError(f"send of {m.describe()} to {m.peer} out of the global order "
                                 f"(next in order: {got})", "a bug: report it")
        self.post_send(m)
        self.i += 1
        self._receives()

    def _receives(self) -> None:
        """Every receive up to this rank's next send: posted now, so data arrives early."""
        while self.i < len(self.ops) and not self.ops[self.i].send:
            self.post_recv(self.ops[self.i])
            self.i += 1

    @property
    def done(self) -> bool:
        return self.i == len(self.ops)


# ----------------------------------------------------------------------------- the checker
# A rank's log is the list of its host calls, as Comm records them:
#   ("p2p", b, ((is_send, peer, tag, shape, dtype), ...))  post batch number b (one NCCL group)
#   ("wait", b)                                           block until batch b completed
#   ("coll", group, seq, members, numel)                  post collective seq of group
#   ("cwait", group, seq)                                 block until it completed
#   ("flush",)                                            block until every posted batch did
Event = tuple


@dataclass
class _Kernel:
    rank: int
    stream: Any
    key: Any  # batch number, or (group, seq)
    ops: list[tuple[Any, ...]]
    started: bool = False
    done: bool = False


def _pair_ops(logs: Mapping[int, Sequence[Event]]) -> dict[tuple[int, Any, int], tuple]:
    """FIFO pairing: (rank, batch, op position) -> (peer rank, batch, op position) of the
    matching op; raises unless every ordered pair's sends meet the receives in order with
    equal tags, shapes and dtypes, and no op is left without a partner."""
    sends: dict[tuple[int, int], list[tuple[int, Any, int, tuple]]] = {}
    recvs: dict[tuple[int, int], list[tuple[int, Any, int, tuple]]] = {}
    for r, log_ in logs.items():
        for ev in log_:
            if ev[0] != "p2p":
                continue
            for j, (is_send, peer, tag, shape, dtype) in enumerate(ev[2]):
                side = sends if is_send else recvs
                pair = (r, peer) if is_send else (peer, r)
                side.setdefault(pair, []).append((r, ev[1], j, (tag, tuple(shape), dtype)))
    match: dict[tuple[int, Any, int], tuple] = {}
    for pair in sorted(set(sends) | set(recvs)):
        s, v = sends.get(pair, []), recvs.get(pair, [])
        for i, (a, b) in enumerate(zip(s, v)):
            if a[3] != b[3]:
                raise CommOrderError(
                    f"rank {pair[0]} -> rank {pair[1]}: send #{i} (tag, shape, dtype) {a[3]} "
                    f"meets receive #{i} {b[3]}: NCCL pairs them by order, not by tag",
                    "post each pair's messages in the same order on both ends")
            match[(a[0], a[1], a[2])] = (b[0], b[1], b[2])
            match[(b[0], b[1], b[2])] = (a[0], a[1], a[2])
        if len(s) != len(v):
            raise CommOrderError(f"rank {pair[0]} -> rank {pair[1]}: {len(s)} sends but "
                                 f"{len(v)} receives", "every send needs its receive")
    return match


def check_logs(logs: Mapping[int, Sequence[Event]]) -> int:
    """Replay every rank's log under NCCL's rules (see the module doc); return the number of
    point-to-point operations checked, or raise :class:`CommOrderError` saying which pair does
    not match or where every rank is stuck."""
    match = _pair_ops(logs)
    colls: dict[tuple[Any, int], dict[int, tuple]] = {}
    for r, log_ in logs.items():
        for ev in log_:
            if ev[0] == "coll":
                colls.setdefault((ev[1], ev[2]), {})[r] = (tuple(ev[3]), ev[4])
    for (group, seq), who in colls.items():
        members = next(iter(who.values()))[0]
        if set(who) != set(members) or len({v for v in who.values()}) > 1:
            raise CommOrderError(f"collective #{seq} of group {group}: posted by ranks "
                                 f"{sorted(who)} as {sorted(set(who.values()))}, members "
                                 f"{list(members)}", "every member must post the same collectives "
                                 "in the same order")
    ptr = {r: 0 for r in logs}
    streams: dict[tuple[int, Any], deque[_Kernel]] = {}
    kernels: dict[tuple[int, Any], _Kernel] = {}
    posted: dict[int, list[_Kernel]] = {r: [] for r in logs}

    def blocked(r: int, ev: Event) -> bool:
        if ev[0] == "wait":
            return not kernels[(r, ev[1])].done
        if ev[0] == "cwait":
            return not kernels[(r, (ev[1], ev[2]))].done
        if ev[0] == "flush":
            return not all(k.done for k in posted[r])
        return False

    progress = True
    while progress:
        progress = False
        for r, log_ in logs.items():  # hosts run until they block
            while ptr[r] < len(log_):
                ev = log_[ptr[r]]
                if ev[0] in ("p2p", "coll"):  # world collectives share the p2p stream (an
                    # eagerly initialised NCCL group runs point-to-point on its own communicator)
                    stream = (r, "p2p") if ev[0] == "p2p" or ev[1] == "world" else (r, ev[1])
                    key = ev[1] if ev[0] == "p2p" else (ev[1], ev[2])
                    k = _Kernel(r, stream, key, list(ev[2]) if ev[0] == "p2p" else [])
                    kernels[(r, key)] = k
                    streams.setdefault(stream, deque()).append(k)
                    if ev[0] == "p2p":
                        posted[r].append(k)
                elif blocked(r, ev):
                    break
                ptr[r] += 1
                progress = True
        for q in streams.values():  # the head of each stream runs
            if q and not q[0].started:
                q[0].started = True
                progress = True
        for q in streams.values():  # a running kernel completes once all its partners run
            k = q[0] if q else None
            if k is None or not k.started:
                continue
            if isinstance(k.key, tuple):  # a collective: every member's copy is running
                group, seq = k.key
                members = colls[(group, seq)][k.rank][0]
                ok = all((m, k.key) in kernels and kernels[(m, k.key)].started for m in members)
            else:
                ok = all((p[0], p[1]) in kernels and kernels[(p[0], p[1])].started for p in
                         (match[(k.rank, k.key, j)] for j in range(len(k.ops))))
            if ok:
                k.done = True
        for q in streams.values():
            while q and q[0].done:
                q.popleft()
                progress = True
    stuck = {r: logs[r][ptr[r]] for r in logs if ptr[r] < len(logs[r])}
    pending = {s: q[0].key for s, q in streams.items() if q}
    if stuck or pending:
        raise CommOrderError(f"deadlock under NCCL's rules: hosts waiting at {stuck}, stream "
                             f"heads not completing {pending}",
                             "issue every rank's messages in one global order "
                             "(fxpipe.runtime.schedules.commplan.comm_plans)")
    return sum(len(ev[2]) for log_ in logs.values() for ev in log_ if ev[0] == "p2p")


def plan_logs(links: Sequence[StageLinks], sched: Any, index: Mapping[str, int],
              grad_ok: Callable[[str, int], bool], sync: Sequence[Sequence[int]] = (),
              delay: int = 0,
              collectives: Callable[[Rank, int, Action], Iterable[Event]] | None = None
              ) -> dict[int, list[Event]]:
    """The logs the executor's rule produces for ``sched`` without running anything (no shapes
    or dtypes): to check many schedules quickly. ``collectives(rank, i, a)`` adds the collective
    events of action i (default: none)."""
    ranks = list(sched.ranks)
    gid = {r: i for i, r in enumerate(ranks)}
    nv = max(len(index), 1)
    plans = comm_plans(links, sched, index, grad_ok, sync, delay)
    out: dict[int, list[Event]] = {}
    for rank in ranks:
        log_: list[Event] = []
        ids: dict[Msg, int] = {}

        def post(m: Msg, log_: list[Event] = log_, ids: dict[Msg, int] = ids) -> None:
            ids[m] = len(log_)
            tag = (m.minibatch * nv + m.value) * 2 + m.direction
            log_.append(("p2p", len(log_), ((m.send, gid[m.peer], tag, (), ""),)))

        plan = plans[rank]
        issuer = Issuer(plan, post, post)
        issuer.start()
        for i, a in enumerate(sched.actions[rank]):
            issuer.require(plan.recvs[i], ids)
            log_.extend(("wait", ids[m]) for m in plan.recvs[i])
            if collectives is not None:
                log_.extend(collectives(rank, i, a))
            for m in plan.sends[i]:
                issuer.send(m)
        log_.append(("flush",))
        out[gid[rank]] = log_
    return out
