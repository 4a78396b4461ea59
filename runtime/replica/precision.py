"""Mixed precision for the stages' forwards: ``precision="bf16"`` runs every stage forward (and
the loss, and the recomputed forwards of activation recomputation) under
``torch.autocast(device_type, dtype=torch.bfloat16)``, exactly what an eager loop writes as::

    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = loss_fn(model(x), y)
    loss.backward()

Weights, gradients and the optimizer stay in float32 (autocast casts copies per op), so the
"master weights" are the parameters themselves (a model whose parameters are themselves low
precision gets float32 masters: :mod:`fxpipe.runtime.replica.master`). Values crossing a stage
boundary keep the dtype autocast gave them (a bfloat16 activation is sent as bfloat16, half the
bytes): the wire plan is made under the same autocast
(:func:`fxpipe.runtime.execution.wire.make_wire_plan`), so receivers post buffers of the right
dtype. The backward needs no context (autograd replays each op's dtype).

``"fp16"`` runs the same forwards under float16 autocast (CPU float16 autocast exists in torch
2.13, so it is tested here) and adds dynamic loss scaling (:mod:`fxpipe.runtime.replica.loss_scale`:
``torch.amp.GradScaler``'s rules, one scale and one skip decision for every stage), which only
the flushing schedules support.
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
