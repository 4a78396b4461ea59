"""The schedule of a continuous stretch of training, generated a window at a time.

An asynchronous kind never drains, so a stretch is ONE ``make_schedule(kind, replicas, N)`` cut into
windows, none holding an action that waits for a later one; the ``final`` window drains.
"""
from __future__ import annotations

import copy
import math
from collections import deque
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Callable, Mapping

from fxpipe.errors import ConfigError

from .kinds import _windows
from .order import OrderWalker
from .schedule import Action, Rank, Schedule

STREAM_KINDS = ("pipedream", "2bw")


@dataclass(frozen=True)
class Window(Schedule):
    """One window of a stretch (docs/design-notes.md): a :class:`Schedule` whose
    ``num_minibatches`` is the window's ``stop`` and whose actions are this window's only:
    the new minibatches are ``[start, stop)``, and a forward of one of them may wait for a
    later window (it is in that window's actions)."""

    start: int = 0
    final: bool = True
    ahead: Mapping[Rank, tuple[Action, ...]] = field(default_factory=dict, hash=False)
    order: tuple[tuple[Rank, int], ...] = field(default=(), hash=False)
    """(rank, index in ``actions[rank]``): an execution order of the window's actions."""

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "ahead", MappingProxyType({tuple(r): tuple(a) for r, a
                                                            in self.ahead.items()}))

    @property
    def stop(self) -> int:
        return self.num_minibatches

    @property
    def new_minibatches(self) -> int:
        return self.stop - self.start


VersionRule = Callable[[int, int], int]  # (minibatch, updates so far) -> version its F reads


