"""timed_placed / simulate_placed, the placed kinds' simulator: start and end of every step
derived by hand in a timeline table, with costs F, B, W all different and a different message
time on every cut, so that each timing rule (which producer, which cut, same process or not,
which duration) shows in the numbers."""
from __future__ import annotations

from fxpipe.runtime.schedules.placement import (PlacedSchedule, make_placed_schedule,
                                                simulate_placed, timed_placed)

COSTS = [(2.0, 3.0, 1.0)] * 4  # F = 2, B = 3 (input gradients), W = 1 on each stage


def _zb_v_one_minibatch() -> PlacedSchedule:
    """zb-v on 2 processes, one minibatch: stages 0, 3 on process 0 and 1, 2 on process 1.
    The greedy order with unit costs (oldest ready B, else deepest ready F, else a W that
    delays nothing): t0 p0 F0@0; t1 p1 F0@1; t2 p1 F0@2; t3 p0 F0@3; t4 p0 B0@3; t5 p1 B0@2,
    p0 W0@3 (nothing else it may run is on its way: B0@0 waits for B0@1, not yet scheduled);
    t6 p1 B0@1 (a B before the W0@2 waiting); t7 p0 B0@0, p1 W0@2; t8 W0@0, W0@1; then the
    updates of each process's stages in hosting order."""
    ps = make_placed_schedule("zb-v", 2, 1, microbatches=1)
    assert ps.grid() == ["p0  |F0@0 F0@3 B0@3 W0@3 B0@0 W0@0 U0@0 U0@3",
                         "p1  |F0@1 F0@2 B0@2 B0@1 W0@2 W0@1 U0@1 U0@2"]
    return ps


def test_timed_placed_by_hand_with_a_message_time_per_cut() -> None:
    """comm[s] = time of a message across the cut into stage s: [8, 1, 2, 4] (cut 0 has no
    producer; cut 2, between stages 1 and 2, is inside process 1: no wait); update[s]: [0.5,
    0.25, 0.75, 1]. An action starts when its process is free and its input is there:

    step    proc  input (end + comm if from the other process)  start  end
    F0@0    p0    -                                              0      2
    F0@1    p1    F0@0 2 + comm[1] 1 = 3                         3      5
    F0@2    p1    F0@1 5 (same process)                          5      7
    F0@3    p0    F0@2 7 + comm[3] 4 = 11                        11     13
    B0@3    p0    F0@3 13 (its own forward)                      13     16   (B = 3)
    W0@3    p0    B0@3 16                                        16     17   (W = 1)
    B0@2    p1    B0@3 16 + comm[3] 4 = 20                       20     23
    B0@1    p1    B0@2 23 (same process)                         23     26
    W0@2    p1    B0@2; process free at 26                       26     27
    W0@1    p1    B0@1                                           27     28
    B0@0    p0    B0@1 26 + comm[1] 1 = 27                       27     30
    W0@0    p0                                                   30     31
    U0@0    p0    its process free (one replica)                 31     31.5
    U0@3    p0                                                   31.5   32.5
    U0@1    p1                                                   28     28.25
    U0@2    p1                                                   28.25  29

    makespan 32.5; busy p0 = 2 + 2 + 3 + 1 + 3 + 1 + 0.5 + 1 = 13.5, p1 = 2 + 2 + 3 + 3 + 1 + 1
    + 0.25 + 0.75 = 13."""
    ps = _zb_v_one_minibatch()
    comm, update = [8.0, 1.0, 2.0, 4.0], [0.5, 0.25, 0.75, 1.0]
    p0 = [(0, 2), (11, 13), (13, 16), (16, 17), (27, 30), (30, 31), (31, 31.5), (31.5, 32.5)]
    p1 = [(3, 5), (5, 7), (20, 23), (23, 26), (26, 27), (27, 28), (28, 28.25), (28.25, 29)]
    want = {**{(0, i): t for i, t in enumerate(p0)}, **{(1, i): t for i, t in enumerate(p1)}}
    assert timed_placed(ps, COSTS, comm, update) == want
    assert simulate_placed(ps, COSTS, comm, update) == (32.5, [13.5, 13.0])


def test_timed_placed_defaults_no_message_time_and_instant_updates() -> None:
    """The same schedule and costs, comm and update left out: every message is there when its
    producer ends, an update takes no time. F0@0 0-2, F0@1 2-4, F0@2 4-6, F0@3 6-8, B0@3 8-11,
    W0@3 11-12, B0@2 11-14, B0@1 14-17, W0@2 17-18, W0@1 18-19, B0@0 17-20 (p0 free at 12),
    W0@0 20-21; the updates at 21 (p0) and 19 (p1), 0 s each."""
    ps = _zb_v_one_minibatch()
    p0 = [(0, 2), (6, 8), (8, 11), (11, 12), (17, 20), (20, 21), (21, 21), (21, 21)]
    p1 = [(2, 4), (4, 6), (11, 14), (14, 17), (17, 18), (18, 19), (19, 19), (19, 19)]
    want = {**{(0, i): t for i, t in enumerate(p0)}, **{(1, i): t for i, t in enumerate(p1)}}
    assert timed_placed(ps, COSTS) == want


def test_simulating_no_minibatches_takes_no_time() -> None:
    """0 minibatches: an empty schedule, every process idle, a makespan of 0."""
    empty = make_placed_schedule("zb-v", 2, 0)
    assert simulate_placed(empty, COSTS) == (0.0, [0.0, 0.0])
