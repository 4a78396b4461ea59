"""Which dimension of each model input is the batch: tested on the example, not guessed.

A microbatch cut is invisible only along dimensions in which samples are independent, so a set of
input dimensions of one size is the batch when the model (eval, no grad, state restored) run on
the example cut in two along them gives the parts of the whole run's outputs.
"""
from __future__ import annotations

import contextlib
import itertools
import logging
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
import torch.fx
import torch.utils._pytree as pytree

from .shapes import preserved_state

log = logging.getLogger(__name__)

Run = Callable[[tuple[Any, ...], dict[str, Any]], Any]
_MAX_COMBOS = 64  # subsets tried per candidate size (each costs two forwards)


@dataclass(frozen=True)
class BatchDims:
    """The batch dimension of each tensor input (``None``: the tensor goes whole to every
    microbatch) and of each tensor output (by leaf index of the flattened output); ``size``:
    samples in the example batch, ``None`` when nothing could be tested (``note`` says why)."""

    inputs: tuple[tuple[str, int | None], ...] = ()
    outputs: tuple[tuple[int, int | None], ...] = ()
    size: int | None = None
    note: str = ""

    @property
    def known(self) -> bool:
        return self.size is not None

    def input_dims(self) -> dict[str, int | None]:
        return dict(self.inputs)

    def output_dims(self) -> dict[int, int | None]:
        return dict(self.outputs)

    def to_dict(self) -> dict[str, Any]:
        return {"inputs": [list(x) for x in self.inputs], "outputs": [list(x) for x in self.outputs],
                "size": self.size, "note": self.note}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> BatchDims:
        return cls(tuple((str(p), None if v is None else int(v)) for p, v in d.get("inputs", ())),
                   tuple((int(i), None if v is None else int(v)) for i, v in d.get("outputs", ())),
                   d.get("size"), str(d.get("note", "")))

    def describe(self) -> str:
        """One line: which dimension of which input is the batch."""
        if not self.known:
            return f"batch dimension unknown ({self.note})"
        cut = [f"dim {d} of {p}" for p, d in self.inputs if d is not None]
        whole = [p for p, d in self.inputs if d is None]
        return (f"batch of {self.size}: " + ", ".join(cut)
                + (f"; whole to every microbatch: {', '.join(whole)}" if whole else ""))


def tensor_leaves(value: Any) -> list[tuple[str, torch.Tensor]]:
    """(path, tensor) for every tensor of ``value`` with at least one dimension."""
    try:
        flat, _ = pytree.tree_flatten_with_path(value)
        items = [(pytree.keystr(p), v) for p, v in flat]
    except (ValueError, TypeError, NotImplementedError):  # a node type without key paths
        items = [(f"[{i}]", v) for i, v in enumerate(pytree.tree_leaves(value))]
    return [(p, v) for p, v in items if isinstance(v, torch.Tensor) and v.dim() > 0]


def as_call(inputs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A batch's model inputs as ``(args, kwargs)``: a dict is keyword inputs (a Hugging Face
    batch), a tuple or list positional inputs, anything else the one positional input."""
    if isinstance(inputs, Mapping):
        return (), dict(inputs)
    if isinstance(inputs, (tuple, list)):
        return tuple(inputs), {}
    return (inputs,), {}


@contextlib.contextmanager
def _quiet_eval(module: torch.nn.Module | None) -> Iterator[None]:
    """Eval mode, no gradients, state restored (modes, buffers, RNG)."""
    if module is None:
        with torch.no_grad():
            yield
        return
    modes = [(m, m.training) for m in module.modules()]
    try:
        with preserved_state(module), torch.no_grad():
            module.eval()
            yield
    finally:
        for m, was in modes:
            m.training = was


def _narrow(value: Any, cut: Mapping[str, int], lo: int, hi: int) -> Any:
    """``value`` with the tensors at the paths of ``cut`` narrowed to ``[lo, hi)`` along their
    dimension; everything else as it is."""
    flat, spec = pytree.tree_flatten_with_path(value)
    out = [v.narrow(cut[pytree.keystr(p)], lo, hi - lo) if pytree.keystr(p) in cut else v
           for p, v in flat]
    return pytree.tree_unflatten(out, spec)


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if not a.is_floating_point():
        return bool(torch.equal(a, b))
    a, b = a.double(), b.double()
    scale = float(b.abs().max()) if b.numel() else 0.0
    return bool(torch.allclose(a, b, rtol=1e-3, atol=1e-5 + 1e-4 * scale, equal_nan=True))


def _output_dims(whole: Any, parts: Sequence[Any], sizes: Sequence[int]
                 ) -> tuple[tuple[int, int | None], ...] | None:
    """The dimension of each tensor output along which the parts' outputs concatenate to the
    whole's (None: the same in every run); None if some output does not split."""
    w = [v for _, v in tensor_leaves(whole)]
    ps = [[v for _, v in tensor_leaves(p)] for p in parts]
    if any(len(p) != len(w) for p in ps):
        return None
    dims: list[tuple[int, int | None]] = []
    for j, full in enumerate(w):
        pieces = [p[j] for p in ps]
        if all(_close(x, full) for x in pieces):
            dims.append((j, None))
            continue
        found = None
        for d in range(full.dim()):
            if (full.shape[d] == sum(sizes)
                    and all(x.dim() == full.dim() and x.shape[d] == n
                            for x, n in zip(pieces, sizes))
                    and _close(torch.cat(pieces, d), full)):
                found = d
                break
        if found is None:
            return None
        dims.append((j, found))
    return tuple(dims) if any(d is not None for _, d in dims) else None


