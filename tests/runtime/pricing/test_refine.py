"""Choosing by simulation refines the chosen candidate by local moves (plan_choice._refined):
a worker between adjacent stages, a cut to the nearest valley of the bytes crossing."""
from __future__ import annotations

import math

import numpy as np
import pytest

from fxpipe.costmodel.hardware import Cluster
from fxpipe.runtime.pricing.memory import memory_rule
from fxpipe.runtime.pricing.plan_choice import _valley, choose_by_simulation
from fxpipe.runtime.pricing.plansim import minibatches_for, simulate_plan


def test_valley_by_hand():
    # bytes crossing at positions 1..9 (cb[q - 1] at position q)
    cb = np.array([5.0, 3.0, 3.0, 6.0, 8.0, 4.0, 2.0, 2.0, 9.0])
    # from 5 (bytes 8) left: down 6, 3 and along the plateau of 3s to its far end
    assert _valley(cb, 5, -1, 1, 9) == 2
    # from 5 right: down the slope to the plateau's far end
    assert _valley(cb, 5, 1, 1, 9) == 8
    # from a valley (7, bytes 2): past the plateau and the rise, none before the range ends
    assert _valley(cb, 7, 1, 1, 9) is None
    # left from 7: over the rise (4, 8, 6) and down again to 2..3
    assert _valley(cb, 7, -1, 1, 9) == 2
    # the range bounds the walk: the lowest point before it ends, or none past a rise
    assert _valley(cb, 5, -1, 4, 9) == 4
    assert _valley(cb, 7, -1, 6, 9) is None


def test_minibatches_for_gives_a_batched_schedule_whole_batches():
    assert minibatches_for([8, 8]) == 200  # the default, unchanged for small batches
    assert minibatches_for([8, 8], microbatches=16) == 200
    assert minibatches_for([8, 8], microbatches=64) == 256  # 4 batches of 64
    assert minibatches_for([1] * 4, floor=8, microbatches=8) == 32


@pytest.fixture(scope="module")
def gpt2():
    transformers = pytest.importorskip("transformers")
    import torch

    import fxpipe

    cfg = transformers.GPT2Config(n_layer=12, n_embd=768, n_head=12, vocab_size=50257,
                                  n_positions=1024)
    cfg.use_cache = False
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(cfg).to(torch.bfloat16)
    ids = torch.zeros(1, 1024, dtype=torch.long, device="meta")
    return fxpipe.compile(model, fxpipe.Cluster(workers=1, device="H100", memory="1000TB"),
                          example_inputs={"input_ids": ids, "labels": ids},
                          schedule="1f1b-flush", overheads="off").profile


def test_a_cut_inside_a_block_moves_to_the_blocks_boundary(gpt2):
    """GPT-2 on two 8-GPU hosts, 2 stages, 64 microbatches per update: the planner's optimum
    cuts inside layer 6, where two tensors cross the slow link; the refinement moves the cut to
    a layer boundary (one tensor), which simulates faster, as fast as the field's
    time-balanced split (bench/field.py's auto_partition: layers 0-6 | 7-11 and the head)."""
    from bench.field import auto_partition, blocks_of
    from fxpipe.passes.cuts import cut_bytes
    from fxpipe.passes.partition import partition, plan_for

    cluster = Cluster(workers=16, bandwidth="100Gbps", device="H100", memory="80GB",
                      workers_per_machine=8, intra_bandwidth="450GB/s")
    rule = memory_rule("1f1b-flush", 64)
    choice = choose_by_simulation(gpt2, cluster, stages=2, schedules=("1f1b-flush",),
                                  memory_rule=rule, microbatches=64, optimizer_state_factor=7.0)
    first, chosen = choice.candidates[0], choice.simulation.steady_state_period
    assert len(choice.candidates) > 1 and chosen < first.simulated_s * (1 - 1e-3)
    assert all(chosen <= c.simulated_s for c in choice.candidates)
    cb = cut_bytes(gpt2)
    index = {n: i for i, n in enumerate(gpt2.names)}
    optimum = partition(gpt2, cluster, stages=2, memory_rule=rule, optimizer_state_factor=7.0)
    assert first.replicas == tuple(optimum.replicas) == (8, 8)
    before = cb[index[optimum.stages[1].nodes[0]] - 1]
    after = cb[index[choice.plan.stages[1].nodes[0]] - 1]
    assert after < before
    blocks = blocks_of(gpt2)
    field = plan_for(gpt2, cluster, blocks.nodes(auto_partition(blocks.forward_s,
                                                                blocks.backward_s, 2, 8)),
                     [8, 8], memory_rule=rule, optimizer_state_factor=7.0)
    n = math.ceil(minibatches_for([8, 8], microbatches=64) / 64) * 64
    field_s = simulate_plan(field, gpt2, schedule="1f1b-flush", microbatches=64,
                            minibatches=n).steady_state_period
    assert chosen <= field_s * (1 + 1e-9)


def test_copies_of_a_straight_pipeline_are_candidates(gpt2):
    """GPT-2 on one 8-GPU host, 2 stages, 16 microbatches per update: the planner's optimum
    gives the first stage one worker and the second seven (PipeDream's rule prices the
    replicated stage's all-reduce as overlapped); two copies of the straight pipeline, four
    workers a stage, simulate faster, and local moves from 1-7 do not reach them."""
    cluster = Cluster(workers=8, bandwidth="100Gbps", device="H100", memory="80GB",
                      workers_per_machine=8, intra_bandwidth="450GB/s")
    choice = choose_by_simulation(gpt2, cluster, stages=2, schedules=("1f1b-flush",),
                                  memory_rule=memory_rule("1f1b-flush", 16), microbatches=16,
                                  optimizer_state_factor=7.0)
    assert choice.candidates[0].replicas == (1, 7)
    assert (4, 4) in {c.replicas for c in choice.candidates}
    assert choice.plan.replicas == [4, 4]
    assert choice.simulation.steady_state_period < 0.95 * choice.candidates[0].simulated_s


def test_placed_candidates_copy_the_pipeline_over_the_workers_and_price_the_batch(gpt2):
    """zb-v on 2 ranks of 8 workers: 4 copies of the V (4 stages, 4 replicas each, every
    worker used), simulated with the microbatches per update asked for."""
    cluster = Cluster(workers=8, bandwidth="100Gbps", device="H100", memory="80GB",
                      workers_per_machine=8, intra_bandwidth="450GB/s")
    got, first = {}, {}
    for m in (16, 64):
        choice = choose_by_simulation(gpt2, cluster, stages=2, schedules=("zb-v",),
                                      microbatches=m, optimizer_state_factor=7.0)
        assert choice.plan.replicas == [4] * 4
        again = simulate_plan(choice.plan, gpt2, schedule="zb-v", microbatches=m,
                              minibatches=choice.simulation.minibatches)
        assert choice.simulation.steady_state_period == again.steady_state_period
        got[m], first[m] = again.steady_state_period, choice.candidates[0].simulated_s
    assert got[64] < got[16]  # a longer batch: a smaller share of bubble
    assert first[64] < first[16]  # the planner's own candidate too, before any local move
