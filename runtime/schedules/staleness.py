"""How stale are the weights a gradient was computed on when it is applied? Per stage, per schedule.

Worst steady-state delay, in the stage's own updates (``u - v``: ``U<u>`` applies a gradient read on
version v) and in Randomized PipeDream's global block-update counts. Pure Python, from the schedule.
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from fxpipe.errors import ConfigError
from fxpipe.passes.plan import format_staleness

from .kinds import make_schedule
from .localsgd import DEFAULT_AVERAGE_EVERY, LOCALSGD, LocalSGDSchedule, make_localsgd_schedule
from .schedule import SCHEDULE_KINDS, Rank, Schedule
from .simulate import simulate

VARIANTS = ("1f1b-flush", "gpipe", "2bw", "pipedream", "pipedream+vsync", LOCALSGD)
"""The schedule variants a staleness report covers, in report order."""


@dataclass(frozen=True)
class StageStaleness:
    """Worst-case delay of one stage's updates (see docs/design-notes.md for the units)."""

    stage: int
    own: int
    global_: int
    divergence: int = 0


@dataclass(frozen=True)
class Staleness:
    """Per-stage delays of one schedule variant."""

    schedule: str
    stages: tuple[StageStaleness, ...]

    @property
    def max_own(self) -> int:
        return max((s.own for s in self.stages), default=0)

    @property
    def max_global(self) -> int:
        return max((s.global_ for s in self.stages), default=0)

    def pairs(self) -> tuple[tuple[int, int], ...]:
        """((own, global) per stage): the plan JSON's representation."""
        return tuple((s.own, s.global_) for s in self.stages)


def schedule_staleness(sched: Schedule) -> Staleness:
    """The per-stage worst-case delays of ``sched`` (docs/design-notes.md)."""
    S = sched.num_stages
    local = isinstance(sched, LocalSGDSchedule)
    tl = simulate(sched, [1.0] * S, [1.0] * S)
    # one global update per (stage, update index) -- per (stage, update, replica) for LocalSGD,
    # whose replicas are separate models -- at the time all replicas do it
    upd: dict[tuple[int, int, int], float] = {}
    fwd: dict[tuple[int, int], tuple[float, int]] = {}  # (stage, minibatch) -> (read time, version)
    rounds: dict[Rank, list[tuple[int, list[int]]]] = {}  # rank -> [(update index, its minibatches)]
    for rank, events in tl.events.items():
        since: list[int] = []
        rounds[rank] = []
        for e in events:
            a = e.action
            if a.kind == "F":
                fwd[(rank[0], a.minibatch)] = (e.start, a.version if a.version is not None else 0)
            elif a.kind == "B":
                since.append(a.minibatch)
            else:
                upd[(rank[0], a.minibatch, rank[1] if local else 0)] = e.start
                rounds[rank].append((a.minibatch, since))
                since = []
    per_model: dict[int, list[float]] = {}
    for (_, _, m), t in upd.items():
        per_model.setdefault(m, []).append(t)
    times = {m: sorted(ts) for m, ts in per_model.items()}

    def before(m: int, t: float) -> int:  # updates of model m strictly before t
        return bisect.bisect_left(times[m], t)

    def upto(m: int, t: float) -> int:  # updates of model m at or before t
        return bisect.bisect_right(times[m], t)

    def iterate(m: int, t: int, k: int) -> int:
        """Global count of the iterate minibatch k read from stage t (docs/design-notes.md)."""
        r, v = fwd[(t, k)]
        nxt = upd.get((t, v, m))  # the update producing version v + 1 of stage t
        return before(m, nxt) if nxt is not None and nxt <= r else upto(m, r)

    by_update = {rank: dict(rs) for rank, rs in rounds.items()}
    lo, hi = sched.num_minibatches // 4, sched.num_minibatches - sched.num_minibatches // 4
    out = []
    for s in range(S):
        own = glob = div = 0
        for j in range(sched.replicas[s]):
            m = j if local else 0
            for u, mbs in rounds[(s, j)]:
                t_u = upd[(s, u, m)]
                # the minibatches of this update: all replicas' (they all-reduce), or this one's
                group = mbs if local else [k for jj in range(sched.replicas[s])
                                           for k in by_update[(s, jj)].get(u, ())]
                if not any(lo <= k < hi for k in group):
                    continue  # fill and drain: not the steady state
                for k in group:
                    own = max(own, u - fwd[(s, k)][1])
                    oldest = min(iterate(m, t, k) for t in range(S))
                    glob = max(glob, before(m, t_u) - oldest)
                if local:
                    h = sched.average_every  # type: ignore[attr-defined]
                    div = max(div, (sched.replicas[s] - 1) * (u % h))
        out.append(StageStaleness(s, own, glob, div))
    return Staleness(sched.kind, tuple(out))


