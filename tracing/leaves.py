"""Which torch.nn modules may stay single ``call_module`` nodes (leaves) in a traced graph.

Exported stage code (:mod:`fxpipe.codegen.sourcegen`) rebuilds a leaf as ``torch.nn.<repr>``, so
only a childless module whose repr evaluates back to an equal one qualifies; fxpipe traces through
the rest (``MultiheadAttention``, ``TransformerEncoderLayer``), so every compiled model exports.
"""
from __future__ import annotations

import torch
from torch import nn


def constructor_expr(module: nn.Module) -> tuple[str | None, str]:
    """``("torch.nn.Linear(in_features=4, ...)", "")`` when ``module`` can be rebuilt from its
    repr (checked by evaluating it and comparing ``extra_repr`` and state shapes), else
    ``(None, why)``."""
    expr = f"torch.nn.{module!r}"
    if list(module.children()):
        return None, "it has child modules"
    if not type(module).__module__.startswith("torch.nn.modules"):
        return None, "it is not a torch.nn module"
    if "\n" in expr:
        return None, "its repr spans several lines"
    try:
        rebuilt = eval(expr, {"torch": torch})  # noqa: S307 - our own repr of a torch.nn module
    except Exception as exc:  # noqa: BLE001 - any failure means: not rebuildable
        return None, f"its repr does not evaluate ({exc})"
    same = (type(rebuilt) is type(module) and rebuilt.extra_repr() == module.extra_repr()
            and {k: tuple(v.shape) for k, v in rebuilt.state_dict().items()}
            == {k: tuple(v.shape) for k, v in module.state_dict().items()})
    return (expr, "") if same else (None, "its repr does not rebuild it")


def rebuildable(module: nn.Module) -> bool:
    """True when stage code can rebuild ``module`` (see :func:`constructor_expr`)."""
    return constructor_expr(module)[0] is not None
