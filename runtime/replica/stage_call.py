"""Helpers around one call of a stage's GraphModule: pure functions the replica composes.

Which inputs get gradients, which must be cloned before a call may write into them, the RNG state a
recomputed forward replays, and the train/eval modes of an evaluation.
"""
from __future__ import annotations

import contextlib
import operator
from typing import Any, Collection, Iterator, Sequence

import torch

from fxpipe.codegen.split import StageSpec


def is_differentiable(t: torch.Tensor) -> bool:
    """Gradients flow only through floating/complex tensors: the rule both ends of a cut share,
    so a receiver never waits for a gradient the sender will not send."""
    return t.is_floating_point() or t.is_complex()


@contextlib.contextmanager
def modes(module: torch.nn.Module, training: bool) -> Iterator[None]:
    """Put ``module`` and all its submodules in train (or eval) mode for a block, then give
    every one back the mode it had (``module.train(old)`` would flatten a mix of modes)."""
    saved = [(m, m.training) for m in module.modules()]
    module.train(training)
    try:
        yield
    finally:
        for m, was in saved:
            m.training = was


def rng_state(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The CPU generator's state (and the device's, on CUDA): what a recomputed forward needs
    to draw the same dropout masks."""
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


def writable(ins: Sequence[Any], which: Collection[int]) -> list[Any]:
    """The stage's inputs ``which`` as non-leaf clones: a received activation is a leaf that
    requires grad, and a stage that starts with an in-place op (a cut right before
    ``ReLU(inplace=True)``) may not write into a leaf. The leaves stay in ``_InFlight`` for their
    gradients. Inputs no op may write into (:func:`may_write_inputs`) are passed as they are."""
    return [x.clone() if i in which and isinstance(x, torch.Tensor) and x.requires_grad else x
            for i, x in enumerate(ins)]


# consumers that never write into their input and return a fresh tensor (not a view of it)
_FRESH_MODULES = (torch.nn.Linear, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d,
                  torch.nn.BatchNorm1d, torch.nn.BatchNorm2d, torch.nn.LayerNorm, torch.nn.ReLU,
                  torch.nn.GELU, torch.nn.Tanh, torch.nn.Sigmoid, torch.nn.MaxPool2d,
                  torch.nn.AvgPool2d, torch.nn.AdaptiveAvgPool2d)
_FRESH_FUNCTIONS = frozenset({operator.add, operator.sub, operator.mul, operator.truediv,
                              operator.matmul, torch.add, torch.mul, torch.matmul, torch.cat,
                              torch.nn.functional.linear, torch.relu})


def may_write_inputs(spec: StageSpec) -> frozenset[int]:
    """Positions of the inputs that some op might write into in place: every one, except those
    whose every user is a known out-of-place op with a fresh result (conservative)."""
    gm = spec.gm
    if not isinstance(gm, torch.fx.GraphModule):
        return frozenset(range(len(spec.inputs)))
    def safe(user: torch.fx.Node) -> bool:
        if user.op == "call_module":
            mod = gm.get_submodule(str(user.target))
            return type(mod) in _FRESH_MODULES and not getattr(mod, "inplace", False)
        return (user.op == "call_function" and user.target in _FRESH_FUNCTIONS
                and not user.kwargs.get("inplace", False) and "out" not in user.kwargs)
    holders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    return frozenset(i for i, n in enumerate(holders) if not all(safe(u) for u in n.users))
