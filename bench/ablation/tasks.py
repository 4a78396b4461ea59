"""The ablation's three tasks: models, real data every machine has, and how each is scored.

* ``cnn``: a VGG-style CNN (the cluster experiment's ``DigitsVGG``, narrower: 32/32/16 channels,
  a 256-wide tail) on scikit-learn's 8x8 digits (1437 train / 360 test, the experiment's split);
  metric: test accuracy (higher is better).
* ``mlp``: a deep MLP on the same digits: 64 -> 128, eight blocks Linear(128, 128) + ReLU, -> 10
  (He init, no normalisation); metric: test accuracy.
* ``lm``: a byte-level transformer language model (pre-LN blocks, untied embeddings) on the
  Python standard library's own ``*.py`` files (sorted, concatenated: a corpus every Python
  installation has); the last 10% of the bytes are held out; metric: validation loss in nats
  per byte (lower is better) on a fixed set of held-out windows.

Every task gives minibatches of any size (the schedules need the update's batch B whole or as
S microbatches of B / S) in an order fixed by the seed: the k-th update always sees the same
samples whatever the schedule, so schedules differ only in how they compute.
"""
from __future__ import annotations

import glob
import math
import os
import sysconfig
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from bench.experiment.common import DigitsVGG, digits_split

Batch = tuple[torch.Tensor, torch.Tensor]


class DeepMLP(nn.Module):
    """64 -> width, ``blocks`` x (Linear(width, width) + ReLU), -> 10."""

    def __init__(self, blocks: int = 8, width: int = 128) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Linear(64, width), nn.ReLU()]
        for _ in range(blocks):
            layers += [nn.Linear(width, width), nn.ReLU()]
        layers.append(nn.Linear(width, 10))
        self.net = nn.Sequential(*layers)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.kaiming_normal_(m.weight, nonlinearity="relu")
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x.flatten(1))


