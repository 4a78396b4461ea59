"""The yardstick of ``schedule="auto"``'s pilot: pure numbers that :mod:`.auto` decides with.

The loss level a candidate must reach (where the baseline's smoothed pilot curve ends), the
minibatches each candidate pilots (equal seconds, not equal minibatches), and when a pilot may
stop early without changing the choice."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

STRETCH = 2
"""A candidate faster than the baseline pilots more minibatches in the baseline's seconds
(:func:`equal_time`), at most this many times the baseline's (and never past ``max_fraction``
of the run): what bounds the pilot's reading where the run's length is unknown."""


def smooth(losses: Sequence[float], window: int) -> list[float]:
    """Trailing mean over ``window`` values (fewer at the start); NaN/inf stay NaN/inf."""
    out, acc = [], 0.0
    for i, x in enumerate(losses):
        acc += x
        if i >= window:
            acc -= losses[i - window]
        out.append(acc / min(i + 1, window) if math.isfinite(acc) else math.inf)
    return out


def to_level(curve: Sequence[float], level: float, window: int) -> float:
    """Minibatches until ``curve``, smoothed over ``window``, reaches ``level`` (inf: never;
    the first ``window - 1`` minibatches, a partial mean, do not count)."""
    sm = smooth(curve, window)
    if not sm or not all(math.isfinite(x) for x in curve):
        return math.inf
    for i in range(window - 1, len(sm)):
        if sm[i] <= level:
            return float(i + 1)
    return math.inf


def equal_time(lengths: Mapping[str, int], periods: Mapping[str, float],
               baseline: str = "1f1b-flush") -> dict[str, int]:
    """Minibatches of each candidate that fit in the baseline's pilot seconds
    (``lengths[baseline] x periods[baseline]``), at most its ``lengths`` and at least one.

    Why equal seconds, not equal minibatches: the level is where the baseline ends its pilot,
    so with equal minibatches a candidate 1.7x faster per minibatch but 2% less efficient per
    update never reaches it within the pilot and is never chosen, however much sooner it would
    get there in time. Replayed on the 1,000-update rows (benchmarks/long-horizon.md), picks
    made on equal minibatches took 1.25-1.31x the best schedule's time to target, on equal
    seconds 1.02-1.05x (pilot cost aside, pilots of 50-200 of flush's minibatches). The
    baseline, not the fastest candidate, sets the budget: on the 200-update MLP at S = 8
    pipedream's minibatch costs a sixth of flush's, and flush's loss after a sixth of the pilot
    is a level that stale schedules reach early and then stall short of the target."""
    budget = lengths[baseline] * periods[baseline]
    return {c: max(1, min(n, math.floor(budget / periods[c] * (1 + 1e-9))))
            for c, n in lengths.items()}


def pilot_lengths(names: Sequence[str], periods: Mapping[str, float], pilot_len: int, cap: int,
                  step: int = 1, baseline: str = "1f1b-flush") -> dict[str, int]:
    """Minibatches each of ``names`` pilots: the baseline ``pilot_len``, the others as many as
    fit in the baseline's seconds (:func:`equal_time`), at most ``cap`` (what the pilot may
    read) and in whole multiples of ``step`` (at least one step)."""
    lengths = equal_time({**{c: cap for c in names}, baseline: pilot_len},
                         {**periods}, baseline)
    return {c: max(step, n - n % step) for c, n in lengths.items() if c in names}


@dataclass(frozen=True)
class Level:
    """The loss level a pilot is judged against: where the baseline's smoothed curve ends
    (trailing mean over ``window`` = max(5, P // 8) of its P minibatches, at most P: a pilot
    shorter than 5 minibatches must still reach its own level)."""

    level: float
    window: int

    @classmethod
    def of(cls, baseline: Sequence[float]) -> Level:
        P = len(baseline)
        window = max(1, min(max(5, P // 8), P))
        return cls(smooth(baseline, window)[-1], window)

    def minibatches(self, curve: Sequence[float]) -> float:
        """Minibatches until ``curve`` reaches the level (inf: not within it)."""
        return to_level(curve, self.level, self.window)


def can_stop(curve: Sequence[float], period: float, level: Level, bound_s: float) -> bool:
    """Whether a candidate's pilot may end now without changing the choice of
    :func:`~.auto.decide`: it has reached the level (its count is known; more minibatches do
    not change the first one that reached it), or its seconds so far are at least ``bound_s``,
    the least predicted time of the candidates piloted before it (decide picks the least time,
    the earlier one on a tie, so it can no longer be picked). The pilot on the pipeline stops
    there: what it saves is a loser's seconds, which the winner does not repay."""
    return math.isfinite(level.minibatches(curve)) or len(curve) * period >= bound_s
