"""A target that carries what its loss is scaled by: how a cut minibatch trains as a whole.

The scale rides with the target to the loss's stage, where :class:`WeightedLoss` applies it, so no
executor needs to know about cuts.
"""
from __future__ import annotations

from typing import Any, Callable

import torch


class Weighted:
    """A target (``value``) whose loss is scaled by ``weight``, counting for ``count`` samples
    or labels in a mean (default: ``weight``)."""

    __slots__ = ("value", "weight", "count")

    def __init__(self, value: Any, weight: float, count: float | None = None) -> None:
        self.value, self.weight = value, weight
        self.count = weight if count is None else count


class WeightedLoss:
    """``loss_fn`` that applies a :class:`Weighted` target's scale (picklable: it travels to
    spawned ranks); plain targets pass through unchanged."""

    def __init__(self, loss_fn: Callable[[Any, Any], torch.Tensor]) -> None:
        self.loss_fn = loss_fn

    def __call__(self, output: Any, target: Any) -> torch.Tensor:
        if isinstance(target, Weighted):
            loss = self.loss_fn(output, target.value)
            return loss if target.weight == 1.0 else loss * target.weight
        return self.loss_fn(output, target)
