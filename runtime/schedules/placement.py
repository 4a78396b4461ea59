"""Schedules whose processes host SEVERAL stages: interleaved 1F1B, ZB-V and DualPipeV, as data.

``interleaved-1f1b`` puts stage s on process s % P, ``zb-v`` and ``dualpipev`` stages p and
2P - 1 - p on process p; all synchronous, as 1f1b-flush. :class:`PlacedSchedule`: per-rank
lists plus each process's list.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from fxpipe.errors import ConfigError

from .placed_orders import Step, dualpipev_order, greedy_orders, megatron_order
from .schedule import Action, DeadlockError, Rank, Schedule, ScheduleError, _with_versions, validate

INTERLEAVED, ZBV, DUALPIPEV = "interleaved-1f1b", "zb-v", "dualpipev"
PLACED_KINDS = (INTERLEAVED, ZBV, DUALPIPEV)
V_KINDS = (ZBV, DUALPIPEV)  # two stages per process, in a V


@dataclass(frozen=True)
class PlacedSchedule:
    """``schedule``: the per-rank lists (every stage replicated equally, often once);
    ``hosts[p]``:
    the ranks process p hosts; ``order[p]``: process p's merged list, whose projection on each
    hosted rank is exactly ``schedule.actions[rank]``."""

    schedule: Schedule
    hosts: tuple[tuple[Rank, ...], ...]
    order: tuple[tuple[Step, ...], ...]

    @property
    def kind(self) -> str:
        return self.schedule.kind

    def __reduce__(self) -> tuple:
        """Picklable (spawned processes get it): a Schedule's read-only mapping is not."""
        s = self.schedule
        return (_rebuild, ((s.kind, s.replicas, s.num_minibatches, dict(s.actions), s.group,
                            s.noam, s.windows), self.hosts, self.order))

    @property
    def num_processes(self) -> int:
        return len(self.hosts)

    def process_of(self, rank: Rank) -> int:
        """The process hosting ``rank``."""
        for p, ranks in enumerate(self.hosts):
            if rank in ranks:
                return p
        raise ScheduleError(f"rank {rank} is hosted by no process", "place every stage once")

    def grid(self) -> list[str]:
        """One line per process: its merged list, each action tagged with its stage
        (``F3@2``: forward of minibatch 3 on stage 2)."""
        return [f"p{p}  |" + " ".join(f"{a}@{r[0]}" for r, a in steps)
                for p, steps in enumerate(self.order)]


def _rebuild(sched: tuple, hosts: tuple, order: tuple) -> PlacedSchedule:
    return PlacedSchedule(Schedule(*sched), hosts, order)


def placement(kind: str, num_stages: int, num_processes: int) -> tuple[tuple[Rank, ...], ...]:
    """Which ranks each process hosts: round robin for interleaved (stage s on process s % P),
    the V for zb-v and dualpipev (process p: stages p and 2P - 1 - p)."""
    S, P = num_stages, num_processes
    if P < 1 or S < P:
        raise ConfigError(f"{S} stages on {P} processes", "give at least one stage per process")
    if kind == INTERLEAVED:
        return tuple(tuple((s, 0) for s in range(p, S, P)) for p in range(P))
    if kind in V_KINDS:
        if S != 2 * P:
            raise ConfigError(f"{kind} with {S} stages on {P} processes",
                              f"{kind} places two stages per process in a V: split the model "
                              f"into {2 * P} stages")
        return tuple(((p, 0), (2 * P - 1 - p, 0)) for p in range(P))
    raise ConfigError(f"{kind!r} is not a placed kind", f"use one of {PLACED_KINDS}")


# ----------------------------------------------------------------------------- the kinds

