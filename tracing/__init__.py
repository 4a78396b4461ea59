"""fxpipe.tracing: capture a model as a trainable torch.fx GraphModule and annotate its nodes.

``trace`` (``leaves`` and ``modes`` keep its graphs exportable and following train/eval) gives a
TracedGraph whose ``modelio`` maps inputs and rebuilds outputs and whose ``batchdims`` says each
input's batch dimension; ``shapes`` writes ``node.meta["fxpipe"]`` (keys in docs/DESIGN.md).
"""
from .shapes import describe_value, propagate_shapes
from .trace import TracedGraph, trace

__all__ = ["TracedGraph", "describe_value", "propagate_shapes", "trace"]
