"""Event simulation of a :class:`Schedule`: when each action starts and ends. Pure Python, no torch.

An action starts once its rank is free and its inputs have arrived. Used to compare schedules, to
check the planner's time per minibatch and to draw paper-style grids (:func:`format_grid`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

from fxpipe.errors import ConfigError

from .localsgd import LocalSGDSchedule, averages_after
from .schedule import SYNCHRONOUS_KINDS, Action, Rank, Schedule, execution_order


@dataclass(frozen=True)
class Event:
    """One executed action and its [start, end) interval."""

    action: Action
    start: float
    end: float


@dataclass(frozen=True)
class Timeline:
    """Result of :func:`simulate`.

    ``steady_state_period`` is the time per minibatch once the pipeline is full: the slope of
    the completion times over the middle half of the rounds (lcm(replicas) minibatches; whole
    batches for the flushing kinds), so start-up and drain do not count.
    """

    events: Mapping[Rank, tuple[Event, ...]] = field(hash=False)
    makespan: float
    busy_fraction: Mapping[Rank, float] = field(hash=False)
    steady_state_period: float

    def times(self, rank: Rank) -> list[tuple[str, float, float]]:
        """``[("F0", 0.0, 1.0), ...]`` for one rank: handy in tests and reports."""
        return [(str(e.action), e.start, e.end) for e in self.events[rank]]


def _per_stage(value: float | Sequence[float], n: int, name: str) -> list[float]:
    if isinstance(value, (int, float)):
        return [float(value)] * n
    if len(value) != n or any(v < 0 for v in value):
        raise ConfigError(f"{name}={list(value)!r} needs {n} non-negative entries",
                          f"give one {name} per {'cut' if name == 'comm_time' else 'stage'}")
    return [float(v) for v in value]


class Clock:
    """When each action starts and ends, given the actions in an execution order: the timing
    rule of :func:`simulate`, kept across calls so a stretch's windows
    (:mod:`fxpipe.runtime.schedules.stream`) are timed as one schedule. Per-stage seconds as in
    :func:`simulate` (already checked there); ``split``: the ranks whose backwards are split."""

    def __init__(self, replicas: Sequence[int], fwd: Sequence[float], bwd: Sequence[float],
                 comm: Sequence[float], upd: Sequence[float], wfr: Sequence[float], *,
                 split: frozenset[Rank] = frozenset(), sync: Sequence[Sequence[int]] = (),
                 delay: int = 0, averages: Callable[[int], bool] | None = None,
                 avg: Sequence[float] = ()) -> None:
        self.replicas, self.S = tuple(replicas), len(replicas)
        # LocalSGD: a U steps its replica alone; where ``averages(i)``, the replicas then wait
        # for each other and average for ``avg[s]`` seconds
        self.averages, self.avg = averages, avg
        self.fwd, self.bwd, self.comm, self.upd, self.wfr = fwd, bwd, comm, upd, wfr
        self.split, self.delay = split, delay
        self.free = {(s, j): 0.0 for s, r in enumerate(replicas) for j in range(r)}
        self.end_of: dict[tuple[str, int, int], float] = {}
        self.collective: dict[tuple[int, int], float] = {}
        self.u_end: dict[tuple[int, int], float] = {}  # (stage, update) -> its end (all replicas)
        self.comp = {s: tuple(c) for c in sync for s in c}

    @classmethod
    def unit(cls, replicas: Sequence[int], **kwargs: object) -> Clock:
        """Forward 1, backward 2 (a split one: B 1 and W 1), no communication, free updates:
        the proportions of a typical stage, for when nothing was measured."""
        S = len(replicas)
        return cls(replicas, [1.0] * S, [2.0] * S, [0.0] * max(S - 1, 0), [0.0] * S,
                   [0.5] * S, **kwargs)  # type: ignore[arg-type]

    def time(self, rank: Rank, a: Action) -> tuple[float, float]:
        """(start, end) of ``a`` on ``rank``; call in an execution order."""
        s = rank[0]
        if a.kind == "U" and self.averages is not None:
            start = self.free[rank]
            if not self.averages(a.minibatch):
                self.free[rank] = start + self.upd[s]
                return start, self.free[rank]
            key = (s, a.minibatch)
            if key not in self.collective:  # every replica's local step, then the average
                self.collective[key] = max(self.free[(s, j)] for j in range(self.replicas[s])
                                           ) + self.upd[s]
            self.free[rank] = self.collective[key] + self.avg[s]
            return start, self.free[rank]
        if a.kind == "U":
            group = self.comp.get(s, (s,)) if self.delay == 0 else (s,)
            key = (group[0], a.minibatch)
            if key not in self.collective:  # every peer's earlier actions are already timed
                self.collective[key] = max(self.free[(t, j)] for t in group
                                           for j in range(self.replicas[t]))
                if self.delay > 0 and a.minibatch >= self.delay:
                    self.collective[key] = max([self.collective[key]] + [
                        self.u_end[(t, a.minibatch - self.delay)]
                        for t in self.comp.get(s, ()) if t != s])
            start, dur = self.collective[key], self.upd[s]
            self.u_end[(s, a.minibatch)] = max(self.u_end.get((s, a.minibatch), 0.0),
                                               start + dur)
        elif a.kind == "F":
            ready = (0.0 if s == 0
                     else self.end_of[("F", s - 1, a.minibatch)] + self.comm[s - 1])
            start, dur = max(self.free[rank], ready), self.fwd[s]
        elif a.kind == "W":  # after its own B, on the same rank
            start, dur = self.free[rank], self.bwd[s] * self.wfr[s]
        else:
            ready = (self.end_of[("F", s, a.minibatch)] if s == self.S - 1
                     else self.end_of[("B", s + 1, a.minibatch)] + self.comm[s])
            start = max(self.free[rank], ready)
            dur = self.bwd[s] * (1.0 - self.wfr[s]) if rank in self.split else self.bwd[s]
        self.free[rank] = start + dur
        if a.kind != "U":
            self.end_of[(a.kind, s, a.minibatch)] = start + dur
        return start, start + dur

    def forget_before(self, minibatch: int, update: int) -> None:
        """Drop what no later action can depend on: actions of minibatches < ``minibatch``
        and updates < ``update`` (keeps a long stretch's memory bounded)."""
        for key in [k for k in self.end_of if k[2] < minibatch]:
            del self.end_of[key]
        for d in (self.collective, self.u_end):
            for key in [k for k in d if k[1] < update]:
                del d[key]


def simulate(sched: Schedule, fwd_time: Sequence[float], bwd_time: Sequence[float],
             comm_time: float | Sequence[float] = 0.0,
             update_time: float | Sequence[float] = 0.0, *,
             sync: Sequence[Sequence[int]] = (), delay: int = 0,
             weight_fraction: float | Sequence[float] = 0.5,
             average_time: float | Sequence[float] = 0.0) -> Timeline:
    """Time ``sched``: per-stage forward/backward seconds per minibatch (a replica handles whole
    minibatches, so these are per replica), ``comm_time`` per cut (s-1 -> s, paid by activations
    and by gradients alike) and ``update_time`` per stage (an update of all replicas together).
    ``sync``/``delay``: stage sets sharing tied weights, as in ``execution_order``: with delay 0
    their updates start together (the tied all-reduce is a barrier), with delay d an update i
    waits for update i-d of the other stages of its set. On a rank that splits its backwards
    (zero-bubble kinds) W takes ``weight_fraction`` of the backward and B the rest (half each:
    ``dX = dY W^T`` and ``dW = X^T dY`` cost alike). A LocalSGD schedule's ``U`` is each
    replica's own step (``update_time``); where it averages, the stage's replicas wait for each
    other's step and average for ``average_time`` seconds per stage."""
    S = sched.num_stages
    split = frozenset(rank for rank, acts in sched.actions.items()
                      if any(a.kind == "W" for a in acts))
    clock = Clock(sched.replicas, _per_stage(fwd_time, S, "fwd_time"),
                  _per_stage(bwd_time, S, "bwd_time"),
                  _per_stage(comm_time, max(S - 1, 0), "comm_time") if S > 1 else [],
                  _per_stage(update_time, S, "update_time"),
                  _per_stage(weight_fraction, S, "weight_fraction"),
                  split=split, sync=sync, delay=delay,
                  averages=(lambda i: averages_after(sched, i))  # type: ignore[arg-type]
                  if isinstance(sched, LocalSGDSchedule) else None,
                  avg=_per_stage(average_time, S, "average_time"))
    events: dict[Rank, list[Event]] = {rank: [] for rank in sched.ranks}
    for rank, i in execution_order(sched, sync, delay):
        a = sched.actions[rank][i]
        events[rank].append(Event(a, *clock.time(rank, a)))
    makespan = max(clock.free.values(), default=0.0)
    busy = {rank: (sum(e.end - e.start for e in evs) / makespan if makespan else 0.0)
            for rank, evs in events.items()}
    return Timeline({r: tuple(e) for r, e in events.items()}, makespan, busy,
                    _steady_period(sched, events, makespan))


def _steady_period(sched: Schedule, events: Mapping[Rank, list[Event]], makespan: float) -> float:
    """Slope of group completion times over the middle half of the groups (see Timeline)."""
    n = sched.num_minibatches
    if n == 0:
        return 0.0
    done = [0.0] * n
    for evs in events.values():
        for e in evs:
            if e.action.kind != "U":
                done[e.action.minibatch] = max(done[e.action.minibatch], e.end)
    # a replicated pipeline repeats its pattern every lcm(replicas) minibatches: measure whole
    # rounds (whole batches when the schedule flushes) so the slope is exact
    g = math.lcm(*sched.replicas)
    if sched.kind in SYNCHRONOUS_KINDS:
        g = math.lcm(g, sched.group)
    groups = [max(done[k:k + g]) for k in range(0, n - g + 1, g)]
    if len(groups) < 2:
        return makespan / n
    lo, hi = len(groups) // 4, len(groups) - 1 - len(groups) // 4
    if hi <= lo:
        lo, hi = 0, len(groups) - 1
    return (groups[hi] - groups[lo]) / ((hi - lo) * g)


def format_grid(sched: Schedule, *, width: int | None = None) -> str:
    """The schedule as the paper's figures draw it: one row per rank, one column per time slot
    of a unit-time simulation (forward = backward = 1, no communication; a split backward's B
    and W take a slot each). Updates take no time and are not drawn; idle slots are dots."""
    split = any(a.kind == "W" for acts in sched.actions.values() for a in acts)
    tl = simulate(sched, [1.0] * sched.num_stages, [2.0 if split else 1.0] * sched.num_stages)
    slots = int(round(tl.makespan))
    cells = {rank: ["."] * slots for rank in sched.ranks}
    for rank, evs in tl.events.items():
        for e in evs:
            if e.action.kind != "U":
                cells[rank][int(round(e.start))] = str(e.action)
    w = width or max([len(c) for row in cells.values() for c in row] + [1])
    lines = []
    for rank in sched.ranks:
        label = f"s{rank[0]}r{rank[1]}"
        lines.append(f"{label:<6}|" + " ".join(c.rjust(w) for c in cells[rank]))
    return "\n".join(lines)
