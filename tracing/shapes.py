"""Shape propagation: record what every node of a traced graph produces on the example inputs.

The partitioner needs, for every value that could cross a stage boundary, its bytes and whether it
can be sent at all; one ``fx.Interpreter`` run on the example inputs writes these facts into
``node.meta["fxpipe"]`` (keys in docs/DESIGN.md).
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, Sequence

import torch
import torch.fx
from torch.utils import _pytree as pytree

# Non-tensor values that are cheap, immutable and can be baked into a consumer stage as constants.
_STATIC_SCALARS = (int, float, bool, str, type(None), torch.dtype, torch.device, type(Ellipsis))
_MAX_STATIC_LEN = 64  # longer tuples are not "small": we do not bake them into stage code


@contextmanager
def preserved_state(module: torch.nn.Module) -> Iterator[None]:
    """Run a block without leaving a trace on ``module``: buffers and the CPU/CUDA RNG are restored.

    Why: tracing runs the user's model (and the traced graph) on the example inputs. A BatchNorm in
    train mode would update its running statistics and dropout would consume random numbers; the
    user must find their model exactly as they handed it to us.
    """
    saved = [(b, b.detach().clone()) for b in module.buffers()]
    devices: list[int] = []
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        devices = list(range(torch.cuda.device_count()))
    with torch.random.fork_rng(devices=devices):
        try:
            yield
        finally:
            with torch.no_grad():
                for buf, copy in saved:
                    if buf.shape == copy.shape:
                        buf.copy_(copy)


def _is_static(value: Any, depth: int = 0) -> bool:
    """True for small constants (int, float, bool, None, torch.Size, tuples of those, ...)."""
    if isinstance(value, _STATIC_SCALARS) or isinstance(value, slice):
        return True
    if isinstance(value, (tuple, list)) and depth < 4 and len(value) <= _MAX_STATIC_LEN:
        return all(_is_static(v, depth + 1) for v in value)
    return False


def _tensor_bytes(value: Any) -> int:
    """Bytes of all tensors in ``value`` (nested tuples/lists/dicts), numel * element_size."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (tuple, list)):
        return sum(_tensor_bytes(v) for v in value)
    if isinstance(value, dict):
        return sum(_tensor_bytes(v) for v in value.values())
    return 0


def describe_value(value: Any) -> dict[str, Any]:
    """The ``node.meta["fxpipe"]`` entries describing one runtime value (docs/DESIGN.md)."""
    info: dict[str, Any] = {}
    is_tensor = isinstance(value, torch.Tensor)
    if is_tensor:
        info["shape"] = tuple(int(d) for d in value.shape)
        info["dtype"] = str(value.dtype)
    elif isinstance(value, (tuple, list)) and not isinstance(value, torch.Size):
        info["shape"] = [tuple(int(d) for d in v.shape) if isinstance(v, torch.Tensor) else None
                         for v in value]
        info["dtype"] = None
    else:
        info["shape"] = None
        info["dtype"] = None
    info["bytes"] = _tensor_bytes(value)
    info["is_tensor"] = is_tensor
    static = not is_tensor and _is_static(value)
    if static:
        info["static_value"] = tuple(value) if isinstance(value, list) else value
    info["sendable"] = is_tensor or static
    return info


def differentiable(value: Any) -> bool:
    """Can autograd carry a gradient through ``value``? Only floating and complex tensors do:
    an index (``argmax``, ``histc``'s counts, a ``cumsum(..., dtype=int32)``) never requires grad
    in eager PyTorch, and neither does a float made from one (``idx.float()``) unless something
    that carries one flows into it (``_ShapeRecorder`` follows the chain)."""
    return any(isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())
               for t in pytree.tree_leaves(value))


class _ShapeRecorder(torch.fx.Interpreter):
    """Interpreter that writes ``describe_value`` of every node's result into its meta, and
    whether a gradient can reach it (``carries_grad``)."""

    def __init__(self, gm: torch.fx.GraphModule) -> None:
        super().__init__(gm)
        self._reach: dict[torch.fx.Node, bool] = {}

    def run_node(self, n: torch.fx.Node) -> Any:
        result = super().run_node(n)
        if n.op != "output":
            meta = n.meta.setdefault("fxpipe", {})
            meta.pop("static_value", None)  # a rerun must not keep a stale constant
            meta.update(describe_value(result))
            meta["carries_grad"] = self._carries_grad(n, result)
        return result

    def _carries_grad(self, n: torch.fx.Node, value: Any) -> bool:
        """Can any gradient reach ``value`` from a trainable parameter or a floating model
        input? As autograd decides it per tensor: only floating (and complex) values carry one,
        so an integer ends the chain and a float made from indices (``histc`` of an ``argmax``,
        a router's counts) carries none. Every rank traces, so every rank derives the same
        answer (the gradient messages between stages depend on it: ``detached_values``)."""
        if n.op == "placeholder":
            reach = differentiable(value)
        elif n.op == "get_attr":
            reach = any(isinstance(t, torch.nn.Parameter) and t.requires_grad
                        for t in pytree.tree_leaves(value))
        else:
            own = n.op == "call_module" and any(
                p.requires_grad for p in self.module.get_submodule(str(n.target)).parameters())
            reach = (own or any(self._reach.get(a, False) for a in n.all_input_nodes)) \
                and differentiable(value)
        self._reach[n] = reach
        return reach


def propagate_shapes(gm: torch.fx.GraphModule, example_inputs: Sequence[Any] | Any) -> Any:
    """Run ``gm`` on ``example_inputs`` and record shape/dtype/bytes/... on every non-output node.

    ``example_inputs`` are the placeholders' values in order (``TracedGraph.flat_inputs``; a
    shorter tuple leaves the rest to their defaults), not the model's pytree of arguments.
    Runs under ``torch.no_grad`` and restores buffers and RNG afterwards, so the module is left
    untouched. Returns the graph's flat output, mostly for tests.
    """
    if not isinstance(example_inputs, (tuple, list)):
        example_inputs = (example_inputs,)
    with preserved_state(gm), torch.no_grad():
        return _ShapeRecorder(gm).run(*example_inputs, enable_io_processing=False)
