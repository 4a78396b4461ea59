"""``shard`` options refused before any step (the sharded runs themselves are under torchrun:
tests/runtime/training/test_trainer_sharding_dist.py)."""
from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from rt_helpers import split, tiny_mlp

from fxpipe.runtime.errors import RuntimeConfigError
from fxpipe.runtime.execution.sharding import sharded_factory
from fxpipe.runtime.training.recipes import OptimizerRecipe
from fxpipe.runtime.training.trainer import Trainer

adamw = functools.partial(torch.optim.AdamW, lr=1e-3)


def test_an_unknown_shard_is_refused() -> None:
    with pytest.raises(RuntimeConfigError, match="shard='params'"):
        Trainer(split(tiny_mlp(), [2]), [2, 1], F.mse_loss, adamw, shard="params",
                executor="reference", progress=False)


def test_localsgd_keeps_each_copys_state_whole() -> None:
    with pytest.raises(RuntimeConfigError, match="shard='optimizer' with schedule 'localsgd'"):
        Trainer(split(tiny_mlp(), [2]), [2, 2], F.mse_loss, adamw, shard="optimizer",
                schedule="localsgd", executor="reference", progress=False)


def test_a_composite_recipe_cannot_be_sharded() -> None:
    """Checked on the factory's own optimizer, before torch's engine needs a process group:
    the "muon" recipe's (Muon on the matrices, AdamW on the rest) is not one torch.optim."""
    params = [torch.nn.Parameter(torch.randn(4, 4)), torch.nn.Parameter(torch.randn(4))]
    recipe = OptimizerRecipe("muon", 0.02)
    make = sharded_factory(lambda ps: recipe(ps, ["w", "b"]), group=None)
    with pytest.raises(RuntimeConfigError, match="shard='optimizer' with optimizer"):
        make(params)


def test_the_reference_trains_sharded_runs_whole() -> None:
    """The reference executor holds the state whole: the same numbers, no process group."""
    model = tiny_mlp()
    data = [(torch.randn(4, 4), torch.randn(4, 2)) for _ in range(4)]
    a = Trainer(split(model, [2]), [2, 1], F.mse_loss, adamw, shard="optimizer",
                schedule="1f1b-flush", executor="reference", progress=False)
    b = Trainer(split(tiny_mlp(), [2]), [2, 1], F.mse_loss, adamw,
                schedule="1f1b-flush", executor="reference", progress=False)
    assert a.fit(data, epochs=1)[0]["loss"] == b.fit(data, epochs=1)[0]["loss"]


def test_what_carries_whole_optimizer_states_is_refused_with_shards() -> None:
    with pytest.raises(RuntimeConfigError, match="auto's pilot on the pipeline"):
        Trainer(split(tiny_mlp(), [2]), [2, 1], F.mse_loss, adamw, shard="optimizer",
                schedule="auto", auto_options={"where": "pipeline"}, executor="reference",
                progress=False)
