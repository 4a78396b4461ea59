"""The placed kinds' memory (runtime/pricing/memory.placed_memory_rule): no stashed weight
versions, each stage's activation sets as many as the kind's own order holds at once, and the
planner pricing a placed kind's plan by it (not by PipeDream's rule, which stashed v - 1 weight
copies on every virtual stage of a flushing schedule)."""
from __future__ import annotations

import pytest

from fxpipe.costmodel.hardware import Cluster
from fxpipe.runtime.pricing.choose import choose_plan
from fxpipe.runtime.pricing.memory import placed_memory_rule, state_bytes


def test_dualpipev_holds_its_window_by_hand() -> None:
    """DualPipeV on P processes: stage p (chunk 0 of process p) runs 2(P - p - 1) + (p + 1)
    forwards, then one more before its first backward: 2P - p sets; stage 2P - 1 - p (chunk 1)
    p + 1, its input backwards' W at once. Both are 2P - s for stage s."""
    for P in (1, 2, 4):
        rule = placed_memory_rule("dualpipev", P, 4 * P)
        assert rule.listed == tuple(2 * P - s for s in range(2 * P))
        assert (rule.versions, rule.recomputed) == ("none", "listed")


def test_recomputed_sets_by_hand() -> None:
    """DualPipeV on 2 processes, 4 microbatches: in its order (make_placed_schedule("dualpipev",
    2, 8, microbatches=4).grid()) every stage's W comes before that stage's next B (process 1
    runs B3@2 B3@1 W3@2 W3@1: stage 2's W3 before any later B of stage 2), so a recomputing
    stage keeps one full set; interleaved (no split) one, as without a list; zb-v's greedy
    order defers Ws, so more."""
    assert placed_memory_rule("dualpipev", 2, 4).listed_full == (1, 1, 1, 1)
    assert set(placed_memory_rule("interleaved-1f1b", 2, 4).listed_full) == {1}
    assert max(placed_memory_rule("zb-v", 4, 16).listed_full) > 1


def test_zb_v_admits_p_per_process() -> None:
    """zb-v's greedy order admits P minibatches per process: P sets on each of its stages."""
    assert placed_memory_rule("zb-v", 3, 6).listed == (3,) * 6


def test_interleaved_by_hand_on_two_processes() -> None:
    """Megatron's order on 2 processes, 2 chunks, 4 microbatches. Process 0 (stages 0, 2) warms
    up with (2 - 0 - 1) x 2 + (2 - 1) x 2 = 4 forwards (F0@0 F1@0 F0@2 F1@2), then alternates
    F2@0 B0@2 F3@0 B1@2 F2@2 B0@0: stage 0 holds 4 before its first backward, stage 2 two.
    Process 1 (stages 1, 3) warms up with F0@1 F1@1, then F0@3 B0@3 F1@3 B1@3 F2@1 B0@1 F3@1:
    stage 1 holds 3, stage 3 one."""
    rule = placed_memory_rule("interleaved-1f1b", 2, 4)
    assert rule.listed == (4, 3, 2, 1) and rule.listed_full == (1, 1, 1, 1)


@pytest.fixture(scope="module")
def mlp_profile():
    import torch

    import fxpipe

    torch.manual_seed(0)
    layers = [torch.nn.Linear(64, 64) for _ in range(8)]
    model = torch.nn.Sequential(*[m for layer in layers for m in (layer, torch.nn.Tanh())])
    return fxpipe.compile(model, fxpipe.Cluster(workers=1, device="V100"),
                          example_inputs=(torch.randn(16, 64),), overheads="off").profile


@pytest.mark.parametrize("kind", ["zb-v", "dualpipev", "interleaved-1f1b"])
def test_the_planner_prices_a_placed_plan_by_its_own_order(mlp_profile, kind: str) -> None:
    """Each virtual stage's memory is its state plus its listed sets of its activations: no
    weight versions stashed (PipeDream's rule charged stage 0 of 2P stages 2P - 1 copies)."""
    cluster = Cluster(workers=2, device="V100", memory="16GB")
    plan = choose_plan(mlp_profile, cluster, stages=2, schedule=kind, microbatches=8)
    rule = plan.memory_rule
    assert rule.held == "listed" and rule.listed == placed_memory_rule(kind, 2, 8).listed
    assert len(plan.stages) == 4
    for s, sp in enumerate(plan.stages):
        assert not sp.recompute
        assert sp.memory_bytes == pytest.approx(state_bytes(sp) + rule.listed[s]
                                                * sp.activation_bytes, rel=1e-12)
