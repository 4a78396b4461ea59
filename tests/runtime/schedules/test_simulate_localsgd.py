"""The simulator times a LocalSGD schedule as it runs: a ``U`` steps its copy alone, and only
an averaging ``U`` waits for the stage's other copies (a literal timeline worked by hand)."""
from __future__ import annotations

from fxpipe.runtime.schedules.localsgd import make_localsgd_schedule
from fxpipe.runtime.schedules.simulate import simulate


def test_localsgd_timeline_by_hand() -> None:
    """2 stages, 2 copies, 4 minibatches, H = 2; forward 1, backward 2, no link, a local step
    0.5, an average 1. Copy 0 (minibatches 0, 2) and copy 1 (1, 3) run side by side:
    F0 [0,1] on stage 0, F0 [1,2] and B0 [2,4] on stage 1, B0 [4,6] on stage 0; U0 does not
    average (stage 1 [4,4.5], stage 0 [6,6.5]); F2 [6.5,7.5], [7.5,8.5], B2 [8.5,10.5] and
    U1, the last, averages: stage 1's step ends at 11, the average at 12; stage 0's B2
    [10.5,12.5], step to 13, average to 14."""
    sched = make_localsgd_schedule(2, 2, 4, average_every=2)
    tl = simulate(sched, [1.0, 1.0], [2.0, 2.0], 0.0, 0.5, average_time=1.0)
    for j in (0, 1):
        k = [0, 2] if j == 0 else [1, 3]
        assert tl.times((0, j)) == [(f"F{k[0]}", 0, 1), (f"B{k[0]}", 4, 6), ("U0", 6, 6.5),
                                    (f"F{k[1]}", 6.5, 7.5), (f"B{k[1]}", 10.5, 12.5),
                                    ("U1", 12.5, 14)]
        assert tl.times((1, j)) == [(f"F{k[0]}", 1, 2), (f"B{k[0]}", 2, 4), ("U0", 4, 4.5),
                                    (f"F{k[1]}", 7.5, 8.5), (f"B{k[1]}", 8.5, 10.5),
                                    ("U1", 10.5, 12)]
    assert tl.makespan == 14


def test_a_slow_copy_holds_the_others_only_where_they_average() -> None:
    """Copies take minibatches in turn: with 3 minibatches copy 0 has two, copy 1 one. With
    H = 1 every U averages (F, B 1 each, a free step, an average 0.5): U0 [2, 2.5] on both,
    copy 0's F2 [2.5, 3.5] and B2 [3.5, 4.5], and copy 1's empty U1 waits from 2.5 to its
    end at 5. With H = 4 only the last U averages: copy 0 goes on at 2, ends at 4.5."""
    sched = make_localsgd_schedule(1, 2, 3, average_every=1)
    tl = simulate(sched, [1.0], [1.0], 0.0, 0.0, average_time=0.5)
    assert tl.times((0, 0)) == [("F0", 0, 1), ("B0", 1, 2), ("U0", 2, 2.5), ("F2", 2.5, 3.5),
                                ("B2", 3.5, 4.5), ("U1", 4.5, 5.0)]
    assert tl.times((0, 1))[-1] == ("U1", 2.5, 5.0)
    loose = simulate(make_localsgd_schedule(1, 2, 3, average_every=4), [1.0], [1.0], 0.0,
                     0.0, average_time=0.5)
    assert loose.times((0, 0))[-1] == ("U1", 4.0, 4.5) and loose.makespan == 4.5