def make_placed_schedule(kind: str, num_processes: int, num_minibatches: int, *,
                         num_stages: int | None = None, chunks: int = 2,
                         microbatches: int | None = None, limit: int | None = None,
                         costs: Sequence[tuple[float, float, float]] | None = None,
                         comm: Sequence[float] | None = None,
                         replicas: int = 1) -> PlacedSchedule:
    """Generate and validate ``kind`` (one of PLACED_KINDS) on ``num_processes`` processes.

    ``num_stages`` defaults to ``chunks * num_processes`` (interleaved: ``chunks`` = v; zb-v and
    dualpipev: always 2; dualpipev needs at least 2P microbatches in every batch).
    ``microbatches`` (m, per update) defaults to ``num_processes`` times 2 and must be a
    multiple of P for Megatron's order. ``limit``: minibatches admitted per process at once
    for the greedy orders (default P: under zb-v at most 2P chunk activations, 1F1B's memory
    since a chunk is half a stage; see :func:`greedy_orders`). ``costs``: per stage (F, B, W)
    seconds and
    ``comm`` per cut (into stage s) seconds, which the greedy orders place W's by.

    ``replicas`` = R > 1: R copies of the whole placed pipeline (data parallelism over it,
    ``num_processes`` processes each, so R * P in all: process ``j * P + p`` is copy j's p);
    minibatch k goes to copy k % R (the round robin of every kind), each copy runs the order of
    its own m / R microbatches, and each stage's R replicas all-reduce at every update.
    """
    P = num_processes
    if not isinstance(replicas, int) or replicas < 1:
        raise ConfigError(f"replicas={replicas!r}", "use 1 or more copies of the pipeline")
    if replicas > 1:
        m0 = microbatches if microbatches is not None else 2 * P * replicas
        if m0 % replicas or num_minibatches % replicas:
            raise ConfigError(f"{kind} with {replicas} replicas, {m0} microbatches per batch "
                              f"and {num_minibatches} minibatches",
                              f"both must be multiples of the replicas ({replicas}): each copy "
                              "of the pipeline gets an equal share of every batch")
        one = make_placed_schedule(kind, P, num_minibatches // replicas, num_stages=num_stages,
                                   chunks=chunks, microbatches=m0 // replicas, limit=limit,
                                   costs=costs, comm=comm)
        return _replicate(one, replicas, m0)
    if kind not in PLACED_KINDS:
        raise ConfigError(f"{kind!r} is not a placed kind", f"use one of {PLACED_KINDS}")
    if not isinstance(P, int) or P < 1:
        raise ConfigError(f"num_processes={P!r}", "use 1 or more processes")
    if kind in V_KINDS and num_stages not in (None, 2 * P):
        raise ConfigError(f"{kind} with {num_stages} stages on {P} processes",
                          f"{kind} places two stages per process in a V: split the model into "
                          f"{2 * P} stages")
    if chunks < 1:
        raise ConfigError(f"chunks={chunks}", "use at least 1 chunk per process")
    S = num_stages if num_stages is not None else (2 if kind in V_KINDS else chunks) * P
    hosts = placement(kind, S, P)
    m = microbatches if microbatches is not None else 2 * P
    n = num_minibatches
    if m < 1 or n < 0:
        raise ConfigError(f"microbatches={m}, num_minibatches={n}",
                          "use at least 1 microbatch per batch and 0 or more minibatches")
    megatron = kind == INTERLEAVED and S % P == 0
    batches = [list(range(b * m, min(n, (b + 1) * m))) for b in range(math.ceil(n / m))]
    if megatron and any(len(mbs) % P for mbs in batches):
        bad = next(len(mbs) for mbs in batches if len(mbs) % P)
        raise ConfigError(f"interleaved-1f1b with a batch of {bad} microbatches on {P} "
                          "processes", f"Megatron's interleaved order needs microbatches per "
                          f"batch (and num_minibatches) to be a multiple of the processes ({P})")
    if kind == DUALPIPEV and any(len(mbs) < 2 * P for mbs in batches):
        bad = next(len(mbs) for mbs in batches if len(mbs) < 2 * P)
        raise ConfigError(f"dualpipev with a batch of {bad} microbatches on {P} processes",
                          f"DualPipeV needs at least as many microbatches per batch as stages "
                          f"({2 * P}), the last batch included: microbatches >= {2 * P} and "
                          "num_minibatches a multiple of them")
    cap = limit if limit is not None else P
    merged: list[list[Step]] = [[] for _ in range(P)]
    for b, mbs in enumerate(batches):
        if megatron:
            parts = [megatron_order(p, P, S // P, mbs) for p in range(P)]
        elif kind == DUALPIPEV:
            parts = [dualpipev_order(p, P, mbs) for p in range(P)]
        else:
            parts = greedy_orders(hosts, S, mbs, cap, kind == ZBV, costs, comm)
        for p in range(P):
            merged[p] += parts[p] + [(r, Action("U", b)) for r in hosts[p]]
    return _stamp(kind, S, n, m, hosts, merged)


def _replicate(one: PlacedSchedule, R: int, m: int) -> PlacedSchedule:
    """R copies of ``one`` (see make_placed_schedule): copy j's local minibatch i is global
    minibatch i * R + j; updates keep their numbers."""
    def glob(a: Action, j: int) -> Action:
        return a if a.kind == "U" else Action(a.kind, a.minibatch * R + j, a.version)

    sched = one.schedule
    acts = {(s, j): tuple(glob(a, j) for a in sched.actions[(s, 0)])
            for s in range(sched.num_stages) for j in range(R)}
    hosts = tuple(tuple((s, j) for s, _ in h) for j in range(R) for h in one.hosts)
    order = tuple(tuple(((s, j), glob(a, j)) for (s, _), a in steps)
                  for j in range(R) for steps in one.order)
    placed = PlacedSchedule(Schedule(sched.kind, (R,) * sched.num_stages,
                                     sched.num_minibatches * R, acts, m, 1, ()), hosts, order)
    validate_placed(placed)
    return placed


def _stamp(kind: str, S: int, n: int, m: int, hosts: Sequence[Sequence[Rank]],
           merged: list[list[Step]]) -> PlacedSchedule:
    """Project the merged lists on the ranks, stamp 1f1b-flush's versions, validate."""
    per_rank: dict[Rank, list[Action]] = {(s, 0): [] for s in range(S)}
    for steps in merged:
        for r, a in steps:
            per_rank[r].append(a)
    stamped = {r: _with_versions(acts, lambda k, u: u) for r, acts in per_rank.items()}
    sched = Schedule(kind, (1,) * S, n, stamped, m, 1, ())
    pos = {r: 0 for r in stamped}
    order = []
    for steps in merged:
        out = []
        for r, _ in steps:
            out.append((r, stamped[r][pos[r]]))
            pos[r] += 1
        order.append(tuple(out))
    placed = PlacedSchedule(sched, tuple(tuple(h) for h in hosts), tuple(order))
    validate_placed(placed)
    return placed


# ----------------------------------------------------------------------------- validation

def validate_placed(placed: PlacedSchedule) -> None:
    """Raise :class:`ScheduleError` unless every rank's list is valid on its own (F before B
    before W before U, versions), each stage is hosted exactly once, each process's merged list
    projects onto its ranks' lists, and the processes can carry their lists out in order
    (:func:`process_order`: :class:`DeadlockError` if not)."""
    sched = placed.schedule
    if len(set(sched.replicas)) > 1:
        raise ScheduleError(f"placed schedule with replicas {list(sched.replicas)}",
                            "replicate the whole pipeline: every stage the same number of times")
    validate(sched)
    hosted = [r for h in placed.hosts for r in h]
    if sorted(hosted) != sorted(sched.ranks):
        raise ScheduleError(f"hosted ranks {sorted(hosted)} != {list(sched.ranks)}",
                            "place every stage on exactly one process")
    if len(placed.order) != len(placed.hosts):
        raise ScheduleError(f"{len(placed.order)} merged lists for {len(placed.hosts)} processes",
                            "give one merged list per process")
    for p, h in enumerate(placed.hosts):
        twice = sorted(s for s in {r[0] for r in h} if sum(r[0] == s for r in h) > 1)
        if twice:
            raise ScheduleError(f"process {p} hosts several replicas of stage {twice[0]}",
                                "replicas of a stage all-reduce with each other: put them on "
                                "different processes")
    for p, steps in enumerate(placed.order):
        for r in placed.hosts[p]:
            mine = tuple(a for q, a in steps if q == r)
            if mine != sched.actions[r]:
                raise ScheduleError(f"process {p}: its merged list runs stage {r[0]} as "
                                    f"{' '.join(map(str, mine))}, the stage's list is "
                                    f"{' '.join(map(str, sched.actions[r]))}",
                                    "merge the hosted ranks' lists without reordering them")
        strays = sorted({q for q, _ in steps} - set(placed.hosts[p]))
        if strays:
            raise ScheduleError(f"process {p} runs actions of stages {strays} it does not host",
                                "a process runs only its own stages")
    _check_flush(sched)
    process_order(placed)


def _check_flush(sched: Schedule) -> None:
    """Minibatch SGD: batch b's gradients (every B and W of minibatches b*m .. b*m + m - 1) are
    all in before U<b>, and no minibatch of a later batch runs before it (versions are
    1f1b-flush's: a forward of batch b reads version b)."""
    m = sched.group
    for r, acts in sched.actions.items():
        updates = 0
        for a in acts:
            if a.kind == "U":
                updates += 1
            elif a.minibatch // m != updates:
                raise ScheduleError(f"{a} on stage {r[0]} replica {r[1]} after {updates} updates: "
                                    f"minibatch {a.minibatch} belongs to batch {a.minibatch // m}",
                                    "a flushing schedule runs batch b between U<b-1> and U<b>")


def process_order(placed: PlacedSchedule) -> list[tuple[int, int]]:
    """Execute every process's merged list in order against the data dependencies (F(k) on
    stage s needs F(k) on s - 1, B(k) needs B(k) on s + 1, or its own F(k) on the last stage, W
    needs its B; an update needs nothing when the stage has one replica, else every replica's
    process at that same update: one all-reduce); a message between stages of one process is
    there as soon as its producer ran. Return (process, index) in a valid
    execution order, or raise :class:`DeadlockError` naming each stuck process and what it waits
    for."""
    S = placed.schedule.num_stages
    ptr = [0] * placed.num_processes
    done: set[tuple[str, int, int]] = set()
    out: list[tuple[int, int]] = []

    where = {r: p for p, h in enumerate(placed.hosts) for r in h}
    R = placed.schedule.replicas[0] if S else 1

    def need(r: Rank, a: Action) -> tuple[str, int, int] | None:
        s = r[0]
        if a.kind == "U":
            return None
        if a.kind == "F":
            return None if s == 0 else ("F", s - 1, a.minibatch)
        if a.kind == "W":
            return ("B", s, a.minibatch)
        return ("F", s, a.minibatch) if s == S - 1 else ("B", s + 1, a.minibatch)

    progress = True
    while progress:
        progress = False
        for p, steps in enumerate(placed.order):
            while ptr[p] < len(steps):
                r, a = steps[ptr[p]]
                if a.kind == "U" and R > 1:  # an all-reduce: every replica's process there
                    peers = [where[(r[0], j)] for j in range(R)]
                    if not all(ptr[q] < len(placed.order[q]) and
                               placed.order[q][ptr[q]] == ((r[0], j), a)
                               for j, q in enumerate(peers)):
                        break
                    for q in peers:
                        out.append((q, ptr[q]))
                        ptr[q] += 1
                    progress = True
                    continue
                dep = need(r, a)
                if dep is not None and dep not in done:
                    break
                done.add((a.kind, r[0], a.minibatch))
                out.append((p, ptr[p]))
                ptr[p] += 1
                progress = True
    stuck = {p: placed.order[p][i] for p, i in enumerate(ptr) if i < len(placed.order[p])}
    if stuck:
        parts = []
        for p, (r, a) in sorted(stuck.items()):
            dep = need(r, a)
            what = f"{dep[0]}{dep[2]} on stage {dep[1]}" if dep else "nothing"
            parts.append(f"process {p} stuck at {a} of stage {r[0]} waiting for {what}")
        raise DeadlockError("deadlock: " + "; ".join(parts),
                            "reorder the merged lists so each process's next action can become "
                            "ready", {r: a for r, a in stuck.values()})
    return out


def timed_placed(placed: PlacedSchedule, costs: Sequence[tuple[float, float, float]],
                 comm: float | Sequence[float] = 0.0, update: float | Sequence[float] = 0.0
                 ) -> dict[tuple[int, int], tuple[float, float]]:
    """(process, index) -> (start, end) of every step of ``placed``: each process runs its
    merged list in order, an action starting when its process is free and its input is there
    (``comm[s]`` seconds after its producer ended for a message across the cut into stage s,
    activations and gradients alike, when the producer is on another process; at once when on
    the same one). ``costs[s]`` = (F, B, W) of stage s (a fused backward costs B + W);
    ``update[s]``: an update of stage s, its replicas' processes starting it together."""
    sched = placed.schedule
    S = sched.num_stages
    wire = [float(comm)] * S if isinstance(comm, (int, float)) else [float(c) for c in comm]
    upd = [float(update)] * S if isinstance(update, (int, float)) else [float(u) for u in update]
    if len(costs) != S or len(wire) != S or len(upd) != S:
        raise ConfigError(f"{len(costs)} costs, {len(wire)} comm and {len(upd)} update times "
                          f"for {S} stages", "give one of each per stage")
    where = {r: p for p, h in enumerate(placed.hosts) for r in h}
    split = {r for r, acts in sched.actions.items() if any(a.kind == "W" for a in acts)}
    together: dict[tuple[int, int], float] = {}  # (stage, update) -> start of its all-reduce
    free = [0.0] * placed.num_processes
    end: dict[tuple[str, int, int], float] = {}
    out: dict[tuple[int, int], tuple[float, float]] = {}
    for p, i in process_order(placed):
        r, a = placed.order[p][i]
        s, k = r[0], a.minibatch
        f, b, w = costs[s]
        if a.kind == "U":
            key = (s, k)
            if key not in together:
                together[key] = max(free[where[(s, j)]] for j in range(sched.replicas[s]))
            start, dur = together[key], upd[s]
        else:
            if a.kind == "F":
                src, cut = (None, 0) if s == 0 else (("F", s - 1, k), s)
            elif a.kind == "W":
                src, cut = ("B", s, k), 0
            else:
                src, cut = (("F", s, k), 0) if s == S - 1 else (("B", s + 1, k), s + 1)
            ready = 0.0
            if src is not None:
                ready = end[src] + (wire[cut] if where[sched.owner(src[1], k)] != p else 0.0)
            start = max(free[p], ready)
            dur = f if a.kind == "F" else w if a.kind == "W" else (b if r in split else b + w)
        end[(a.kind, s, k)] = start + dur
        free[p] = start + dur
        out[(p, i)] = (start, start + dur)
    return out


def simulate_placed(placed: PlacedSchedule, costs: Sequence[tuple[float, float, float]],
                    comm: float | Sequence[float] = 0.0, update: float | Sequence[float] = 0.0
                    ) -> tuple[float, list[float]]:
    """(makespan, busy seconds per process) of ``placed`` (see :func:`timed_placed`)."""
    times = timed_placed(placed, costs, comm, update)
    busy = [0.0] * placed.num_processes
    for (p, _), (t0, t1) in times.items():
        busy[p] += t1 - t0
    return max((t1 for _, t1 in times.values()), default=0.0), busy


__all__ = ["INTERLEAVED", "ZBV", "DUALPIPEV", "V_KINDS", "PLACED_KINDS", "PlacedSchedule",
           "placement", "megatron_order",
           "greedy_orders", "make_placed_schedule", "validate_placed", "process_order",
           "timed_placed", "simulate_placed"]
_ = DeadlockError  # re-exported for callers catching it from here