def variant_schedule(variant: str, replicas: Sequence[int], num_minibatches: int, *,
                     microbatches: int | None = None,
                     average_every: int = DEFAULT_AVERAGE_EVERY,
                     noam: int | None = None) -> Schedule:
    """The schedule of one of :data:`VARIANTS` (or a plain kind) for ``replicas``, with
    ``noam`` minibatches in flight at the input stage (default: PipeDream's).
    LocalSGD ignores ``replicas``' counts: it runs S replicas of the S-stage pipeline."""
    S = len(replicas)
    if variant == LOCALSGD:
        return make_localsgd_schedule(S, S, num_minibatches, average_every=average_every)
    kind, _, extra = variant.partition("+")
    if kind not in SCHEDULE_KINDS or extra not in ("", "vsync"):
        raise ConfigError(f"unknown schedule variant {variant!r}", f"use one of {VARIANTS}")
    sched = make_schedule(kind, list(replicas), num_minibatches, microbatches=microbatches,
                          noam=noam)
    return sched.with_vertical_sync() if extra else sched


def steady_minibatches(replicas: Sequence[int], microbatches: int | None = None) -> int:
    """Enough minibatches for every variant to reach its steady state several times over."""
    m = microbatches or sum(replicas)
    return 4 * math.lcm(sum(replicas), m, *replicas) + 4 * m + 8 * len(replicas)


def staleness_table(replicas: Sequence[int], variants: Sequence[str] = VARIANTS, *,
                    microbatches: int | None = None,
                    average_every: int = DEFAULT_AVERAGE_EVERY,
                    noam: int | None = None) -> dict[str, Staleness]:
    """variant -> its per-stage delays on a pipeline with ``replicas``. Variants a pipeline
    cannot run (vertical sync with unequal replica counts) are left out. ``noam``: the
    pipedream variants' minibatches in flight at the input stage (default: PipeDream's)."""
    n = steady_minibatches(replicas, microbatches) + 4 * (noam or 0)
    out: dict[str, Staleness] = {}
    for v in variants:
        try:
            sched = variant_schedule(v, replicas, n, microbatches=microbatches,
                                     average_every=average_every,
                                     noam=noam if v.partition("+")[0] == "pipedream" else None)
        except ConfigError:
            if v.endswith("+vsync") and len(set(replicas)) > 1:
                continue
            raise
        st = schedule_staleness(sched)
        out[v] = Staleness(v, st.stages)
    return out


def own_delays(kind: str, replicas: Sequence[int], *, vertical_sync: bool = False,
               microbatches: int | None = None, noam: int | None = None) -> list[int]:
    """Each stage's own-update delay for a schedule kind (and ``noam``, the minibatches in
    flight at the input stage): what the optimizer factory receives as ``delay`` and what
    the mitigations scale by."""
    variant = kind + ("+vsync" if vertical_sync and kind != LOCALSGD else "")
    n = steady_minibatches(replicas, microbatches) + 4 * (noam or 0)
    sched = variant_schedule(variant, replicas, n, microbatches=microbatches, noam=noam)
    return [s.own for s in schedule_staleness(sched).stages]


def format_table(table: Mapping[str, Any], *, max_stages: int = 8) -> str:
    """Rows of ``own/global`` per stage (``table``: variant -> Staleness or (own, global) pairs);
    pipelines deeper than ``max_stages`` show the worst stage only."""
    if not table:
        return ""
    return format_staleness({v: (t.pairs() if isinstance(t, Staleness) else t)
                             for v, t in table.items()}, max_stages)


STALENESS_BUDGET = 6000
"""Largest (minibatches x ranks) simulated per variant for a plan's report: deeper or wider
pipelines take seconds per variant in pure Python, so their plans carry no table (compute one
with :func:`staleness_table` when needed)."""


def plan_staleness(replicas: Sequence[int], noam: int | None = None
                   ) -> dict[str, tuple[tuple[int, int], ...]]:
    """The table a plan carries (``Plan.staleness``): variant -> per-stage (own, global); empty
    when the pipeline is beyond :data:`STALENESS_BUDGET`. ``noam``: the window the trainer
    admits under pipedream (``Plan.window``; default PipeDream's NOAM)."""
    if steady_minibatches(replicas) * sum(replicas) > STALENESS_BUDGET:
        return {}
    return {v: st.pairs() for v, st in staleness_table(replicas, noam=noam).items()}
