"""greedy_orders, the list scheduler of the placed kinds, with non-unit costs and message
times: the orders derived by hand from its rules (runtime/schedules/placed_orders.py), each timeline
written out, so that every timing rule (when an input is there, how long each kind takes,
where a W fits, which process looks first at a tie) decides some step."""
from __future__ import annotations

import pytest

from fxpipe.errors import ConfigError
from fxpipe.runtime.schedules.placed_orders import Step, greedy_orders
from fxpipe.runtime.schedules.placement import placement

ZBV2 = placement("zb-v", 4, 2)  # p0: stages 0, 3; p1: stages 1, 2


def _grid(order: list[list[Step]]) -> list[str]:
    return [" ".join(f"{a}@{r[0]}" for r, a in steps) for steps in order]


def test_zb_v_with_slow_f_and_w_and_a_slow_cut_by_hand() -> None:
    """P = 2, m = 2, limit 2, F = 3, B = 1, W = 3 on every stage; a message across the cut into
    stage 3 (F0@2 -> F0@3, B0@3 -> B0@2, processes 1 <-> 0) takes 1 s, the others none. The
    rules: a free process runs the oldest ready B, else the deepest ready F (a new minibatch
    while fewer than 2 are admitted), else its oldest W if no input it waits for (B's, the
    next F's) arrives before the W would end; an idle process looks again at the next end or
    arrival; processes due at the same time look in the order their turns were queued.

    t   p0                                      p1
    0   F0@0 (to 3)                             nothing ready
    3   F1@0 (to 6)                             F0@1 (to 6)
    6   nothing (F0@3 waits for F0@2)           F0@2 (to 9; deeper than F1@1)
    9   nothing (F0@2's output arrives at 10)   F1@1 (to 12)
    10  F0@3 (to 13)
    12                                          F1@2 (to 15; its output arrives at 16)
    13  B0@3 (to 14)
    14  not W0@3: it would end at 17, F1@3's input arrives at 16; idle
    15  the same                                B0@2 (14 + 1; to 16)
    16  F1@3 (to 19)                            B0@1 (to 17)
    17                                          W0@2 (to 20; B1@2's input not scheduled)
    19  B0@0 (older than B1@3; to 20)
    20  p1 looks first (queued at 17, p0 at 19): W0@1 (to 23), B1@3 not yet scheduled;
        then p0: B1@3 (to 21)
    21  W0@3 (to 24: B1@0 waits for B1@1, not scheduled)
    23                                          B1@2 (21 + 1 = 22; to 24)
    24  W0@0 (to 27)                            B1@1 (to 25)
    25                                          W1@2 (to 28), then W1@1 (28 to 31)
    27  B1@0 (to 28), then W1@3, W1@0"""
    order = greedy_orders(ZBV2, 4, [0, 1], 2, True, [(3.0, 1.0, 3.0)] * 4, [0.0, 0.0, 0.0, 1.0])
    assert _grid(order) == [
        "F0@0 F1@0 F0@3 B0@3 F1@3 B0@0 B1@3 W0@3 W0@0 B1@0 W1@3 W1@0",
        "F0@1 F0@2 F1@1 F1@2 B0@2 B0@1 W0@2 W0@1 B1@2 B1@1 W1@2 W1@1"]


def test_interleaved_three_stages_fused_backwards_by_hand() -> None:
    """Stages 0, 2 on p0, stage 1 on p1 (round robin, S = 3 on P = 2), m = 2, limit 2, unit
    costs by default, so a fused backward (B + W) takes 2 s, no message time:

    t   p0                      p1
    0   F0@0 (to 1)             nothing ready
    1   F1@0 (to 2)             F0@1 (to 2)
    2   F0@2 (to 3)             F1@1 (to 3)
    3   B0@2 (to 5)             nothing: B0@1 waits for B0@2
    5   F1@2 (to 6)             B0@1 (to 7)
    6   B1@2 (to 8)
    7                           nothing: B1@1 waits for B1@2 (ends at 8)
    8   B0@0 (to 10)            B1@1 (to 10)
    10  B1@0 (to 12)"""
    order = greedy_orders(placement("interleaved-1f1b", 3, 2), 3, [0, 1], 2, False)
    assert _grid(order) == ["F0@0 F1@0 F0@2 B0@2 F1@2 B1@2 B0@0 B1@0",
                            "F0@1 F1@1 B0@1 B1@1"]


