"""The field's splits (bench/field.py) on small cases worked by hand, the exact min-max split
against brute force, and the blocks read from a traced model."""
from __future__ import annotations

import itertools
import random

import pytest
import torch
from torch import nn

from bench.field import (auto_partition, blocks_of, critical_path, even_split, min_max_split,
                         parameter_balance)


def test_even_split_deals_effective_layers_as_torchtitan_describes():
    # 32 layers + embedding + head = 34 effective on 8 stages: 4 each, the first 2 stages one
    # more; stage 0 spends one of its 5 on the embedding, the last one of its 4 on the head
    assert even_split(32, 8) == [0, 5, 10, 14, 18, 22, 26, 30]
    # torchtitan's own example: 3 layers, weights 2 and 2, 2 stages: 7 effective, 4 + 3
    assert even_split(3, 2, input_weight=2, output_weight=2) == [0, 3]
    # one effective layer per stage: the embedding alone, then a layer each, the head alone
    assert even_split(2, 4) == [0, 1, 2, 3]
    assert even_split(5, 1) == [0]
    # no extra weight: the layers dealt evenly, the embedding and head riding along
    assert even_split(8, 4, 0, 0) == [0, 3, 5, 7]


@pytest.mark.parametrize("args", [(2, 5), (2, 3, 3, 1), (2, 3, 1, 3), (3, 0)])
def test_even_split_refuses_what_torchtitan_refuses(args):
    with pytest.raises(ValueError):
        even_split(*args)


def test_min_max_split_by_hand():
    # 1+2+3 | 4+5: the largest part 9 (1+2+3+4 | 5 would be 10)
    assert min_max_split([1, 2, 3, 4, 5], 2) == [0, 3]
    # the heavy ends alone, the light middle together: largest 10
    assert min_max_split([10, 1, 1, 1, 1, 10], 3) == [0, 1, 5]
    # ties: earlier parts take as many blocks as they can
    assert min_max_split([1, 1, 1, 1], 2) == [0, 2]
    assert min_max_split([0, 0, 0], 3) == [0, 1, 2]


def _brute(weights, parts):
    n = len(weights)
    best = None
    for cuts in itertools.combinations(range(1, n), parts - 1):
        starts = [0, *cuts]
        bounds = starts + [n]
        worst = max(sum(weights[a:b]) for a, b in zip(bounds, bounds[1:]))
        key = (worst, [-s for s in starts])  # smallest worst, then the latest boundaries
        if best is None or key < best[0]:
            best = (key, starts)
    return best[1]


def test_min_max_split_equals_brute_force():
    rng = random.Random(0)
    for _ in range(300):
        n = rng.randint(1, 8)
        weights = [rng.choice([0, 1, 2, 3, 5, 8]) for _ in range(n)]
        parts = rng.randint(1, n)
        assert min_max_split(weights, parts) == _brute(weights, parts), (weights, parts)


def test_auto_partition_and_its_critical_path_by_hand():
    fwd, bwd = [1, 1, 1, 1, 4], [2, 2, 2, 2, 8]
    # blocks of F+B 3, 3, 3, 3, 12: the last alone, the rest on the first stage
    assert auto_partition(fwd, bwd, 2, 4) == [0, 4]
    # 24 of work; 3 more microbatches at the slowest stage's 12; one cut, two messages of 0.5
    assert critical_path(fwd, bwd, [0, 4], 4, comm=0.5) == 24 + 3 * 12 + 2 * 0.5
    # interleaved: 4 stages on 2 ranks (stage s on rank s % 2), each rank's pace its two
    # stages: ranks (3 + 3, 3 + 12); the first microbatch's pass is 1/2 of the work
    assert critical_path(fwd, bwd, [0, 1, 2, 3], 2, chunks=2) == 24 / 2 + 1 * 18 + 2 * 3 * 0
    with pytest.raises(ValueError):
        auto_partition(fwd, bwd, 2, 4, schedule="gpipe")


def test_parameter_balance_ignores_time():
    # the embedding's parameters alone on a stage however little time it takes; the rest as
    # early as the largest part (50) allows, the parameter-free head alone at the end
    assert parameter_balance([50, 10, 10, 10, 10, 0], 3) == [0, 1, 5]


class _Tiny(nn.Module):
    def __init__(self, layers=3, width=8, vocab=11):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.ReLU())
                                    for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)

    def forward(self, ids):
        x = self.embed(ids)
        for layer in self.layers:
            x = x + layer(x)
        return self.head(self.norm(x))


def test_blocks_of_a_traced_model():
    import fxpipe

    torch.manual_seed(0)
    model = _Tiny()
    ids = torch.randint(0, 11, (2, 5))
    compiled = fxpipe.compile(model, fxpipe.Cluster(workers=1, device="V100"),
                              example_inputs=(ids,), overheads="off", tracer="export")
    prof = compiled.profile
    blocks = blocks_of(prof)
    assert blocks.names == ("input", "layer 0", "layer 1", "layer 2", "output")
    bounds = list(blocks.starts) + [len(prof.nodes)]
    owned = [{p.split(".")[0] + ("." + p.split(".")[1] if p.startswith("layers.") else "")
              for nd in prof.nodes[a:b] for p in nd.params}
             for a, b in zip(bounds, bounds[1:])]
    assert owned == [{"embed"}, {"layers.0"}, {"layers.1"}, {"layers.2"}, {"norm", "head"}]
    # each layer starts after the residual add that ends the one before: one (2, 5, 8) float
    # tensor crosses each boundary
    assert blocks.boundary_bytes == (2 * 5 * 8 * 4,) * 4
    assert sum(blocks.parameter_bytes) == sum(p.numel() * 4 for p in model.parameters())
    assert blocks.nodes([0, 2]) == [0, blocks.starts[2]]
