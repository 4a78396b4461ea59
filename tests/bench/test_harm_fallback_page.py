"""bench/harm_fallback's page from hand-made launches: every figure computed by hand."""
from __future__ import annotations

import time

from bench.harm_fallback import page, timed_rate


def _rank0(segments: list, records: list, wall: float, verdicts: list | None = None
           ) -> list[dict]:
    return [{"segments": segments, "wall_s": wall, "records": records, "harm": None,
             "verdicts": verdicts or []}, {}]


def test_the_rate_counts_only_the_segments_from_minibatch_24() -> None:
    # 2 samples per minibatch; from 24: 8 + 8 minibatches in 1 + 3 s -> 32 / 4 = 8
    res = {"segments": [(0, 8, 100.0), (8, 16, 100.0), (24, 8, 1.0), (32, 8, 3.0)]}
    assert timed_rate(res, 2) == 8.0


def test_page_by_hand() -> None:
    segs_two = [(0, 8, 9.0), (8, 16, 9.0), (24, 16, 4.0)]      # 4 x 16 / 4 = 16 samples/s
    segs_one = [(0, 8, 9.0), (8, 16, 9.0), (24, 16, 2.0)]      # 4 x 16 / 2 = 32 samples/s
    fell = [{"position": 8, "adopted": False, "replicas": [1, 1], "gain": 0.0},
            {"position": 24, "adopted": True, "replicas": [1], "gain": 0.5}]
    # the verdict's inputs (compute sum, profile's steps, segment s): the first is not judged;
    # per launch the medians of 4/2, 4/4 -> 1.5 (by the sum) and of 4/1, 4/2 -> 3.0 (by the
    # profile); the third launch had no measured profile (None): no profile figure
    two_v = [(9.0, 9.0, 9.0), (2.0, 1.0, 4.0), (4.0, 2.0, 4.0)]
    got = {"two": [_rank0(segs_two, [], 30.0, two_v)] * 2
           + [_rank0(segs_two, [], 30.0, [(c, None, d) for c, _, d in two_v])],
           "replan": [_rank0(segs_one, fell, 22.5)] * 2 + [_rank0(segs_two, fell[:1], 22.0)],
           "one": [20.0, 20.0, 20.0]}
    plan = {"replicas": [1, 1], "predicted_s": 0.2}
    text = page([("gpt", 20, plan, got)], 3, time.perf_counter())
    # gpt: 4 samples per minibatch. 2 workers: 16 / 20 = 0.80. replan: 32, 32 and 16 (the
    # launch that kept the plan) -> median 32 [16-32], / one 1.60 [0.80-1.60];
    # fell back in 2 of 3, the verdict 1.5x; switch: 22.5 - 20 = 2.5, 2.5, 22 - 22 = 0
    assert ("| gpt | 20 | [1, 1] (200.0) | 20.0 [20.0-20.0] | 16.0 [16.0-16.0] | 0.80 [0.80-0.80] "
            "| 32.0 [16.0-32.0] | 1.60 [0.80-1.60] | 2 of 3 | 1.50x [1.50-1.50] | 2.5 [0.0-2.5] "
            "| 1.50 [1.50-1.50] | 3.00 [3.00-3.00] |") in text
