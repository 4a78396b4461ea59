"""When a sent tensor may go: the received message that proves a send complete (pure data).

The peer waits for ``m`` just before the action consuming it, so a message received from any later
action (happens-before) proves ``m`` done: :class:`SendProofs` names the sends each receipt frees.
"""
from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterable, Mapping, Sequence
from itertools import accumulate
from dataclasses import dataclass

from .commplan import FORWARD, Msg, Owner, StageLinks, action_messages
from .schedule import Action, Rank


@dataclass
class _Open:
    """A send without a proof yet; ``consumed``: the peer's consuming action was seen (in an
    earlier window), so any later message from the peer proves it."""

    msg: Msg
    consumed: bool = False


class HappensBefore:
    """A window's actions in an order they can run (each after its rank's previous action and
    after the actions that sent what it waits for) and, per rank ``p`` asked about, the latest
    action of ``p`` that happens before each action (or is it): a vector clock, one component
    at a time. It does not depend on which rank reads it, so a walk of every rank makes it once
    per window. Messages from earlier windows add nothing (their senders are not in it)."""

    def __init__(self, links: Sequence[StageLinks], owner: Owner, index: Mapping[str, int],
                 grad_ok: Callable[[str, int], bool],
                 actions: Mapping[Rank, Sequence[Action]]) -> None:
        self.where = {(r, a.kind, a.minibatch): i for r, acts in actions.items()
                      for i, a in enumerate(acts) if a.kind in ("F", "B")}
        self._first: dict[Rank, int] = {}  # a rank's first action's place in one numbering
        n = 0
        for r, acts in actions.items():
            self._first[r], n = n, n + len(acts)
        self._size = n
        needs = {r: self._needs(links, owner, index, grad_ok, r, acts)
                 for r, acts in actions.items()}
        # (flat id, rank, index, flat ids of the actions it waits on), in an order that runs
        self._steps: list[tuple[int, Rank, int, tuple[int, ...]]] = []
        nxt = {r: 0 for r in actions}
        done = [False] * n
        progress = True
        while progress:  # advance every rank as far as its senders allow (the schedule runs)
            progress = False
            for r, acts in actions.items():
                while nxt[r] < len(acts):
                    i = nxt[r]
                    deps = needs[r][i]
                    if not all(done[d] for d in deps):
                        break
                    f = self._first[r] + i
                    self._steps.append((f, r, i, deps))
                    done[f] = True
                    nxt[r] = i + 1
                    progress = True
        self._latest: dict[Rank, list[int]] = {}

    def latest(self, p: Rank, r: Rank, i: int) -> int:
        """The index of ``p``'s latest action that happens before action ``i`` of ``r`` (or is
        it); -1 where none does or that action never runs in the window."""
        if i < 0 or r not in self._first:
            return -1
        return self._clock(p)[self._first[r] + i]

    def _clock(self, p: Rank) -> list[int]:
        got = self._latest.get(p)
        if got is None:
            got = self._latest[p] = [-1] * self._size
            for f, r, i, deps in self._steps:
                if r == p:
                    got[f] = i
                    continue
                v = got[f - 1] if i else -1
                for d in deps:
                    if got[d] > v:
                        v = got[d]
                got[f] = v
        return got

    def _needs(self, links: Sequence[StageLinks], owner: Owner, index: Mapping[str, int],
               grad_ok: Callable[[str, int], bool], r: Rank, acts: Sequence[Action]
               ) -> list[tuple[int, ...]]:
        """Per action of rank ``r``: the actions of the window that sent what it waits for."""
        out = []
        for a in acts:
            deps = []
            if a.kind in ("F", "B"):
                for m in action_messages(links, owner, r, a, index, grad_ok)[0]:
                    i = self.where.get((m.peer, "F" if m.direction == FORWARD else "B",
                                        m.minibatch))
                    if i is not None:
                        deps.append(self._first[m.peer] + i)
            out.append(tuple(deps))
        return out


class SendProofs:
    """Per received message, the sends of ``me`` it proves complete (docs/design-notes.md)."""

    def __init__(self, links: Sequence[StageLinks], owner: Owner, me: Rank,
                 index: Mapping[str, int], grad_ok: Callable[[str, int], bool]) -> None:
        self.links, self.owner, self.me = links, owner, me
        self.index, self.grad_ok = index, grad_ok
        self._open: list[_Open] = []
        self._proofs: dict[Msg, list[Msg]] = {}

    def window(self, actions: Mapping[Rank, Sequence[Action]], sends: Iterable[Msg],
               order: HappensBefore | None = None) -> None:
        """A new window: ``actions`` every rank's actions in it, ``sends`` the messages this rank
        sends in it (its plan's), ``order`` their :class:`HappensBefore` where the caller
        shares one among ranks. Finds the proofs that this window's actions give."""
        self._open.extend(_Open(m) for m in sends)
        hb = order or HappensBefore(self.links, self.owner, self.index, self.grad_ok, actions)
        where = hb.where
        mine = [(r, where.get((r.peer, "F" if r.direction == FORWARD else "B", r.minibatch),
                              -1))
                for a in actions.get(self.me, ())
                for r in self._received(a)]  # what this rank waits for, in its order
        reach: dict[Rank, list[int]] = {}  # per peer: the most of its actions seen by then
        to_me: dict[Rank, list[Msg | None]] = {}  # per peer, per action: its first send to me
        still: list[_Open] = []
        for o in self._open:
            m = o.msg
            acts = actions.get(m.peer, ())
            start = 0
            if not o.consumed:
                kind = "F" if m.direction == FORWARD else "B"
                start = next((j for j, a in enumerate(acts)
                              if a.kind == kind and a.minibatch == m.minibatch), -1)
                if start < 0:
                    still.append(o)
                    continue
            seen = reach.get(m.peer)
            if seen is None:  # running maxima over mine: the first to reach start proves m
                seen = reach[m.peer] = list(accumulate(
                    (hb.latest(m.peer, r.peer, i) for r, i in mine), max, initial=-1))[1:]
            k = bisect_left(seen, start)  # a chain from the peer's consumption to me
            proof = mine[k][0] if k < len(seen) else None
            if proof is None:  # else the peer's own first message after it (maybe later)
                firsts = to_me.get(m.peer)
                if firsts is None:
                    firsts = to_me[m.peer] = [self._first_to_me(m.peer, a) for a in acts]
                proof = next((p for p in firsts[start:] if p is not None), None)
            if proof is None:
                still.append(_Open(m, consumed=True))
            else:
                self._proofs.setdefault(proof, []).append(m)
        self._open = still

    def _received(self, action: Action) -> tuple[Msg, ...]:
        """The messages this rank waits for before ``action``, in the order it waits."""
        return action_messages(self.links, self.owner, self.me, action, self.index,
                               self.grad_ok)[0]

    def proven_by(self, received: Msg) -> list[Msg]:
        """The sends ``received`` (a message this rank has now waited for) proves complete."""
        return self._proofs.pop(received, [])

    @property
    def unproven(self) -> int:
        """Sends whose proof has not been found or not yet received (the flush waits for)."""
        return len(self._open) + sum(len(v) for v in self._proofs.values())

    def _first_to_me(self, peer: Rank, action: Action) -> Msg | None:
        """The first message ``peer``'s ``action`` sends to this rank, as this rank receives it."""
        sends = action_messages(self.links, self.owner, peer, action, self.index,
                                self.grad_ok)[1]
        s = next((s for s in sends if s.peer == self.me), None)
        return None if s is None else Msg(peer, s.direction, s.minibatch, s.value, s.name, False)
