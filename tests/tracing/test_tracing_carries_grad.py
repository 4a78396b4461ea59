"""``carries_grad``: whether a gradient can reach a node's value, decided per tensor as autograd
decides it (an integer ends the chain), recorded by the shape pass that every rank runs."""
from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn as nn

from fxpipe.tracing.shapes import propagate_shapes


class Mixed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.frozen = nn.Linear(4, 4).requires_grad_(False)
        self.w = nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a = self.frozen(ids.float())     # frozen weights over a float made from indices
        b = a * self.w                   # a trainable parameter joins
        c = ids + 1                      # integers
        d = torch.relu(x)                # a floating model input
        e = torch.cumsum(a, 0, dtype=torch.int32).float()  # through an integer again
        return b + d + e, c


def test_carries_grad_by_hand() -> None:
    gm = fx.symbolic_trace(Mixed())
    propagate_shapes(gm, (torch.randn(3, 4), torch.arange(12).reshape(3, 4)))
    got = {n.name: n.meta["fxpipe"]["carries_grad"] for n in gm.graph.nodes if n.op != "output"}
    assert got == {"x": True, "ids": False, "float_1": False, "frozen": False, "w": True,
                   "mul": True, "add": False, "relu": True, "cumsum": False, "float_2": False,
                   "add_1": True, "add_2": True}
