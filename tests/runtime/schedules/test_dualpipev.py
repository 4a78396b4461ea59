"""DualPipeV as an fxpipe schedule (runtime/schedules/placed_orders.dualpipev_order): every
process's order equals the one torch's own ``ScheduleDualPipeV`` computes (its pipeline order,
read through torch's generator, overlapped pairs and full backwards written out as fxpipe's F, B,
W), a literal table for 4 processes, and what it refuses."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
from torch.distributed.pipelining.schedules import ScheduleDualPipeV
from torch.distributed.pipelining.schedules import _ComputationType as T

from fxpipe.errors import ConfigError
from fxpipe.runtime.schedules.placed_orders import dualpipev_order
from fxpipe.runtime.schedules.placement import make_placed_schedule, placement, simulate_placed


def torchs(rank: int, P: int, m: int) -> list[tuple[int, str, int]]:
    """(stage, F/B/W, microbatch) of rank's actions in torch's DualPipeV order: an overlapped
    pair is its forward then its backward, a full backward is B then W."""
    out: list[tuple[int, str, int]] = []
    fake = SimpleNamespace(pp_group_size=P, _n_microbatches=m)
    for a in ScheduleDualPipeV._calculate_single_rank_operations(fake, rank):
        for b in (a.sub_actions if a.computation_type == T.OVERLAP_F_B else (a,)):
            s, k, t = b.stage_index, b.microbatch_index, b.computation_type
            out += {T.FORWARD: [(s, "F", k)], T.BACKWARD_INPUT: [(s, "B", k)],
                    T.BACKWARD_WEIGHT: [(s, "W", k)],
                    T.FULL_BACKWARD: [(s, "B", k), (s, "W", k)]}[t]
    return out


@pytest.mark.parametrize("P", [1, 2, 3, 4, 5])
def test_every_process_runs_torchs_order(P: int) -> None:
    for m in range(2 * P, 2 * P + 7):
        for p in range(P):
            mine = [(r[0], a.kind, a.minibatch) for r, a in dualpipev_order(p, P, range(m))]
            assert mine == torchs(p, P, m), (P, m, p)


GRID_4x8 = [  # make_placed_schedule("dualpipev", 4, 8).grid(): the V, stages p and 7 - p
    "p0  |F0@0 F1@0 F2@0 F3@0 F4@0 F5@0 F6@0 F0@7 B0@7 W0@7 F1@7 B1@7 W1@7 F2@7 B2@7 W2@7 F3@7 "
    "F7@0 B3@7 W3@7 F4@7 B0@0 W0@0 B4@7 W4@7 F5@7 B1@0 W1@0 B5@7 W5@7 F6@7 B2@0 W2@0 B6@7 W6@7 "
    "F7@7 B3@0 W3@0 B7@7 W7@7 B4@0 W4@0 B5@0 W5@0 B6@0 W6@0 B7@0 W7@0 U0@0 U0@7",
    "p1  |F0@1 F1@1 F2@1 F3@1 F4@1 F0@6 F5@1 F1@6 B0@6 W0@6 F2@6 B1@6 W1@6 F3@6 F6@1 B2@6 W2@6 "
    "F4@6 B0@1 W0@1 F7@1 B3@6 W3@6 F5@6 B1@1 W1@1 B4@6 W4@6 F6@6 B2@1 W2@1 B5@6 W5@6 F7@6 B3@1 "
    "W3@1 B6@6 W6@6 B4@1 W4@1 B7@6 B5@1 W7@6 B6@1 W5@1 B7@1 W6@1 W7@1 U0@1 U0@6",
    "p2  |F0@2 F1@2 F2@2 F0@5 F3@2 F1@5 F4@2 F2@5 B0@5 W0@5 F3@5 F5@2 B1@5 W1@5 F4@5 B0@2 W0@2 "
    "F6@2 B2@5 W2@5 F5@5 B1@2 W1@2 F7@2 B3@5 W3@5 F6@5 B2@2 W2@2 B4@5 W4@5 F7@5 B3@2 W3@2 B5@5 "
    "W5@5 B4@2 W4@2 B6@5 W6@5 B5@2 B7@5 B6@2 W5@2 B7@2 W7@5 W6@2 W7@2 U0@2 U0@5",
    "p3  |F0@3 F0@4 F1@3 F1@4 F2@3 F2@4 F3@3 F3@4 F4@3 B0@4 W0@4 F4@4 B0@3 W0@3 F5@3 B1@4 W1@4 "
    "F5@4 B1@3 W1@3 F6@3 B2@4 W2@4 F6@4 B2@3 W2@3 F7@3 B3@4 W3@4 F7@4 B3@3 W3@3 B4@4 W4@4 B4@3 "
    "W4@3 B5@4 W5@4 B5@3 W5@3 B6@4 B6@3 B7@4 B7@3 W6@4 W6@3 W7@4 W7@3 U0@3 U0@4",
]


def test_the_table_for_4_processes_and_8_microbatches() -> None:
    """Process 0 (stages 0 and 7) by hand from the phases: six forwards of stage 0 (phase 1);
    F6@0 F0@7 (2); three input backwards of stage 7, each W at once (the queue holds one) and
    the next forward of stage 7 (3); one steady round F7@0 B3@7 W3@7 F4@7 B0@0 W0@0 (4); three
    rounds of stage 7's backward, its forward, stage 0's backward (5); B7@7 W7@7, then stage 0's
    backwards input-only (6), each W before the next B (7), the last W (8)."""
    placed = make_placed_schedule("dualpipev", 4, 8)
    assert placed.hosts == placement("zb-v", 8, 4)
    assert placed.grid() == GRID_4x8
    assert sum(a.kind == "W" for r in placed.schedule.ranks
               for a in placed.schedule.actions[r]) == 8 * 8  # every B has its W


def test_unit_costs_by_hand_on_one_process() -> None:
    """One process hosting stages 0 and 1, unit F, B, W: nothing waits on another process, so
    a batch of m takes 2 x 3 x m units, and an update 0."""
    placed = make_placed_schedule("dualpipev", 1, 6, microbatches=2)
    makespan, busy = simulate_placed(placed, [(1.0, 1.0, 1.0)] * 2)
    assert makespan == busy[0] == 2 * 3 * 6


def test_what_it_refuses() -> None:
    with pytest.raises(ConfigError, match="at least as many microbatches per batch as stages"):
        dualpipev_order(0, 2, range(3))
    with pytest.raises(ConfigError) as info:
        make_placed_schedule("dualpipev", 2, 10, microbatches=4)  # a last batch of 2
    assert info.value.message == "dualpipev with a batch of 2 microbatches on 2 processes"
    with pytest.raises(ConfigError, match="dualpipev places two stages per process"):
        make_placed_schedule("dualpipev", 2, 8, num_stages=6)
