"""Ready-made pieces of a language-model recipe, as picklable classes for spawned ranks.

SGD, AdamW with parameter groups by name, or Muon on the hidden matrices with AdamW on the rest,
and a per-update linear warm-up then cosine decay; ``fxpipe train`` builds them from its flags."""
from __future__ import annotations

import math
from typing import Sequence

import torch

from ..errors import RuntimeConfigError
from ..replica.muon import MuonWithAdamW
from .param_names import muon_exempt, muon_groups, weight_decay_groups

OPTIMIZERS = ("sgd", "adamw", "muon")
LR_SCHEDULES = ("constant", "cosine")


class OptimizerRecipe:
    """``(params, names) -> optimizer``: SGD with momentum, or AdamW with two groups (weight
    decay on tensors of 2+ dimensions only, nanoGPT's rule) when ``weight_decay`` > 0, or
    ``"muon"``: ``torch.optim.Muon`` (momentum 0.95, Nesterov) on the 2-D hidden matrices and
    AdamW on embeddings, heads, norms and biases (:func:`~.param_names.muon_groups`; the names in
    ``not_muon`` go to AdamW too: :func:`~.param_names.embedding_and_head_names` of the model
    finds a head its name does not give away). Muon's step is scaled to AdamW's RMS
    (``adjust_lr_fn="match_rms_adamw"``, Moonshot's rule), so one ``lr`` and ``weight_decay``
    serve both."""

    def __init__(self, kind: str, lr: float, *, weight_decay: float = 0.0,
                 momentum: float = 0.9, betas: tuple[float, float] = (0.9, 0.95),
                 not_muon: Sequence[str] = ()) -> None:
        if kind not in OPTIMIZERS:
            raise RuntimeConfigError(f"optimizer {kind!r}", f"use one of {OPTIMIZERS}")
        if not lr > 0 or weight_decay < 0:
            raise RuntimeConfigError(f"lr={lr}, weight_decay={weight_decay}",
                                     "use a positive learning rate and weight decay >= 0")
        self.kind, self.lr, self.weight_decay = kind, lr, weight_decay
        self.momentum, self.betas = momentum, betas
        self.not_muon = frozenset(not_muon)

    def _exempt(self, name: str, tensor: torch.Tensor) -> bool:
        return muon_exempt(name, tensor) or name in self.not_muon

    def __call__(self, params: list[torch.Tensor], names: Sequence[str]) -> torch.optim.Optimizer:
        if self.kind == "muon":
            hidden, rest = muon_groups(params, names, self.weight_decay, self._exempt)
            return MuonWithAdamW(hidden, rest, muon={
                "lr": self.lr, "weight_decay": self.weight_decay, "momentum": 0.95,
                "nesterov": True, "adjust_lr_fn": "match_rms_adamw"},
                rest={"lr": self.lr, "betas": self.betas})
        groups = weight_decay_groups(params, names, self.weight_decay)
        if self.kind == "adamw":
            return torch.optim.AdamW(groups, lr=self.lr, betas=self.betas)
        return torch.optim.SGD(groups, lr=self.lr, momentum=self.momentum)


class WarmupCosine:
    """LR multiplier of update k (0-based, as ``LambdaLR`` counts): ``(k + 1) / warmup`` for
    the first ``warmup`` updates, then a cosine from 1 down to ``min_ratio`` at update
    ``total``, and ``min_ratio`` after it. ``cosine=False``: constant 1 after the warm-up."""

    def __init__(self, warmup: int, total: int, min_ratio: float = 0.1,
                 cosine: bool = True) -> None:
        if warmup < 0 or total < 1 or not 0 <= min_ratio <= 1:
            raise RuntimeConfigError(f"warmup={warmup}, total={total}, min_ratio={min_ratio}",
                                     "use warmup >= 0, total >= 1 updates, 0 <= min_ratio <= 1")
        self.warmup, self.total, self.min_ratio, self.cosine = warmup, total, min_ratio, cosine

    def __call__(self, k: int) -> float:
        if k < self.warmup:
            return (k + 1) / self.warmup
        if not self.cosine:
            return 1.0
        progress = min(1.0, (k - self.warmup) / max(1, self.total - self.warmup))
        return self.min_ratio + (1 - self.min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


class SchedulerRecipe:
    """``optimizer -> LambdaLR(optimizer, WarmupCosine(...))`` (the Trainer's ``lr_scheduler``)."""

    def __init__(self, fn: WarmupCosine) -> None:
        self.fn = fn

    def __call__(self, opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
        return torch.optim.lr_scheduler.LambdaLR(opt, self.fn)