class Block(nn.Module):
    """Pre-LayerNorm transformer block (causal self-attention, 4x GELU MLP)."""

    def __init__(self, d: int, heads: int, context: int) -> None:
        super().__init__()
        self.heads, self.context = heads, context
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        T, C = self.context, self.proj.in_features  # constants: no size() crosses a stage cut
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)                       # 3 x (B, T, C)
        q = q.view(-1, T, self.heads, C // self.heads).transpose(1, 2)       # (B, nh, T, hs)
        k = k.view(-1, T, self.heads, C // self.heads).transpose(1, 2)
        v = v.view(-1, T, self.heads, C // self.heads).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)          # (B, nh, T, hs)
        x = x + self.proj(y.transpose(1, 2).reshape(-1, T, C))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class ByteLM(nn.Module):
    """Bytes (B, T) -> next-byte logits (B, T, 256)."""

    def __init__(self, d: int = 48, layers: int = 4, heads: int = 4, context: int = 32) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(256, d), nn.Embedding(context, d)
        self.blocks = nn.Sequential(*[Block(d, heads, context) for _ in range(layers)])
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, 256)
        self.register_buffer("positions", torch.arange(context), persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(self.positions)                          # (B, T, d)
        return self.head(self.ln(self.blocks(x)))                             # (B, T, 256)


def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def stdlib_bytes(limit: int = 3_000_000) -> torch.Tensor:
    """The first ``limit`` bytes of the standard library's top-level ``*.py`` files (sorted)."""
    root = sysconfig.get_paths()["stdlib"]
    chunks, total = [], 0
    for path in sorted(glob.glob(os.path.join(root, "*.py"))):
        with open(path, "rb") as f:
            data = f.read()
        chunks.append(data)
        total += len(data)
        if total >= limit:
            break
    blob = b"\n".join(chunks)[:limit]
    return torch.frombuffer(bytearray(blob), dtype=torch.uint8).long()


@dataclass
class Task:
    """A model factory, a minibatch source and an evaluation."""

    name: str
    build: Callable[[], nn.Module]
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    batch: int                      # samples per update (B)
    updates: int                    # budget: updates per run
    eval_every: int
    higher_is_better: bool
    sgd_lr: float                   # the effective step lr / (1 - momentum) for SGD
    adamw_lr: float
    example: Callable[[int], Batch]
    minibatches: Callable[[int, int, int], list[Batch]] = None  # type: ignore[assignment]
    evaluate: Callable[[Callable[[torch.Tensor], torch.Tensor]], float] = None  # type: ignore

    @property
    def metric(self) -> str:
        return "test accuracy" if self.higher_is_better else "validation loss"


def _digits_task(name: str, build: Callable[[], nn.Module], flat: bool, updates: int,
                 sgd_lr: float, adamw_lr: float) -> Task:
    xtr, ytr, xte, yte = digits_split()
    if flat:
        xtr, xte = xtr.flatten(1), xte.flatten(1)

    def minibatches(seed: int, size: int, count: int) -> list[Batch]:
        """``count`` minibatches of ``size``: epochs of the training set in a seeded order."""
        g = torch.Generator().manual_seed(10_000 + seed)
        order: list[int] = []
        while len(order) < size * count:
            order += torch.randperm(len(xtr), generator=g).tolist()
        idx = torch.tensor(order[: size * count]).view(count, size)
        return [(xtr[i], ytr[i]) for i in idx]

    def evaluate(forward: Callable[[torch.Tensor], torch.Tensor]) -> float:
        with torch.no_grad():
            return float((forward(xte).argmax(-1) == yte).float().mean())

    return Task(name, build, F.cross_entropy, 32, updates, 5, True, sgd_lr, adamw_lr,
                lambda b: (xtr[:b], ytr[:b]), minibatches, evaluate)


def _lm_task(updates: int) -> Task:
    context, eval_windows = 32, 128
    data = stdlib_bytes()
    split = int(len(data) * 0.9)
    train, val = data[:split], data[split:]
    g = torch.Generator().manual_seed(4242)
    starts = torch.randint(0, len(val) - context - 1, (eval_windows,), generator=g)
    vx = torch.stack([val[s:s + context] for s in starts])
    vy = torch.stack([val[s + 1:s + 1 + context] for s in starts])

    def windows(starts: torch.Tensor) -> Batch:
        return (torch.stack([train[s:s + context] for s in starts]),
                torch.stack([train[s + 1:s + 1 + context] for s in starts]))

    def minibatches(seed: int, size: int, count: int) -> list[Batch]:
        g = torch.Generator().manual_seed(20_000 + seed)
        starts = torch.randint(0, split - context - 1, (count * size,), generator=g)
        return [windows(s) for s in starts.view(count, size)]

    def evaluate(forward: Callable[[torch.Tensor], torch.Tensor]) -> float:
        with torch.no_grad():
            return float(lm_loss(forward(vx), vy))

    return Task("lm", lambda: ByteLM(context=context), lm_loss, 16, updates, 10, False,
                sgd_lr=1.0, adamw_lr=3e-3, example=lambda b: windows(torch.arange(b)),
                minibatches=minibatches, evaluate=evaluate)


def make_task(name: str, updates: int | None = None) -> Task:
    """``cnn``, ``mlp`` or ``lm`` with its default budget (or ``updates``)."""
    if name == "cnn":
        return _digits_task("cnn", lambda: DigitsVGG(256, (32, 32, 16)), False,
                            updates or 200, sgd_lr=0.1, adamw_lr=2e-3)
    if name == "mlp":
        return _digits_task("mlp", DeepMLP, True, updates or 200, sgd_lr=0.1, adamw_lr=1e-3)
    if name == "lm":
        return _lm_task(updates or 200)
    raise ValueError(f"unknown task {name!r}: use cnn, mlp or lm")


TASKS = ("cnn", "mlp", "lm")


def sgd_lr(task: Task, momentum: float) -> float:
    """SGD's lr for a momentum: the same effective step lr / (1 - momentum) for every momentum."""
    return task.sgd_lr * (1.0 - momentum) if not math.isclose(momentum, 1.0) else task.sgd_lr
