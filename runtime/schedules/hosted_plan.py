"""The message order of processes hosting several stages, as data (the placed kinds' commplan).

Each process issues its hosted ranks' remote messages in one global order: the sending step's place
in :func:`~.placement.process_order`, then (receiver, direction, minibatch, value).
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping, Sequence

from .commplan import CommOrderError, Msg, RankPlan, StageLinks, comm_plans
from .placement import PlacedSchedule, process_order
from .schedule import Rank

Op = tuple[Rank, Msg]  # a hosted rank and one of its messages


def rank_plans(placed: PlacedSchedule, links: Sequence[StageLinks], index: Mapping[str, int],
               grad_ok: Callable[[str, int], bool], ranks: Sequence[Rank]) -> dict[Rank, RankPlan]:
    """Each rank's per-action receives and sends (commplan's; their ``ops`` are not used)."""
    return comm_plans(links, placed.schedule, index, grad_ok, ranks=ranks)


def process_ops(placed: PlacedSchedule, plans: Mapping[Rank, RankPlan], p: int) -> tuple[Op, ...]:
    """Process p's remote messages, every hosted rank's, in the global order
    (docs/design-notes.md)."""
    where = {r: q for q, h in enumerate(placed.hosts) for r in h}
    pos: dict[tuple[Rank, str, int], int] = {}
    for n, (q, i) in enumerate(process_order(placed)):
        r, a = placed.order[q][i]
        if a.kind != "U":
            pos[(r, a.kind, a.minibatch)] = n
    keyed: list[tuple[tuple[int, Rank, int, int, int], Op]] = []
    for r in placed.hosts[p]:
        for a, recvs, sends in zip(placed.schedule.actions[r], plans[r].recvs, plans[r].sends):
            for m in sends:
                if where[m.peer] != p:
                    keyed.append(((pos[(r, a.kind, a.minibatch)], m.peer, m.direction,
                                   m.minibatch, m.value), (r, m)))
            for m in recvs:
                if where[m.peer] != p:
                    keyed.append(((pos[(m.peer, a.kind, a.minibatch)], r, m.direction,
                                   m.minibatch, m.value), (r, m)))
    keyed.sort(key=lambda t: t[0])
    return tuple(op for _, op in keyed)


class ProcessIssuer:
    """Issues one process's remote messages in :func:`process_ops` order: :meth:`start` before
    the first step, :meth:`send` for each remote send right after its step's compute."""

    def __init__(self, ops: Sequence[Op], post_recv: Callable[[Rank, Msg], None],
                 post_send: Callable[[Rank, Msg], None]) -> None:
        self.ops, self.i = tuple(ops), 0
        self.post_recv, self.post_send = post_recv, post_send
        self.posted: set[Op] = set()

    def start(self) -> None:
        self._receives()

    def require(self, r: Rank, msgs: Iterable[Msg]) -> None:
        """Rank r is about to wait for ``msgs`` (remote ones): each must be posted already."""
        for m in msgs:
            if (r, m) not in self.posted:
                raise CommOrderError(f"{m.describe()} from {m.peer} for {r} is needed before it "
                                     "may be posted: the message order is not executable",
                                     "a bug in the placed message order: report it")

    def send(self, r: Rank, m: Msg) -> None:
        if self.i >= len(self.ops) or self.ops[self.i] != (r, m):
            got = self.ops[self.i] if self.i < len(self.ops) else None
            raise CommOrderError(f"send of {m.describe()} from {r} to {m.peer} out of the global "
                                 f"order (next in order: {got})", "a bug: report it")
        self.post_send(r, m)
        self.i += 1
        self._receives()

    def _receives(self) -> None:
        while self.i < len(self.ops) and not self.ops[self.i][1].send:
            r, m = self.ops[self.i]
            self.post_recv(r, m)
            self.posted.add((r, m))
            self.i += 1

    @property
    def done(self) -> bool:
        return self.i == len(self.ops)


def placed_plan_logs(placed: PlacedSchedule, links: Sequence[StageLinks],
                     index: Mapping[str, int], grad_ok: Callable[[str, int], bool]
                     ) -> dict[int, list[Any]]:
    """The host calls (commplan's log format) each process makes under this rule, without
    running anything: for :func:`~fxpipe.runtime.schedules.ncclcheck.check_logs`. Replicated stages'
    all-reduces and the final barrier included; tags as the hosted runtime's (consumer stage)."""
    S, nv = placed.schedule.num_stages, max(len(index), 1)
    where = {r: q for q, h in enumerate(placed.hosts) for r in h}
    plans = rank_plans(placed, links, index, grad_ok, placed.schedule.ranks)
    reps = placed.schedule.replicas
    out: dict[int, list[Any]] = {}
    for p, steps in enumerate(placed.order):
        log_: list[Any] = []
        ids: dict[Op, int] = {}
        seq: dict[str, int] = {}

        def post(r: Rank, m: Msg, log_: list[Any] = log_, ids: dict[Op, int] = ids) -> None:
            ids[(r, m)] = len(log_)
            consumer = m.peer[0] if m.send == (m.direction == 0) else r[0]
            tag = ((m.minibatch * nv + m.value) * 2 + m.direction) * S + consumer
            log_.append(("p2p", len(log_), ((m.send, where[m.peer], tag, (), ""),)))

        issuer = ProcessIssuer(process_ops(placed, plans, p), post, post)
        issuer.start()
        count = {r: 0 for r in placed.hosts[p]}
        for r, a in steps:
            i = count[r]
            count[r] += 1
            remote = [m for m in plans[r].recvs[i] if where[m.peer] != p]
            issuer.require(r, remote)
            log_.extend(("wait", ids[(r, m)]) for m in remote)
            if a.kind == "U" and reps[r[0]] > 1:
                key = str(r[0])
                seq[key] = seq.get(key, -1) + 1
                members = tuple(sorted(where[(r[0], j)] for j in range(reps[r[0]])))
                log_ += [("coll", key, seq[key], members, 0), ("cwait", key, seq[key])]
            for m in plans[r].sends[i]:
                if where[m.peer] != p:
                    issuer.send(r, m)
        assert issuer.done
        log_ += [("flush",), ("coll", "world", 0, tuple(range(len(placed.hosts))), 0),
                 ("cwait", "world", 0)]
        out[p] = log_
    return out
