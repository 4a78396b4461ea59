"""The planner's state per parameter byte as the run keeps it (runtime/replica/state_size.py),
against bytes counted by hand per parameter: weight + gradient + master + optimizer state."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import fxpipe
from fxpipe.runtime.replica.state_size import state_factor


def adamw(ps):
    return torch.optim.AdamW(ps, lr=1e-3)


def params(dtype: torch.dtype, device: str = "cpu") -> list[torch.Tensor]:
    with torch.device(device):
        m = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 4)).to(dtype)
    return list(m.parameters())


@pytest.mark.parametrize("dtype,optimizer,masters,want", [
    # fp32, SGD momentum: 4 + 4 + 4 (momentum) = 12 bytes = 3 P -> opt 1
    (torch.float32, None, None, 1.0),
    # fp32, plain SGD: no state
    (torch.float32, lambda ps: torch.optim.SGD(ps, lr=0.1), None, 0.0),
    # fp32, AdamW: two moments -> opt 2
    (torch.float32, adamw, None, 2.0),
    # bf16 with masters (the default): 2 + 4 (fp32 grad) + 4 (master) + 8 (moments) = 18 = 9 P
    (torch.bfloat16, adamw, None, 7.0),
    # bf16 without masters: 2 + 2 + 4 (bf16 moments) = 8 = 4 P
    (torch.bfloat16, adamw, False, 2.0),
    # fp16 with masters, SGD momentum: 2 + 4 + 4 + 4 = 14 = 7 P
    (torch.float16, None, None, 5.0),
])
def test_state_factor_by_hand(dtype, optimizer, masters, want) -> None:
    assert state_factor(params(dtype), optimizer, masters) == want
    assert state_factor(params(dtype, "meta"), optimizer, masters) == want  # dtypes and ranks only


def test_frozen_parameters_and_unrunnable_factories() -> None:
    ps = params(torch.float32)
    for p in ps:
        p.requires_grad_(False)
    assert state_factor(ps, adamw) == 0.0
    broken = lambda ps: (_ for _ in ()).throw(RuntimeError("needs a process group"))  # noqa: E731
    assert state_factor(params(torch.float32), broken) == 2.0  # Adam's, logged


class Chain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(*(nn.Linear(32, 32) for _ in range(4)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def test_compile_prices_a_bf16_adamw_stage_at_18_bytes_per_parameter() -> None:
    """A bfloat16 model compiled with AdamW: every stage's state is 18 bytes per parameter
    (``P (2 + 7)`` with P at 2 bytes each), by hand from the parameter count."""
    model = Chain().to(torch.bfloat16)
    x = torch.randn(8, 32, dtype=torch.bfloat16)
    compiled = fxpipe.compile(model, fxpipe.Cluster(workers=2, device="A100"), example_inputs=(x,),
                              loss_fn=lambda o, t: o.float().pow(2).mean(), stages=2,
                              straight=True, optimizer=adamw)
    for sp in compiled.plan.stages:
        count = sp.parameter_bytes / 2
        assert sp.state_bytes == 18 * count
    assert sum(sp.parameter_bytes for sp in compiled.plan.stages) == 2 * 4 * (32 * 32 + 32)
