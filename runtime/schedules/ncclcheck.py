"""NCCL's rules as a checker: replay every rank's host calls and prove the messages meet in order.

:func:`check_logs` replays recorded or planned (:func:`plan_logs`) calls in issue order, a stream
per rank and channel, and proves sends meet receives of equal tag, shape and dtype, none hanging.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Sequence

from .commplan import (CHANNELS, CommOrderError, Msg, StageLinks, StretchPlanner,
                       require_posted)
from .program import lower
from .schedule import Action, Rank, execution_order, split_ranks

# A rank's log is the list of its host calls, as Comm records them:
#   ("p2p", b, ((is_send, peer, tag, shape, dtype), ...)[, channel])
#                                                         post batch number b (one NCCL group)
#                                                         on a channel (default: the world's)
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
    sends: dict[tuple[int, int, Any], list[tuple[int, Any, int, tuple]]] = {}
    recvs: dict[tuple[int, int, Any], list[tuple[int, Any, int, tuple]]] = {}
    for r, log_ in logs.items():
        for ev in log_:
            if ev[0] != "p2p":
                continue
            channel = ev[3] if len(ev) > 3 else None
            for j, (is_send, peer, tag, shape, dtype) in enumerate(ev[2]):
                side = sends if is_send else recvs
                pair = (r, peer, channel) if is_send else (peer, r, channel)
                side.setdefault(pair, []).append((r, ev[1], j, (tag, tuple(shape), dtype)))
    match: dict[tuple[int, Any, int], tuple] = {}
    for pair in sorted(set(sends) | set(recvs), key=lambda p: (p[0], p[1], str(p[2]))):
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
    """Replay every rank's log under NCCL's rules (docs/design-notes.md); return the number of
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
                    stream = ((r, "p2p", ev[3] if len(ev) > 3 else None) if ev[0] == "p2p"
                              else (r, "p2p", None) if ev[1] == "world" else (r, ev[1]))
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
    or dtypes): to check many schedules quickly. ``sched``: a complete schedule, or the windows
    of a stretch in order (:mod:`.stream`; a receive is posted in its sender's window and may be
    waited for in a later one). ``collectives(rank, i, a)`` adds the collective events of
    action i of a window (default: none)."""
    windows = list(sched) if isinstance(sched, (list, tuple)) else [sched]
    first = windows[0]
    ranks = list(first.ranks)
    gid = {r: i for i, r in enumerate(ranks)}
    nv = max(len(index), 1)
    planner = StretchPlanner(links, first.replicas, index, grad_ok,
                             split=frozenset().union(*(split_ranks(w) for w in windows)),
                             sync=sync, delay=delay)
    out: dict[int, list[Event]] = {gid[r]: [] for r in ranks}
    ids: dict[Rank, dict[Msg, int]] = {r: {} for r in ranks}
    for w in windows:
        order = getattr(w, "order", None) or execution_order(w, sync, delay)
        plans = planner.window(w, order)
        for rank in ranks:
            log_, mine = out[gid[rank]], ids[rank]

            def post(msgs: Iterable[Msg], log_: list[Event] = log_,
                     mine: dict[Msg, int] = mine) -> None:
                for m in msgs:
                    mine[m] = len(log_)
                    tag = (m.minibatch * nv + m.value) * 2 + m.direction
                    log_.append(("p2p", len(log_), ((m.send, gid[m.peer], tag, (), ""),),
                                 CHANNELS[m.direction]))

            program = lower(plans[rank], w.actions[rank])  # the rank's program (program.py)
            post(program.start)
            for step in program.steps:
                post(step.before)
                require_posted(step.waits, mine)
                log_.extend(("wait", mine.pop(m)) for m in step.waits)
                if collectives is not None:
                    log_.extend(collectives(rank, step.index, step.action))
                post(step.after)
            post(program.end)
    for log_ in out.values():
        log_.append(("flush",))
    return out
