"""Test helpers for the costmodel phase (imported as ``cm_helpers``: a unique module name).

``fill_meta`` stands in for ``fxpipe.tracing``'s shape propagation (being written in parallel):
it runs the graph once and writes the same node.meta["fxpipe"] keys tracing promises (shape,
dtype, bytes, is_tensor, static_value, sendable), so these tests do not depend on tracing.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

_STATIC = (int, float, bool, type(None), torch.Size)


class _MetaFiller(fx.Interpreter):
    def run_node(self, n: fx.Node) -> Any:
        value = super().run_node(n)
        tensors = [t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]
        is_tensor = isinstance(value, torch.Tensor)
        meta: dict[str, Any] = {
            "shape": tuple(value.shape) if is_tensor else (
                [tuple(t.shape) if isinstance(t, torch.Tensor) else None for t in value]
                if isinstance(value, (tuple, list)) else None),
            "dtype": str(value.dtype) if is_tensor else None,
            "bytes": sum(t.numel() * t.element_size() for t in tensors),
            "is_tensor": is_tensor,
        }
        leaves = pytree.tree_leaves(value)
        static = not is_tensor and all(isinstance(v, _STATIC) for v in leaves)
        if static:
            meta["static_value"] = value
        meta["sendable"] = is_tensor or static
        n.meta["fxpipe"] = meta
        return value


def fill_meta(gm: fx.GraphModule, *inputs: Any) -> fx.GraphModule:
    with torch.no_grad():
        _MetaFiller(gm).run(*inputs)
    return gm


def traced(model: torch.nn.Module, *inputs: Any) -> fx.GraphModule:
    """symbolic_trace + fake tracing metadata, like fxpipe.tracing.trace would give."""
    return fill_meta(fx.symbolic_trace(model), *inputs)


def meta(gm: fx.GraphModule, name: str) -> dict[str, Any]:
    node = next(n for n in gm.graph.nodes if n.name == name)
    return node.meta.get("fxpipe", {})



class FakeClock:
    """A ``perf_counter`` that advances exactly ``TICK`` per reading and never otherwise.

    Why: timings on a shared machine are noise, but WHICH calls the profiler times, and how it
    turns readings into seconds, is behaviour. Under this clock every timed call lasts exactly one
    tick (a power of two, so differences are exact), so a test can say exactly which nodes got a
    forward and a backward time, and ``sleep`` can be made to advance it instead of waiting."""

    TICK = 2.0 ** -10

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        self.now += self.TICK
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds
