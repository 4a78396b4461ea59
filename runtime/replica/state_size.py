"""Bytes a replica keeps per byte of its parameters, as the run keeps them: the planner's ``opt``.

The planner prices a stage's state as ``P (2 + opt)``: its weights, one gradient of the same
size, and ``opt`` more bytes per parameter byte. That is SGD with momentum's 1 for a float32
model, but a bfloat16 model trained with AdamW under fxpipe's default master weights
(:mod:`.master`) keeps, per parameter, the bf16 weight (2 bytes), a float32 gradient (4: low
precision gradients are accumulated, reduced and clipped in float32), the float32 master (4) and
AdamW's two float32 moments (8): 18 bytes, 9 per parameter byte, ``opt = 7``.

:func:`state_factor` measures the optimizer's own state on tiny stand-ins of the parameters
(same dtypes and number of dimensions, so a factory that groups by shape or name accepts them;
masters float32 where the run would make them), stepped once; it works for parameters on the
meta device too, since only their dtypes and ranks are read.
"""
from __future__ import annotations

import logging
import math
from typing import Callable, Sequence

import torch

from .master import LOW_PRECISION, MASTER_DTYPE
from .mitigation import bind_optimizer

log = logging.getLogger(__name__)

FALLBACK_STATE = 2.0
"""Optimizer state per element byte when the factory will not run on stand-ins: Adam's."""


def _default_optimizer(params: list[torch.Tensor]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.01, momentum=0.9)


def state_per_byte(optimizer: Callable[..., torch.optim.Optimizer],
                   shapes: Sequence[tuple[int, torch.dtype]], stage: int = 0
                   ) -> tuple[float | None, Exception | None]:
    """Optimizer state bytes per byte of the tensors it steps (per-element state only: a step
    counter is negligible next to a real parameter), measured by building the factory (as
    stage ``stage`` builds it) on tiny tensors of these (rank, dtype) and stepping it once;
    ``(None, error)`` when the factory will not run on them."""
    tiny = [torch.zeros((math.ceil(64 ** (1 / nd)),) * nd if nd else (), dtype=dt,
                        requires_grad=True) for nd, dt in shapes]
    try:
        opt = bind_optimizer(optimizer, stage, 0)(tiny)  # a factory taking stage=/delay=
        for t in tiny:
            t.grad = torch.ones_like(t)
        opt.step()
    except Exception as err:  # noqa: BLE001 - any factory: an estimate is not worth failing for
        return None, err
    state = sum(v.numel() * v.element_size() for t in tiny for v in opt.state.get(t, {}).values()
                if isinstance(v, torch.Tensor) and v.numel() == t.numel())
    return state / max(sum(t.numel() * t.element_size() for t in tiny), 1), None


def state_factor(params: Sequence[torch.Tensor],
                 optimizer: Callable[..., torch.optim.Optimizer] | None = None,
                 master_weights: bool | None = None) -> float:
    """``opt`` of the planner's ``P (2 + opt)`` for these trainable ``params`` trained with
    ``optimizer`` (default: SGD with momentum) and ``master_weights`` (None: float32 masters
    for float16/bfloat16 parameters, the runtime's default; False: none): state bytes beyond
    weights and one same-dtype gradient, per parameter byte, over all of them."""
    params = [p for p in params if p.requires_grad]
    if not params:
        return 0.0
    optimizer = optimizer or _default_optimizer
    low = [p for p in params if p.dtype in LOW_PRECISION]
    masters = bool(low) if master_weights is None else master_weights
    stepped = [(p.dim(), MASTER_DTYPE if masters and p.dtype in LOW_PRECISION else p.dtype)
               for p in params]
    per_byte, err = state_per_byte(optimizer, stepped)
    if per_byte is None:
        log.warning("optimizer state not measured (%s); assuming %s bytes per parameter byte",
                    err, FALLBACK_STATE)
        per_byte = FALLBACK_STATE
    total = own = 0.0
    for p, (_, dt) in zip(params, stepped):
        n, size = p.numel(), p.element_size()
        stepped_size = torch.empty((), dtype=dt).element_size()
        own += n * size
        # weight + gradient (in the stepped dtype) + master (if any) + optimizer state
        total += n * (size + stepped_size + (stepped_size if dt != p.dtype else 0)
                      + per_byte * stepped_size)
    return total / own - 2.0
