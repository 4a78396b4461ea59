"""Executing per-rank action lists against their data dependencies, a window at a time.

F(k) needs F(k) upstream, B(k) needs B(k) downstream (last stage: its F(k)), W(k) its B(k), U<i> its
stage's replicas (and tied stages) at U<i>. :class:`OrderWalker` runs each rank until it blocks.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

from fxpipe.errors import FxpipeError

Rank = tuple[int, int]


class ScheduleError(FxpipeError, ValueError):
    """A schedule breaks a rule an executor relies on (missing backward, wrong order, ...)."""


class DeadlockError(ScheduleError):
    """Executing every rank's list in order gets stuck; ``stuck`` maps rank -> waiting action."""

    def __init__(self, message: str, hint: str | None, stuck: dict[Rank, Any]) -> None:
        super().__init__(message, hint)
        self.stuck = stuck


class OrderWalker:
    """Runs every rank's actions in order against the dependencies (docs/design-notes.md).

    ``replicas``: per stage. ``sync``/``delay``: stages sharing tied weights; with ``delay`` 0
    their U<i> happen together (one all-reduce); with ``delay`` d > 0, U<i> of one of them needs
    U<i-d> done on every rank of the others. ``split``: the ranks whose backwards are split into
    B and W (a split B is also waited for by its W)."""

    def __init__(self, replicas: Sequence[int], sync: Sequence[Sequence[int]] = (),
                 delay: int = 0, split: frozenset[Rank] = frozenset()) -> None:
        self.replicas = tuple(replicas)
        self.S = len(self.replicas)
        self.ranks = [(s, j) for s, r in enumerate(self.replicas) for j in range(r)]
        self.split = split
        self.delay = delay
        self.together = {s: tuple(c) for c in sync for s in c} if delay == 0 else {}
        self.lagged = ({s: tuple(t for t in c if t != s) for c in sync for s in c}
                       if delay > 0 else {})
        self.queue: dict[Rank, list[Any]] = {r: [] for r in self.ranks}
        self.ptr = {r: 0 for r in self.ranks}  # next action in the rank's queue
        self.updates = {r: 0 for r in self.ranks}  # U's done (delay > 0)
        self.done: dict[tuple[str, int, int], int] = {}  # action -> consumers still to run

    def _consumers(self, kind: str, s: int, rank: Rank) -> int:
        if kind == "F":  # the next stage's F, or the last stage's own B
            return 1
        if kind == "B":  # the previous stage's B, and its own W when split
            return (1 if s > 0 else 0) + (1 if rank in self.split else 0)
        return 0

    def _need(self, rank: Rank, a: Any) -> tuple[str, int, int] | None:
        s = rank[0]
        if a.kind == "F":
            return None if s == 0 else ("F", s - 1, a.minibatch)
        if a.kind == "W":  # its own B, earlier in the same list
            return ("B", s, a.minibatch)
        return ("F", s, a.minibatch) if s == self.S - 1 else ("B", s + 1, a.minibatch)

    def _consume(self, dep: tuple[str, int, int]) -> None:
        left = self.done[dep] - 1
        if left > 0:
            self.done[dep] = left
        else:
            del self.done[dep]

    def extend(self, actions: Mapping[Rank, Sequence[Any]]) -> list[tuple[Rank, Any]]:
        """Append each rank's next actions and run whatever can run; returns (rank, action)
        in execution order. What cannot run yet stays queued (:attr:`stuck`, :attr:`queue`)
        for the next call."""
        for rank, acts in actions.items():
            self.queue[rank].extend(acts)
        order: list[tuple[Rank, int]] = []
        progress = True
        while progress:
            progress = False
            for rank in self.ranks:
                q = self.queue[rank]
                while self.ptr[rank] < len(q):
                    a = q[self.ptr[rank]]
                    if a.kind == "U":
                        if not self._update_ready(rank, a, order):
                            break
                    else:
                        dep = self._need(rank, a)
                        if dep is not None and dep not in self.done:
                            break
                        if dep is not None:
                            self._consume(dep)
                        n = self._consumers(a.kind, rank[0], rank)
                        if n:
                            self.done[(a.kind, rank[0], a.minibatch)] = n
                        order.append((rank, a))
                        self.ptr[rank] += 1
                    progress = True
        for rank, q in self.queue.items():  # forget what ran; keep what waits
            del q[:self.ptr[rank]]
            self.ptr[rank] = 0
        return order

    def _update_ready(self, rank: Rank, a: Any, order: list[tuple[Rank, Any]]) -> bool:
        """Run U<i> on every rank that updates with ``rank`` if all of them are at it."""
        peers = [(t, j) for t in self.together.get(rank[0], (rank[0],))
                 for j in range(self.replicas[t])]
        if not all(self.ptr[p] < len(self.queue[p]) and self.queue[p][self.ptr[p]] == a
                   for p in peers):
            return False
        if any(self.updates[(t, j)] <= a.minibatch - self.delay
               for t in self.lagged.get(rank[0], ()) for j in range(self.replicas[t])):
            return False
        for p in peers:
            order.append((p, a))
            self.ptr[p] += 1
            self.updates[p] += 1
        return True

    @property
    def stuck(self) -> dict[Rank, Any]:
        """Every rank's next action that could not run (empty when all ran)."""
        return {rank: q[0] for rank, q in self.queue.items() if q}

    def check_done(self, hint: str = "reorder the lists so each rank's next action can become "
                   "ready") -> None:
        """Raise :class:`DeadlockError` naming each stuck rank and what it waits for."""
        stuck = self.stuck
        if not stuck:
            return
        parts = []
        for rank, a in sorted(stuck.items()):
            dep = self._need(rank, a) if a.kind != "U" else None
            what = (f"all replicas of stage {rank[0]} (and tied stages) at {a}" if a.kind == "U"
                    else f"{dep[0]}{dep[2]} on stage {dep[1]}" if dep else "nothing")
            parts.append(f"stage {rank[0]} replica {rank[1]} stuck at {a} waiting for {what}")
        raise DeadlockError("deadlock: " + "; ".join(parts), hint, stuck)
