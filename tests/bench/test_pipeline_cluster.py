"""The pipeline-cluster bench's bounds, against schedules timed by hand."""
from __future__ import annotations

import pytest

from bench.pipeline_cluster import schedule_bound, stage_times


def test_flush_bound_is_the_input_stage_when_it_carries_the_work() -> None:
    # m = 2, stage 0 F 10 B 15 U 1, stage 1 F 1 B 1 U 1 (ms). Stage 0: F0 0-10, F1 10-20;
    # stage 1 returns grad 0 at 12 and grad 1 at 22, so stage 0 runs B0 20-35, B1 35-50,
    # U 50-51 and the next update starts at 51: 51 ms per 32 samples.
    times = [(0.010, 0.015, 0.001), (0.001, 0.001, 0.001)]
    assert schedule_bound(times, "1f1b-flush", 2, 32) == pytest.approx(32 / 0.051)


def test_flush_bound_counts_the_bubble() -> None:
    # m = 2, stage 0 F 1 B 1 U 1, stage 1 F 10 B 10 U 1 (ms). Stage 0: F0 0-1, F1 1-2;
    # stage 1: F0 1-11, B0 11-21, F1 21-31, B1 31-41, U 41-42; stage 0: B0 21-22, B1 41-42,
    # U 42-43; the next update's F2 on stage 0 at 43-44 reaches stage 1 at 44: 43 ms per
    # update, against the busiest rank's 41 ms of compute.
    times = [(0.001, 0.001, 0.001), (0.010, 0.010, 0.001)]
    assert schedule_bound(times, "1f1b-flush", 2, 32) == pytest.approx(32 / 0.043)


def test_stage_times_are_medians_inside_the_window_per_stage() -> None:
    def ev(cat: str, start: float, length: float, name: str = "") -> list:
        return [cat, name or cat[0].upper(), start, start + length, {}]

    ranks = [{"stage": 1, "events": [ev("forward", 0, 4), ev("backward", 4, 6),
                                     ev("optimizer", 10, 0.1, "U0 gradients"),
                                     ev("optimizer", 10.1, 0.1, "U0 gradients"),
                                     ev("optimizer", 10.2, 1), ev("idle", 11.2, 5)]},
             {"stage": 0, "events": [ev("forward", 0, 2), ev("forward", 2, 3),
                                     ev("forward", 5, 7), ev("backward", 12, 5),
                                     ev("optimizer", 17, 2), ev("forward", 30, 99)]}]
    assert stage_times(ranks, 0, 20) == [(3, 5, 2), (4, 6, 1)]
