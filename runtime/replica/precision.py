"""Mixed precision for the stages' forwards: ``precision="bf16"`` or ``"fp16"`` autocast.

Forwards, the loss and recomputed forwards run under ``torch.autocast``; weights, gradients and the
optimizer keep their dtype (:mod:`.master`); ``"fp16"`` adds :mod:`.loss_scale`.
"""
from __future__ import annotations

import contextlib
from typing import ContextManager

import torch

from ..errors import RuntimeConfigError

PRECISIONS = ("fp32", "bf16", "fp16")


def check_precision(precision: str) -> str:
    """The precision name, or a clear error."""
    if precision not in PRECISIONS:
        raise RuntimeConfigError(f"precision={precision!r}", f"use one of {PRECISIONS}")
    return precision


def autocast(precision: str, device: torch.device | str | None) -> ContextManager[object]:
    """The context every stage forward runs in: autocast for ``bf16`` and ``fp16``, nothing for
    ``fp32``."""
    if precision == "fp32":
        return contextlib.nullcontext()
    dev = torch.device(device) if device is not None else torch.device("cpu")
    return torch.autocast(dev.type, dtype=torch.float16 if precision == "fp16"
                          else torch.bfloat16)
