"""A tiny MLP that applies one layer at two depths.

Why: a reused layer is one Parameter used by two graph nodes that may land on different pipeline
stages; the cost model and codegen must treat it like a tied weight. This is the smallest model
that exercises that path.
"""
from __future__ import annotations

import torch
from torch import nn


class ReuseNet(nn.Module):
    """fc_in -> shared -> relu -> shared (same weights again) -> fc_out."""

    def __init__(self, in_dim: int = 8, hidden: int = 16, num_classes: int = 4) -> None:
        super().__init__()
        self.fc_in = nn.Linear(in_dim, hidden)
        self.shared = nn.Linear(hidden, hidden)
        self.fc_out = nn.Linear(hidden, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.fc_in(x))     # (B, hidden)
        x = torch.relu(self.shared(x))    # (B, hidden), first use
        x = torch.relu(self.shared(x))    # (B, hidden), second use: same Parameters
        return self.fc_out(x)             # (B, num_classes)
