"""A model whose compute is sleeping: ``SleepChain``.

Why: checking :func:`fxpipe.runtime.pricing.plansim.simulate_plan` against the runtime on unevenly
replicated plans needs more ranks than this machine has cores. A layer that *sleeps* for its
forward and backward time takes wall time without taking a core, so 4 ranks on 2 cores keep
their timing, while everything else is real: the runtime's schedule, weight stashing, the
activations and gradients crossing the cuts, and the replicas' gradient all-reduce (each layer
holds a real ``width x width`` weight).

    x (B, width) -> [Linear -> sleep] x len(layers) -> Linear(width, 10) -> logits (B, 10)
"""
from __future__ import annotations

import time

import torch
import torch.nn as nn

# (forward ms, backward ms) per layer: the last layer is the heavy one, so plans differ in how
# they split and replicate it
LAYERS: tuple[tuple[float, float], ...] = ((6.0, 12.0), (6.0, 12.0), (6.0, 12.0), (12.0, 24.0))
WIDTH, BATCH, CLASSES = 256, 32, 10


class _Sleep(torch.autograd.Function):
    """Identity that sleeps ``forward_s`` on the way in and ``backward_s`` on the way back."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor, forward_s: float, backward_s: float) -> torch.Tensor:
        ctx.backward_s = backward_s  # type: ignore[attr-defined]
        time.sleep(forward_s)
        return x.clone()

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        time.sleep(ctx.backward_s)  # type: ignore[attr-defined]
        return grad, None, None


class SleepLayer(nn.Module):
    """``Linear(width, width)`` then a sleep: a traced leaf (the profiler times it whole)."""

    def __init__(self, width: int, forward_ms: float, backward_ms: float) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.forward_s, self.backward_s = forward_ms / 1e3, backward_ms / 1e3

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Sleep.apply(self.fc(x), self.forward_s, self.backward_s)


class SleepChain(nn.Module):
    def __init__(self, layers: tuple[tuple[float, float], ...] = LAYERS, width: int = WIDTH,
                 classes: int = CLASSES) -> None:
        super().__init__()
        self.layers = nn.ModuleList(SleepLayer(width, f, b) for f, b in layers)
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def build(seed: int = 0) -> SleepChain:
    torch.manual_seed(seed)
    return SleepChain()


def data(minibatches: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``minibatches * BATCH`` random samples with random labels (only timing matters)."""
    g = torch.Generator().manual_seed(seed)
    n = minibatches * BATCH
    return torch.randn(n, WIDTH, generator=g), torch.randint(0, CLASSES, (n,), generator=g)