def test_one_process_never_waits_for_itself() -> None:
    """zb-v on one process (stages 0, 1), unit costs, m = 2, limit 2, and 5 s on the cut into
    stage 1: both stages are on the process, so no message crosses it and each input is there
    when its producer ends. t0 F0@0; t1 F0@1 (deeper than F1@0); t2 B0@1; t3 B0@0 (B's
    first); t4 F1@0 (an F before the waiting W's); t5 F1@1; t6 B1@1; t7 B1@0; then the W's,
    oldest first, deeper first."""
    order = greedy_orders(placement("zb-v", 2, 1), 2, [0, 1], 2, True, comm=[0.0, 5.0])
    assert _grid(order) == ["F0@0 F0@1 B0@1 B0@0 F1@0 F1@1 B1@1 B1@0 W0@1 W0@0 W1@1 W1@0"]


def test_a_fused_backward_on_the_first_stage_ends_an_admission() -> None:
    """Stages 0, 1 on one process, fused backwards, one minibatch admitted at a time (limit 1):
    minibatch 1 is admitted once B0@0 (the last work of minibatch 0 on the process's first
    stage) has run; B0@1 on the deeper stage ends nothing. t0 F0@0; t1 F0@1 (F1@0 is not
    admitted); t2 B0@1 (to 4); t4 B0@0 (to 6); t6 F1@0 ..."""
    order = greedy_orders(placement("interleaved-1f1b", 2, 1), 2, [0, 1], 1, False)
    assert _grid(order) == ["F0@0 F0@1 B0@1 B0@0 F1@0 F1@1 B1@1 B1@0"]


def test_an_idle_process_looks_again_when_something_can_change() -> None:
    """zb-v, P = 2, m = 2, limit 2, F = 1 and B = W = 0 s, no message time on any cut but the
    cut into stage 0, which no message crosses (1 s, accepted and meaningless). Timeline (a
    0 s step lets its process look again at once):

    t   p0                                   p1
    0   F0@0                                 nothing
    1   F1@0                                 F0@1
    2   nothing                              F0@2 (deeper than F1@1)
    3   F0@3                                 F1@1
    4   B0@3, W0@3 (F1@3's input at 5: a     F1@2
        0 s W delays nothing); idle
    5   F1@3 (to 6)                          B0@2, B0@1, W0@2, W0@1; then nothing: B1@2
                                             waits for B1@3
    6   B0@0 (older than B1@3)               still nothing (B1@3 not yet scheduled); p0
                                             is due at 6 again and no end or arrival is
                                             due after 6, so p1 looks again at 6
    6   B1@3                                 B1@2 (B1@3 just ended)
    6   W0@0 (B1@0 waits for B1@1)           B1@1
    6   B1@0, W1@3, W1@0                     W1@2, W1@1

    B0@0, on stage 0, sends nothing: were 6 + 1 = 7 taken for an arrival, p1 would wait for
    it, B1@2 and B1@1 would run at 7 and p0 would fill 6 with W0@0 and W1@3 before B1@0."""
    order = greedy_orders(ZBV2, 4, [0, 1], 2, True, [(1.0, 0.0, 0.0)] * 4,
                          [1.0, 0.0, 0.0, 0.0])
    assert _grid(order) == [
        "F0@0 F1@0 F0@3 B0@3 W0@3 F1@3 B0@0 B1@3 W0@0 B1@0 W1@3 W1@0",
        "F0@1 F0@2 F1@1 F1@2 B0@2 B0@1 W0@2 W0@1 B1@2 B1@1 W1@2 W1@1"]


@pytest.mark.timeout(10)  # the stuck check is what ends the loop: without it this never returns
def test_work_no_process_can_ever_run_is_refused_not_waited_for() -> None:
    """One stage hosted by three processes (placement never does this; greedy_orders takes any
    hosts): each counts its F0 and fused B0 as its own work, p0 (first to look) runs both (F0
    0 to 1, B0 1 to 3), p1 and p2 idle at 0, 1 and 3. At 3 nothing ends or arrives later: p1
    looks again at once since p2, due at 3 too, has not yet looked in this state; p2 then finds
    p1 stalled in the very same state: nothing can change, refused on process 2."""
    with pytest.raises(ConfigError) as info:
        greedy_orders((((0, 0),), ((0, 0),), ((0, 0),)), 1, [0], 1, False)
    assert info.value.message == "greedy scheduling is stuck on process 2"
    assert info.value.hint == "allow more minibatches in flight per process"
