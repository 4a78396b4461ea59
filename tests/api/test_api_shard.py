"""``fxpipe.compile(..., shard=...)``: a plan that fits only with a replicated stage's
optimizer state sharded, and the trainer that trains it as priced.

An MLP whose middle layer (2048 x 2048, 16.8 MB of float32 weights) dominates, Adam (its two
moments: 4 x the weights with the gradient), planned for 6 H100-estimated workers under
1f1b-flush with a 70 MB cap: unsharded that layer's stage peaks at 84 MB on one worker (67 MB
of state), so no plan fits; sharded over 2 replicas it keeps half the moments (50.4 MB of
state) and fits.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxpipe
from fxpipe.errors import InfeasiblePlanError


def _adam(params):  # noqa: ANN001, ANN202 (an optimizer factory)
    return torch.optim.Adam(params, lr=1e-3)


def _compile(shard: str, memory: str = "70MB") -> fxpipe.CompiledModel:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(),
                          nn.Linear(2048, 10))
    return fxpipe.compile(model, fxpipe.Cluster(workers=6, memory=memory, device="H100"),
                          example_inputs=(torch.randn(8, 512),), loss_fn=F.cross_entropy,
                          optimizer=_adam, shard=shard, schedule="1f1b-flush")


def test_a_plan_that_fits_only_sharded_and_its_trainer() -> None:
    with pytest.raises(InfeasiblePlanError, match="peaks at"):
        _compile("never")
    compiled = _compile("auto")
    plan = compiled.plan
    assert plan.shard == "optimizer"
    big = max(plan.stages, key=lambda sp: sp.parameter_bytes)
    assert big.replicas == 2 and big.parameter_bytes == 2048 * 2048 * 4 + 2048 * 4
    # weights, gradients and one of Adam's two moments per replica: 3 P
    assert big.state_bytes == 3 * big.parameter_bytes
    assert all(sp.peak_bytes <= 70e6 for sp in plan.stages)
    assert "optimizer state sharded (ZeRO-1): each replica of stage" in plan.summary()
    assert fxpipe.Plan.from_dict(plan.to_dict()).shard == "optimizer"
    ref = fxpipe.RunConfig(executor="reference")
    assert compiled.trainer(_adam, run=ref, schedule="1f1b-flush").options.shard == "optimizer"
    whole = fxpipe.RunConfig(executor="reference", shard="never")
    assert compiled.trainer(_adam, run=whole, schedule="1f1b-flush").options.shard is None


def test_without_a_cap_auto_keeps_the_state_whole() -> None:
    assert _compile("auto", memory=None).plan.shard is None
