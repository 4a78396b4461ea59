"""Reduce a run of a schedule, simulated or measured, to its steady-state period and peak in flight.

Shared by :mod:`.plansim`, :mod:`.placed_sim` and the benchmarks, so a measured timeline is reduced
like a simulated one; a window's busy fraction is :func:`fxpipe.runtime.timeline.busy_between`.
"""
from __future__ import annotations

import itertools
import math
from typing import Any, Sequence

from fxpipe.errors import ConfigError

from ..schedules.schedule import SYNCHRONOUS_KINDS, Action


def steady_state(sched: Any, done: list[float], makespan: float) -> tuple[float, float, float]:
    """(seconds per minibatch once the pipeline is full, window start, window end) of a run of
    ``sched`` in which minibatch k's last backward ended at ``done[k]``: the simulator's measure,
    public so that a MEASURED run (the runtime's timeline) is reduced the same way."""
    if len(done) != sched.num_minibatches:
        raise ConfigError(f"{len(done)} completion times for {sched.num_minibatches} minibatches")
    return steady_window(sched.replicas, sched.kind, sched.group, done, makespan, sched.windows)


def steady_window(replicas: tuple[int, ...], kind: str, group: int, done: list[float],
                   makespan: float, windows: tuple[int, ...] = ()) -> tuple[float, float, float]:
    """(period, window start, window end): slope of round completion times over the middle half
    of the rounds (lcm(replicas) minibatches; whole batches for flushing kinds), as in
    runtime.simulate, so start-up and drain do not count."""
    n = len(done)
    g = math.lcm(*replicas)
    if kind in SYNCHRONOUS_KINDS:
        g = math.lcm(g, group)
    rounds = [max(done[k:k + g]) for k in range(0, n - g + 1, g)]
    if len(rounds) < 4:  # lcm(replicas) too large for whole rounds: slope of the running max
        run = list(itertools.accumulate(done, max))
        lo_k, hi_k = n // 4, n - 1 - n // 4
        if hi_k <= lo_k:
            return makespan / n, 0.0, makespan
        return (run[hi_k] - run[lo_k]) / (hi_k - lo_k), run[lo_k], run[hi_k]
    lo, hi = len(rounds) // 4, len(rounds) - 1 - len(rounds) // 4
    if hi <= lo:
        lo, hi = 0, len(rounds) - 1
    # 1F1B with w in flight may repeat only every w rounds: measure whole repetitions if we can
    rep = math.lcm(*windows) if windows else 1
    if hi - lo >= rep:
        hi = lo + (hi - lo) // rep * rep
    return (rounds[hi] - rounds[lo]) / ((hi - lo) * g), rounds[lo], rounds[hi]


def peak_in_flight(actions: Sequence[Action]) -> int:
    """Most minibatches a rank's list holds activations for at once: from F until B, or until
    W where the backward is split (what a zero-bubble schedule's memory depends on)."""
    split = any(a.kind == "W" for a in actions)
    held = peak = 0
    for a in actions:
        if a.kind == "F":
            held += 1
            peak = max(peak, held)
        elif a.kind == ("W" if split else "B"):
            held -= 1
    return peak
