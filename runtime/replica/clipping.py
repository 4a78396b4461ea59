"""Gradient clipping by norm, with ``torch.nn.utils.clip_grad_norm_``'s arithmetic, over a pipeline.

:func:`clip_scope`: ``"global"`` (flushing kinds) clips by the whole model's norm, as one process
would; ``"stage"`` (asynchronous kinds) clips what each stage applies by its own norm, no messages.
"""
from __future__ import annotations

import math
from typing import Callable, Iterable, Mapping, Sequence

import torch

from ..errors import RuntimeConfigError
from ..schedules.placement import PLACED_KINDS
from ..schedules.schedule import SYNCHRONOUS_KINDS

GLOBAL_KINDS = SYNCHRONOUS_KINDS + PLACED_KINDS  # every kind that flushes: one batch per update
GROUP = "clip"
"""Name of the process-group key of the global-norm all-reduce (every rank of the pipeline)."""
EPS = 1e-6  # torch.nn.utils.clip_grad_norm_'s


def check_max_norm(max_norm: float | None) -> float | None:
    """A positive finite number or None (no clipping)."""
    if max_norm is None:
        return None
    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or not (
            math.isfinite(max_norm) and max_norm > 0):
        raise RuntimeConfigError(f"clip_grad_norm={max_norm!r}",
                                 "use a positive number (the largest gradient norm), or None")
    return float(max_norm)


def clip_scope(kind: str) -> str:
    """``"global"`` or ``"stage"`` (docs/design-notes.md)."""
    return "global" if kind in GLOBAL_KINDS else "stage"


def squared_norm(grads: Mapping[str, torch.Tensor | None], names: Iterable[str]) -> torch.Tensor:
    """Sum of the squared per-tensor 2-norms of ``grads[n]`` for ``names``, as a float64 scalar
    on the gradients' device (float32 per-tensor norms, as clip_grad_norm_ computes them)."""
    total: torch.Tensor | None = None
    for n in names:
        g = grads.get(n)
        if g is None:
            continue
        sq = torch.linalg.vector_norm(g.detach()).to(torch.float64).square()
        total = sq if total is None else total + sq
    if total is None:
        dev = next((g.device for g in grads.values() if g is not None), torch.device("cpu"))
        return torch.zeros((), dtype=torch.float64, device=dev)
    return total


def coefficient(total_sq: torch.Tensor, max_norm: float, dtype: torch.dtype) -> torch.Tensor:
    """clip_grad_norm_'s clamped coefficient from the squared total norm."""
    total = total_sq.sqrt().to(dtype)
    return torch.clamp(max_norm / (total + EPS), max=1.0)


def scaled(grads: Mapping[str, torch.Tensor | None], names: Iterable[str],
           coef: torch.Tensor) -> dict[str, torch.Tensor | None]:
    """``grads`` with ``names`` multiplied by ``coef`` (new tensors: a gradient may alias a
    tensor sent elsewhere); the others as they are."""
    out = dict(grads)
    for n in names:
        g = out.get(n)
        if g is not None:
            out[n] = g * coef.to(g.device, g.dtype)
    return out


def clip_units(trainable: Sequence[str], tied_names: Iterable[str]) -> list[tuple[str, ...]]:
    """The groups clipped together under the ``"stage"`` scope: the untied parameters, then
    each tied parameter alone."""
    tied = [n for n in trainable if n in set(tied_names)]
    own = tuple(n for n in trainable if n not in set(tied))
    return ([own] if own else []) + [(n,) for n in tied]


def clip_by_units(grads: Mapping[str, torch.Tensor | None], units: Sequence[Sequence[str]],
                  max_norm: float) -> dict[str, torch.Tensor | None]:
    """The ``"stage"`` scope: each unit scaled by its own norm."""
    out = dict(grads)
    for unit in units:
        present = [n for n in unit if out.get(n) is not None]
        if not present:
            continue
        dtype = out[present[0]].dtype  # type: ignore[union-attr]
        out = scaled(out, present, coefficient(squared_norm(out, present), max_norm, dtype))
    return out


def grad_dtype(grads: Mapping[str, torch.Tensor | None]) -> torch.dtype:
    return next((g.dtype for g in grads.values() if g is not None), torch.float32)


def counted(rank: tuple[int, int], trainable: Sequence[str], tied: Sequence[object]
            ) -> tuple[str, ...]:
    """The names rank ``(stage, replica)`` contributes to the global norm: replica 0 only, and
    a tied parameter only on the lowest stage holding it (``tied``: TiedParameter-like objects
    with ``names``: stage -> name)."""
    stage, replica = rank
    if replica != 0:
        return ()
    elsewhere = {t.names[stage] for t in tied  # type: ignore[attr-defined]
                 if stage in t.names and min(t.names) != stage}  # type: ignore[attr-defined]
    return tuple(n for n in trainable if n not in elsewhere)


def stage_clipper(max_norm: float, trainable: Sequence[str], tied_names: Iterable[str]
                  ) -> Callable[[dict[str, torch.Tensor | None]], dict[str, torch.Tensor | None]]:
    """The ``"stage"`` scope's clipping of one replica (no communication)."""
    units = clip_units(trainable, tied_names)
    return lambda grads: clip_by_units(grads, units, max_norm)
