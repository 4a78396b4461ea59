"""Which values need a gradient is decided per tensor, as autograd decides it: an index and a
float made from one are constants (the Mixture-of-Experts routing pattern: ``argmax``/``histc``
counts fed to ``cumsum(..., dtype=int32)``), and a node that fails with gradients on is reported
as an fxpipe error naming it."""
from __future__ import annotations

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
from cm_helpers import meta, traced

from fxpipe.costmodel import estimate_graph, profile_graph
from fxpipe.errors import CostingError


class Routed(nn.Module):
    """The issue's minimal case: offsets of a routing made from integer indices."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        idx = h.argmax(-1)
        offs = torch.cumsum(idx.float(), 0, dtype=torch.int32)
        counts = torch.histc(idx.float(), bins=4, min=0, max=7)
        return self.b(h) + offs.unsqueeze(-1).float() + counts


def test_eager_runs_the_pattern() -> None:
    """The oracle: plain PyTorch trains it (no fxpipe)."""
    m = Routed()
    m(torch.randn(4, 8)).sum().backward()
    assert m.a.weight.grad is not None


@pytest.mark.parametrize("walk", ["profile", "estimate"])
def test_index_derived_floats_are_constants(walk: str) -> None:
    x = torch.randn(4, 8)
    gm = traced(Routed(), x)
    if walk == "profile":
        profile_graph(gm, (x,), warmup=1, repeats=2)
    else:
        estimate_graph(gm, (x,), "V100")
    # the chain from the parameters ends at argmax: cumsum/histc of indices have no backward
    assert meta(gm, "cumsum")["backward_s"] == 0.0
    assert meta(gm, "histc")["backward_s"] == 0.0
    assert meta(gm, "b")["backward_s"] > 0.0


@fx.wrap
def _refuses_grad(t: torch.Tensor) -> torch.Tensor:
    if torch.is_grad_enabled() and t.requires_grad:
        raise RuntimeError("this op has no derivative for its input")
    return t * 2


class Refusing(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _refuses_grad(self.a(x))


@pytest.mark.parametrize("walk", ["profile", "estimate"])
def test_failure_with_grad_names_the_node(walk: str) -> None:
    x = torch.randn(4, 8)
    gm = fx.symbolic_trace(Refusing())
    with pytest.raises(CostingError, match=r"node '_refuses_grad'.*no derivative") as info:
        if walk == "profile":
            profile_graph(gm, (x,), warmup=1, repeats=2)
        else:
            estimate_graph(gm, (x,), "V100")
    assert "hint:" in str(info.value)
