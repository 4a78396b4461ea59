"""fxpipe.tracing: capture a model as a trainable torch.fx GraphModule and annotate its nodes.

Public API: ``trace(model, example_inputs, *, leaf_modules=(), method="auto") -> TracedGraph``
and ``propagate_shapes(gm, example_inputs)`` (writes ``node.meta["fxpipe"]``, see docs/DESIGN.md).
"""
from .shapes import describe_value, propagate_shapes
from .trace import TracedGraph, trace

__all__ = ["TracedGraph", "describe_value", "propagate_shapes", "trace"]
