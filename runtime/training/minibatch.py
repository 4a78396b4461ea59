"""Cutting a loader minibatch into microbatches along its batch dimensions, and only those.

The cut must be invisible: each tensor is cut along its batch dimension (from the graph for
inputs, from the loss for the target, or ``batch_dims=``); a tensor without one goes whole.
A :class:`CutSpec` keys them by tensor path, so ranks holding only inputs or targets cut alike."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch
import torch.utils._pytree as pytree

from fxpipe.tracing.batchdims import as_call, tensor_leaves

from ..errors import RuntimeConfigError
from ..execution.contract import Batch

BATCH_DIMS_HINT = ("state it: trainer(batch_dims=(inputs_dims, target_dims)), each an int (that "
                   "dimension of every tensor), None (no batch dimension: whole to every "
                   "microbatch) or the structure of your batch with an int or None per tensor, "
                   "e.g. batch_dims=(1, 0) for a time-major nn.LSTM input and a (B,) target")


@dataclass(frozen=True)
class CutSpec:
    """The batch dimension of every tensor of a minibatch's inputs (paths of ``(args,
    kwargs)``) and target (paths of the target), None for a tensor that goes whole."""

    inputs: Mapping[str, int | None] = field(default_factory=dict)
    target: Mapping[str, int | None] = field(default_factory=dict)

    def describe(self) -> str:
        cut = [f"dim {d} of {name_of(side, p)}" for side, dims in (("inputs", self.inputs),
                                                                  ("target", self.target))
               for p, d in dims.items() if d is not None]
        whole = [name_of(side, p) for side, dims in (("inputs", self.inputs),
                                                     ("target", self.target))
                 for p, d in dims.items() if d is None]
        return (", ".join(cut) or "nothing") + (f" (whole to every microbatch: "
                                                f"{', '.join(whole)})" if whole else "")


def name_of(side: str, path: str) -> str:
    """A tensor's name for people: ``input 0``, ``input 'labels'``, ``the target``,
    ``target[1]`` (``path`` as :func:`~fxpipe.tracing.batchdims.tensor_leaves` writes it)."""
    if side == "target":
        return f"target{path}" if path else "the target"
    if path.startswith("[0]["):
        rest = path[4:]
        head, _, tail = rest.partition("]")
        return f"input {head}" + tail
    if path.startswith("[1]["):
        head, _, tail = path[4:].partition("]")
        return f"input {head}" + tail
    return f"input {path}"


def user_dims(spec: Any, value: Any, what: str) -> dict[str, int | None]:
    """``batch_dims=``'s half for ``value`` (the inputs as ``(args, kwargs)``, or the target) as
    dims by path: an int or None applies to every tensor; a structure like ``value``'s gives
    one per tensor."""
    leaves = tensor_leaves(value)
    if spec is None or isinstance(spec, int):
        return {p: spec for p, _ in leaves}
    if what == "inputs":
        spec = as_call(spec)
    try:
        flat, _ = pytree.tree_flatten_with_path(spec, is_leaf=lambda x: x is None)
    except (TypeError, ValueError) as err:
        raise RuntimeConfigError(f"batch_dims for the {what}: {spec!r}", BATCH_DIMS_HINT) from err
    dims = {pytree.keystr(p): v for p, v in flat}
    missing = [p for p, _ in leaves if p not in dims]
    if missing:
        raise RuntimeConfigError(f"batch_dims for the {what} names no dimension for the "
                                 f"tensor(s) {missing}", BATCH_DIMS_HINT)
    return {p: dims[p] for p, _ in leaves}


def minibatch_size(part: Batch, spec: CutSpec) -> int:
    """Samples in a minibatch: the size of its first cut tensor along its batch dimension
    (0 when it has none: nothing to cut)."""
    for side, dims in ((as_call(part[0]) if part[0] is not None else None, spec.inputs),
                       (part[1], spec.target)):
        if side is None:
            continue
        for p, t in tensor_leaves(side):
            d = dims.get(p)
            if d is not None and d < t.dim():
                return int(t.shape[d])
    return 0


def _cut(value: Any, dims: Mapping[str, int | None], sizes: Sequence[int], what: str
         ) -> list[Any]:
    """``value`` as pieces of ``sizes`` samples: tensors with a batch dimension cut along it,
    everything else whole to every piece."""
    k, size = len(sizes), sum(sizes)
    if value is None:
        return [None] * k
    flat, tree = pytree.tree_flatten_with_path(value)
    cols: list[list[Any]] = []
    for p, v in flat:
        key = pytree.keystr(p)
        if not isinstance(v, torch.Tensor) or v.dim() == 0:
            cols.append([v] * k)
            continue
        if key not in dims:
            raise RuntimeConfigError(f"the minibatch's {what} has a tensor at {key} (shape "
                                     f"{tuple(v.shape)}) whose batch dimension is not known",
                                     "give every minibatch the structure of the example batch, "
                                     "or " + BATCH_DIMS_HINT)
        d = dims[key]
        if d is None:
            cols.append([v] * k)
            continue
        if d >= v.dim() or v.shape[d] != size:
            raise RuntimeConfigError(
                f"the minibatch's {what} {key} has shape {tuple(v.shape)}: its batch dimension "
                f"{d} should hold the minibatch's {size} samples", BATCH_DIMS_HINT)
        cols.append(list(v.split(list(sizes), dim=d)))
    return [pytree.tree_unflatten([c[i] for c in cols], tree) for i in range(k)]


def piece_sizes(size: int, k: int) -> list[int]:
    """Samples in each of ``k`` pieces of ``size``, as ``torch.tensor_split`` cuts (and
    torch.distributed.pipelining): they differ by at most one, the larger first."""
    return [size // k + (1 if i < size % k else 0) for i in range(k)]


def cut_part(part: Batch, k: int, size: int, spec: CutSpec) -> list[Batch]:
    """``part`` of a minibatch of ``size`` samples as ``k`` microbatches (the structure of its
    inputs and target kept: a tensor input stays a tensor, a dict a dict)."""
    if k == 1:
        return [part]
    return cut_sizes(part, piece_sizes(size, k), spec)


def cut_sizes(part: Batch, sizes: Sequence[int], spec: CutSpec) -> list[Batch]:
    """``part`` as pieces of ``sizes`` samples (see :func:`cut_part`)."""
    k, size = len(sizes), sum(sizes)
    if min(sizes) < 1:
        raise RuntimeConfigError(f"a minibatch of {size} sample(s) cannot be cut into {k} "
                                 "microbatches", "give every minibatch at least as many "
                                 "samples, or pass microbatches= to train on the loader's "
                                 "minibatches as microbatches")
    inputs, target = part
    if inputs is None:
        ins: list[Any] = [None] * k
    else:
        args, kwargs = as_call(inputs)
        calls = _cut((args, kwargs), spec.inputs, sizes, "inputs")
        ins = [c[1] if isinstance(inputs, Mapping) else
               type(inputs)(c[0]) if isinstance(inputs, (tuple, list)) else c[0][0]
               for c in calls]
    return list(zip(ins, _cut(target, spec.target, sizes, "target")))
