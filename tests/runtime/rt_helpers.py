"""Shared helpers for the runtime tests: a tiny MLP, its split into stages, plain SGD."""
from __future__ import annotations

import functools
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from fxpipe.codegen.split import StageSpec, placed_nodes, split_graph

LR = 0.1
sgd = functools.partial(torch.optim.SGD, lr=LR)
loss_fn = F.mse_loss


def tiny_mlp(seed: int = 0, width: int = 8) -> nn.Module:
    """Five layers so it splits into 1..3 stages; tanh keeps the gradients non-trivial."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(),
                         nn.Linear(width, 2))


class SkipMLP(nn.Module):
    """h1 feeds both the next layer and the last one: with cuts [2, 4] it is sent from stage 0
    straight to stages 1 and 2, and its gradient is the sum of both consumers'."""

    def __init__(self, seed: int = 0, width: int = 6) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.l1, self.l2, self.l3 = nn.Linear(4, width), nn.Linear(width, width), nn.Linear(width, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h1 = torch.tanh(self.l1(x))
        h2 = torch.tanh(self.l2(h1))
        return self.l3(h2 + h1)


def split(model: nn.Module, cuts: list[int]) -> list[StageSpec]:
    """Split ``model`` after the compute nodes numbered in ``cuts`` (placeholders count as 0)."""
    gm = fx.symbolic_trace(model)
    stage_of: dict[str, int] = {}
    for i, n in enumerate(placed_nodes(gm)):
        stage_of[n.name] = sum(1 for c in cuts if i > c)
    return split_graph(gm, stage_of)


def batches(n: int, batch: int = 4, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 4, generator=g), torch.randn(batch, 2, generator=g))
            for _ in range(n)]


def plain_sgd(model: nn.Module, data: list[tuple[Any, Any]]) -> tuple[list[float], dict]:
    """The ground truth: ordinary single-process training, one step per minibatch."""
    opt = sgd(list(model.parameters()))
    losses = []
    for x, y in data:
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}
