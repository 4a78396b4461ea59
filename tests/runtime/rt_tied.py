"""A tiny language model with a tied input/output embedding (GPT's wte / lm_head), for tests."""
from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB = 10
ce = F.cross_entropy
sgd_m = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)


class TiedLM(nn.Module):
    """tokens -> wte -> mid -> tanh -> lm_head (lm_head.weight IS wte.weight). Placed nodes:
    idx, wte, mid, tanh, lm_head; cuts [1, 3] put wte on stage 0 and lm_head on stage 2,
    cut [1] puts them on stages 0 and 1."""

    def __init__(self, seed: int = 0, dim: int = 6) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.wte = nn.Embedding(VOCAB, dim)
        self.mid = nn.Linear(dim, dim)
        self.lm_head = nn.Linear(dim, VOCAB, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.lm_head(torch.tanh(self.mid(self.wte(idx))))


def token_batches(n: int, batch: int = 4, seed: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, VOCAB, (batch,), generator=g),
             torch.randint(0, VOCAB, (batch,), generator=g)) for _ in range(n)]


def plain_sgd_groups(model: nn.Module, data: list[tuple[Any, Any]], m: int, loss_fn, opt_factory
                     ) -> dict[str, torch.Tensor]:
    """Single-process training, one step per group of m minibatches on their concatenation
    (= gradient accumulation over m equal microbatches with a mean loss)."""
    opt = opt_factory(list(model.parameters()))
    for b in range(0, len(data), m):
        xs, ys = zip(*data[b:b + m])
        opt.zero_grad()
        loss_fn(model(torch.cat(xs)), torch.cat(ys)).backward()
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}