def _combos(leaves: Sequence[tuple[str, torch.Tensor]], size: int) -> Iterator[dict[str, int]]:
    """Cuts to try for batch ``size``: each tensor along one of its dimensions of that size or
    not at all, the most tensors cut first (then the lower dimensions)."""
    options = [[d for d in range(t.dim()) if t.shape[d] == size] + [None] for _, t in leaves]
    combos = [c for c in itertools.product(*options) if any(d is not None for d in c)]
    combos.sort(key=lambda c: (sum(d is None for d in c), [d if d is not None else 99 for d in c]))
    for c in combos[:_MAX_COMBOS]:
        yield {p: d for (p, _), d in zip(leaves, c) if d is not None}


def infer_batch_dims(run: Run, args: tuple[Any, ...], kwargs: Mapping[str, Any], *,
                     module: torch.nn.Module | None = None) -> BatchDims:
    """Test which input dimensions are the batch (docs/design-notes.md). ``run(args, kwargs)``
    calls the model; ``module`` (its nn.Module) is put in eval mode and restored."""
    call = (tuple(args), dict(kwargs))
    leaves = tensor_leaves(call)
    if any(t.device.type == "meta" for _, t in leaves):
        return BatchDims(note="the example inputs are on the meta device: nothing to run")
    sizes: list[int] = []
    for _, t in leaves:
        for n in t.shape:
            if n >= 2 and n not in sizes:
                sizes.append(int(n))
    with _quiet_eval(module):
        try:
            whole = run(*call)
        except Exception as exc:  # noqa: BLE001 - the caller's own checks name the cause
            return BatchDims(note=f"the model does not run on its example: {exc}")
        for size in sizes:
            k = (size + 1) // 2
            for cut in _combos(leaves, size):
                try:
                    outs = [run(*_narrow(call, cut, lo, hi)) for lo, hi in ((0, k), (k, size))]
                except Exception:  # noqa: BLE001 - this cut does not run: not the batch
                    continue
                out_dims = _output_dims(whole, outs, (k, size - k))
                if out_dims is not None:
                    dims = tuple((p, cut.get(p)) for p, _ in leaves)
                    return BatchDims(dims, out_dims, size, "tested: the cut parts' outputs are "
                                     "the parts of the whole's")
    return BatchDims(note="no dimension of the example inputs splits: cutting any of them "
                          "changes the outputs (an example of one sample has nothing to cut)")


def export_dynamic_shapes(model: torch.nn.Module, args: tuple[Any, ...],
                          kwargs: Mapping[str, Any], dims: BatchDims) -> dict[str, Any] | None:
    """``torch.export``'s ``dynamic_shapes`` for ``model(*args, **kwargs)`` with each input's
    batch dimension free (``Dim.AUTO``: export keeps it symbolic where the code allows), so
    the graph accepts microbatches of any size; None when there is nothing to free or the
    positional inputs cannot be named."""
    import inspect

    if not dims.known:
        return None
    free = {p: d for p, d in dims.inputs if d is not None}
    flat, spec = pytree.tree_flatten_with_path((tuple(args), dict(kwargs)))
    specs = [{free[pytree.keystr(p)]: torch.export.Dim.AUTO}
             if pytree.keystr(p) in free else None for p, _ in flat]
    arg_specs, kwarg_specs = pytree.tree_unflatten(specs, spec)
    try:
        params = [p for p in inspect.signature(model.forward).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        return None
    if len(params) < len(arg_specs):
        return None
    return {**{p.name: s for p, s in zip(params, arg_specs)}, **kwarg_specs}


def record_batch_dims(gm: torch.fx.GraphModule, inputs: tuple[Any, ...],
                      kwargs: Mapping[str, Any], flat: tuple[Any, ...], dims: BatchDims) -> None:
    """``node.meta["fxpipe"]["batch_dim"]`` of each placeholder fed by an example tensor
    (the same tensor objects: binding does not copy), as :func:`infer_batch_dims` found it."""
    if not dims.known:
        return
    by_id = {id(t): dims.input_dims().get(p) for p, t in tensor_leaves((inputs, dict(kwargs)))}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, value in zip(placeholders, flat):
        if isinstance(value, torch.Tensor) and id(value) in by_id:
            node.meta.setdefault("fxpipe", {})["batch_dim"] = by_id[id(value)]