class _RankStream:
    """One rank's list (``_one_f_one_b`` + ``_insert_updates`` + ``_with_versions`` of
    :mod:`.kinds`), produced incrementally: admit ``window`` forwards, then one backward before
    each forward; update g right after the rank's last backward of a group <= g (before its first
    backward for groups it has none in)."""

    def __init__(self, j: int, r: int, window: int, size: int, rule: VersionRule) -> None:
        self.r, self.window, self.size, self.rule = r, window, size, rule
        self.k_next = j  # the next own minibatch to forward
        self.pending: deque[int] = deque()  # forwarded, backward not yet emitted
        self.versions: dict[int, int] = {}  # pending minibatch -> version its forward read
        self.updates = 0  # U's emitted
        self.first_b = True

    def advance(self, cut: int, n: int | None) -> list[Action]:
        """Actions up to the first forward of a minibatch >= ``cut``; with ``n`` (the stretch's
        length) everything up to the end instead: the drain and the trailing updates."""
        out: list[Action] = []
        limit = cut if n is None else n
        while self.k_next < limit:
            if len(self.pending) >= self.window:
                self._backward(out, n)
            k = self.k_next
            self.versions[k] = self.rule(k, self.updates)
            out.append(Action("F", k, self.versions[k]))
            self.pending.append(k)
            self.k_next += self.r
        if n is not None:
            while self.pending:
                self._backward(out, n)
            self._updates(out, math.ceil(n / self.size))
        return out

    def _updates(self, out: list[Action], upto: int) -> None:
        while self.updates < upto:
            self.updates += 1
            out.append(Action("U", self.updates - 1, self.updates))

    def _backward(self, out: list[Action], n: int | None) -> None:
        k = self.pending.popleft()
        g = k // self.size
        if self.first_b:  # groups before this one have no backward of this rank
            self._updates(out, g)
            self.first_b = False
        out.append(Action("B", k, self.versions.pop(k)))
        nxt = k + self.r  # its next own minibatch exists: it was forwarded, or n says so
        if n is not None and nxt >= n:
            self._updates(out, math.ceil(n / self.size))
        elif nxt // self.size != g:  # the last of its group on this rank
            self._updates(out, nxt // self.size)


class ScheduleStream:
    """Windows of the stretch ``make_schedule(kind, replicas, N)`` (docs/design-notes.md);
    ``N`` is known only when the final window is asked for."""

    def __init__(self, kind: str, replicas: list[int] | tuple[int, ...], *,
                 microbatches: int | None = None, vertical_sync: bool = False,
                 noam: int | None = None, sync: tuple[tuple[int, ...], ...] = (),
                 delay: int = 0) -> None:
        if kind not in STREAM_KINDS:
            raise ConfigError(f"schedule kind {kind!r} does not stream",
                              f"stream one of {STREAM_KINDS}; a flushing kind is a complete "
                              "schedule per segment")
        if kind == "pipedream" and microbatches not in (None, 1):
            raise ConfigError(f"microbatches={microbatches} with pipedream",
                              "pipedream updates after every minibatch; use 2bw")
        self.kind, self.replicas = kind, tuple(replicas)
        self.vertical_sync = vertical_sync
        m = microbatches if microbatches is not None else sum(replicas)
        self.noam, self.windows = _windows(list(replicas), noam)
        self.group = 1 if kind == "pipedream" else m
        self.period = math.lcm(*replicas) if kind == "pipedream" else math.lcm(m, *replicas)
        """The schedule's pattern repeats every ``period`` minibatches (whole update rounds of
        every stage's replicas): windows of multiples of it carry the fewest actions over."""
        reach = max(replicas) * (max(self.windows) + 1) + 2 * self.group
        self.lookahead = self.period * math.ceil(reach / self.period)
        """Minibatches of ``Window.ahead``: past every version a later forward reads that
        exists when the window ends, and past every in-flight minibatch's update."""
        self._ranks: dict[Rank, _RankStream] = {}
        for s, r in enumerate(replicas):
            size = r if kind == "pipedream" else m
            rule: VersionRule = ((lambda k, u: u) if kind == "pipedream"
                                 else (lambda k, u, m=m: max(0, k // m - 1)))
            for j in range(r):
                self._ranks[(s, j)] = _RankStream(j, r, self.windows[s], size, rule)
        self._v0: dict[int, int] = {}  # vertical sync: stage 0's version of each minibatch
        self._walker = OrderWalker(self.replicas, sync, delay)  # what each window can run
        self.position = 0
        self.finished = False

    @property
    def name(self) -> str:
        return self.kind + ("+vsync" if self.vertical_sync else "")

    def window(self, n: int, final: bool = False) -> Window:
        """The next window: ``n`` new minibatches; ``final`` ends the stretch (its length is
        then known) and drains it. Each rank's actions are those of the stretch's schedule up
        to its first forward of a minibatch >= the window's ``stop`` that can run without a
        later window; the rest waits for the next one (docs/design-notes.md)."""
        if self.finished:
            raise ConfigError("the stretch has ended (its final window was made)",
                              "start a new ScheduleStream")
        if n < 0:
            raise ConfigError(f"a window of {n} minibatches", "give 0 or more")
        start, stop = self.position, self.position + n
        new = self._advance(self._ranks, stop, stop if final else None)
        ran = self._walker.extend(new)
        if final:
            self._walker.check_done("a bug in the stream: report it")
        acts: dict[Rank, list[Action]] = {r: [] for r in self._ranks}
        order: list[tuple[Rank, int]] = []
        for rank, a in ran:
            order.append((rank, len(acts[rank])))
            acts[rank].append(a)
        ahead: dict[Rank, list[Action]] = {}
        if not final:
            spec = {r: copy.deepcopy(rs) for r, rs in self._ranks.items()}
            v0 = dict(self._v0)
            more = self._advance(spec, stop + self.lookahead, None)
            self._v0 = v0  # the speculation's versions are forgotten with it
            ahead = {r: [*self._walker.queue[r], *more[r]] for r in self._ranks}
        self.position, self.finished = stop, final
        self._forget()
        return Window(self.name, self.replicas, stop, acts, self.group, self.noam, self.windows,
                      start=start, final=final, ahead=ahead, order=tuple(order))

    def _advance(self, ranks: Mapping[Rank, _RankStream], cut: int, n: int | None
                 ) -> dict[Rank, list[Action]]:
        out = {r: rs.advance(cut, n) for r, rs in ranks.items()}  # stage 0 first (dict order)
        if self.vertical_sync:
            for (s, _), acts in out.items():
                if s == 0:
                    self._v0.update((a.minibatch, a.version) for a in acts if a.kind == "F")
            out = {r: [a if a.kind == "U" else Action(a.kind, a.minibatch, self._v0[a.minibatch])
                       for a in acts] for r, acts in out.items()}
        return out

    def _forget(self) -> None:
        """Stage 0's versions of minibatches every rank has finished (vertical sync)."""
        if self._v0:
            low = min(min(rs.pending, default=rs.k_next) for rs in self._ranks.values())
            for k in [k for k in self._v0 if k < low]:
                del self._v0[k]
