"""When a sent tensor may go: the received message that proves a send complete (pure data).

The peer waits for ``m`` just before the action consuming it, so a message received from any later
action (happens-before) proves ``m`` done: :class:`SendProofs` names the sends each receipt frees.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from .commplan import FORWARD, Msg, Owner, StageLinks, action_messages
from .schedule import Action, Rank


@dataclass
class _Open:
    """A send without a proof yet; ``consumed``: the peer's consuming action was seen (in an
    earlier window), so any later message from the peer proves it."""

    msg: Msg
    consumed: bool = False


class SendProofs:
    """Per received message, the sends of ``me`` it proves complete (docs/design-notes.md)."""

    def __init__(self, links: Sequence[StageLinks], owner: Owner, me: Rank,
                 index: Mapping[str, int], grad_ok: Callable[[str, int], bool]) -> None:
        self.links, self.owner, self.me = links, owner, me
        self.index, self.grad_ok = index, grad_ok
        self._open: list[_Open] = []
        self._proofs: dict[Msg, list[Msg]] = {}

    def window(self, actions: Mapping[Rank, Sequence[Action]], sends: Iterable[Msg]) -> None:
        """A new window: ``actions`` every rank's actions in it, ``sends`` the messages this rank
        sends in it (its plan's). Finds the proofs that this window's actions give."""
        self._open.extend(_Open(m) for m in sends)
        peers = {o.msg.peer for o in self._open}
        where = {(r, a.kind, a.minibatch): i for r, acts in actions.items()
                 for i, a in enumerate(acts) if a.kind in ("F", "B")}
        after = self._follows(actions, peers, where)  # (rank, i) -> {peer: latest before}
        mine = [(r, after.get((r.peer, i), {})) for a in actions.get(self.me, ())
                for r in self._received(a)  # what this rank waits for, in its order
                for i in [where.get((r.peer, "F" if r.direction == FORWARD else "B",
                                     r.minibatch), -1)]]
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
            proof = next((r for r, seen in mine  # a chain from the peer's consumption to me
                          if seen.get(m.peer, -1) >= start), None)
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

    def _follows(self, actions: Mapping[Rank, Sequence[Action]], peers: set[Rank],
                 where: Mapping[tuple[Rank, str, int], int]
                 ) -> dict[tuple[Rank, int], dict[Rank, int]]:
        """For every action of the window, the latest action of each of ``peers`` that happens
        before it (or is it): program order on each rank, and each message's sending action
        before the action that waits for it (a vector clock restricted to ``peers``). Messages
        from earlier windows add nothing (their senders are not in the window). ``where``:
        (rank, kind, minibatch) -> index of that F or B in the rank's list."""
        clock: dict[tuple[Rank, int], dict[Rank, int]] = {}
        nxt = {r: 0 for r in actions}
        waiting = {r: self._needs(r, acts, where) for r, acts in actions.items()}
        progress = True
        while progress:  # advance every rank as far as its senders allow (the schedule runs)
            progress = False
            for r, acts in actions.items():
                while nxt[r] < len(acts):
                    i = nxt[r]
                    deps = waiting[r][i]
                    if any(d not in clock for d in deps):
                        break
                    vc = dict(clock[(r, i - 1)]) if i else {}
                    for d in deps:
                        for p, j in clock[d].items():
                            if j > vc.get(p, -1):
                                vc[p] = j
                    if r in peers:
                        vc[r] = i
                    clock[(r, i)] = vc
                    nxt[r] = i + 1
                    progress = True
        return clock

    def _needs(self, r: Rank, acts: Sequence[Action],
               where: Mapping[tuple[Rank, str, int], int]) -> list[list[tuple[Rank, int]]]:
        """Per action of rank ``r``: the actions of the window that sent what it waits for."""
        out = []
        for a in acts:
            deps = []
            if a.kind in ("F", "B"):
                for m in action_messages(self.links, self.owner, r, a, self.index,
                                         self.grad_ok)[0]:
                    i = where.get((m.peer, "F" if m.direction == FORWARD else "B", m.minibatch))
                    if i is not None:
                        deps.append((m.peer, i))
            out.append(deps)
        return out

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
