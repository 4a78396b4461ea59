"""Make graphs traced by ``torch.export`` follow ``train()`` / ``eval()`` again.

``torch.export`` bakes the trace-time mode into dropout, attention-dropout and batch-norm ops;
:func:`follow_modes` (on a graph traced under :func:`exported_in_train_mode`) turns them back into
``call_module`` nodes, the model's own modules where possible, that read ``self.training``.
"""
from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

log = logging.getLogger(__name__)

_aten = torch.ops.aten


class FeatureDropout(nn.Module):
    """``aten.feature_dropout`` (channel-wise, what ``Dropout1d/2d/3d`` call) as a module that
    follows the mode (the torch modules check the input's rank; export already did)."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _aten.feature_dropout(x, self.p, self.training)

    def extra_repr(self) -> str:
        return f"p={self.p}"

    def fxpipe_source(self) -> str:
        return f"__import__('fxpipe.tracing.modes', fromlist=['_']).FeatureDropout(p={self.p!r})"


class ScaledDotProductAttention(nn.Module):
    """``F.scaled_dot_product_attention`` whose dropout applies in train mode only."""

    def __init__(self, dropout_p: float, is_causal: bool = False, scale: float | None = None,
                 enable_gqa: bool = False) -> None:
        super().__init__()
        self.dropout_p, self.is_causal, self.scale, self.enable_gqa = (dropout_p, is_causal,
                                                                       scale, enable_gqa)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask, dropout_p=self.dropout_p if self.training else 0.0,
            is_causal=self.is_causal, scale=self.scale, enable_gqa=self.enable_gqa)

    def extra_repr(self) -> str:
        return (f"dropout_p={self.dropout_p}, is_causal={self.is_causal}, scale={self.scale}, "
                f"enable_gqa={self.enable_gqa}")

    def fxpipe_source(self) -> str:
        return ("__import__('fxpipe.tracing.modes', fromlist=['_']).ScaledDotProductAttention("
                f"{self.extra_repr()})")


_DROPOUTS: dict[Any, Any] = {
    _aten.dropout.default: lambda p: nn.Dropout(p),
    _aten.dropout_.default: lambda p: nn.Dropout(p, inplace=True),
    _aten.alpha_dropout.default: lambda p: nn.AlphaDropout(p),
    _aten.feature_alpha_dropout.default: lambda p: nn.FeatureAlphaDropout(p),
    _aten.feature_dropout.default: FeatureDropout,
}


@dataclass(frozen=True)
class ModesReport:
    """What :func:`follow_modes` replaced (node names)."""

    dropouts: tuple[str, ...]
    batch_norms: tuple[str, ...]
    attentions: tuple[str, ...]


@contextlib.contextmanager
def exported_in_train_mode(model: nn.Module) -> Iterator[None]:
    """Trace in train mode (so every dropout op and its probability is in the graph), then give
    every module its mode back."""
    saved = [(m, m.training) for m in model.modules()]
    model.train()
    try:
        yield
    finally:
        for m, was in saved:
            m.training = was


def follow_modes(gm: fx.GraphModule, model: nn.Module) -> ModesReport:
    """Rewrite ``gm`` (exported from ``model``) in place so that its dropout, attention dropout
    and BatchNorm follow ``gm.train()`` / ``gm.eval()`` (docs/design-notes.md); then give every
    module of ``gm`` the mode eager would run it in: the model's own modules keep theirs, a
    module made here takes that of the module its op was traced in, the rest ``model``'s."""
    modes = {id(m): m.training for m in model.modules()}  # the user's, before anything is set
    graph = gm.graph
    made: list[tuple[nn.Module, fx.Node]] = []  # modules made here, with the op they replace
    drops: list[str] = []
    norms: list[str] = []
    atts: list[str] = []
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target in _DROPOUTS:
            path = _dropout_module(gm, model, node)
            made.append((gm.get_submodule(path), node))
            _replace(gm, node, path, (node.args[0],))
            drops.append(node.name)
        elif node.target is _aten.batch_norm.default:
            if _batch_norm(gm, model, node):
                norms.append(node.name)
        elif node.target is _aten.scaled_dot_product_attention.default:
            a, kw = list(node.args), node.kwargs
            mask = a[3] if len(a) > 3 else kw.get("attn_mask")
            p = a[4] if len(a) > 4 else kw.get("dropout_p", 0.0)
            causal = a[5] if len(a) > 5 else kw.get("is_causal", False)
            if p:
                mod = ScaledDotProductAttention(float(p), bool(causal), kw.get("scale"),
                                                bool(kw.get("enable_gqa", False)))
                made.append((mod, node))
                _replace(gm, node, _new_module(gm, node, mod), (a[0], a[1], a[2], mask))
                atts.append(node.name)
    graph.eliminate_dead_code()
    graph.lint()
    gm.recompile()
    for method in ("train", "eval"):  # ExportedProgram.module() makes these raise: the graph
        gm.__dict__.pop(method, None)  # follows the modes now, so the Module methods are back
    for mod in gm.modules():  # the model's own modules (the same objects) keep their modes
        if id(mod) not in modes:
            mod.training = model.training
    for name, sub in model.named_modules():  # copies export made of the model's modules
        if name:
            try:
                gm.get_submodule(name).training = modes[id(sub)]
            except AttributeError:
                pass
    for mod, node in made:  # the mode eager ran the op in: that of the module it came from
        if id(mod) not in modes:
            mod.training = _origin_mode(model, node, modes)
    log.debug("modes: %d dropout, %d batch norm, %d attention ops follow train/eval",
              len(drops), len(norms), len(atts))
    return ModesReport(tuple(drops), tuple(norms), tuple(atts))


def _origin(node: fx.Node) -> str | None:
    """Qualified name of the innermost module the op was traced in (None at the top)."""
    stack = node.meta.get("nn_module_stack") or {}
    return next(reversed(list(stack.values())))[0] if stack else None


def _origin_mode(model: nn.Module, node: fx.Node, modes: dict[int, bool]) -> bool:
    """The mode (as it was before tracing) of the innermost module of ``model`` that ``node``
    was traced in (its nearest ancestor the model still has; the model's own at the top)."""
    path = _origin(node) or ""
    while path:
        try:
            return modes.get(id(model.get_submodule(path)), model.training)
        except AttributeError:
            path = path.rpartition(".")[0]
    return modes.get(id(model), model.training)


def _dropout_module(gm: fx.GraphModule, model: nn.Module, node: fx.Node) -> str:
    """The path of a mode-aware module for a dropout op: the model's own when it came from a
    dropout module of that probability, else a new one."""
    p = float(node.args[1])
    made = _DROPOUTS[node.target](p)
    path = _origin(node)
    if path:
        try:
            own = model.get_submodule(path)
        except AttributeError:
            own = None
        if type(own) is type(made) and getattr(own, "p", None) == p \
                and getattr(own, "inplace", False) == getattr(made, "inplace", False):
            _set_submodule(gm, path, own)
            return path
    return _new_module(gm, node, made)


def _new_module(gm: fx.GraphModule, node: fx.Node, mod: nn.Module) -> str:
    name = f"fxpipe_{node.name}"
    while hasattr(gm, name):
        name += "_"
    gm.add_submodule(name, mod)
    return name


def _batch_norm(gm: fx.GraphModule, model: nn.Module, node: fx.Node) -> bool:
    """Replace a batch_norm op by the model's BatchNorm module owning its running statistics;
    False (left as is) when there is none (no running statistics: the mode changes nothing)."""
    x, weight, bias, mean, var = node.args[:5]
    if not isinstance(mean, fx.Node) or mean.op != "get_attr":
        return False
    path, _, attr = str(mean.target).rpartition(".")
    try:
        own = model.get_submodule(path)
    except AttributeError:
        return False
    if attr != "running_mean" or not isinstance(own, nn.modules.batchnorm._BatchNorm) or \
            own.running_mean is not _attr(gm, str(mean.target)):
        return False
    counter = f"{path}.num_batches_tracked"
    for user in [u for n in gm.graph.nodes if n.op == "get_attr" and n.target == counter
                 for u in n.users]:
        if user.target in (_aten.add_.Tensor, _aten.add_.Scalar) and not user.users:
            gm.graph.erase_node(user)  # the module counts its batches itself (train mode)
    _set_submodule(gm, path, own)
    _replace(gm, node, path, (x,))
    return True


def _attr(gm: fx.GraphModule, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part, None)
    return obj


def _set_submodule(gm: fx.GraphModule, path: str, mod: nn.Module) -> None:
    """Put ``mod`` at ``path`` (creating plain parents), unless it is there already."""
    parent_path, _, name = path.rpartition(".")
    parent: nn.Module = gm
    for part in parent_path.split(".") if parent_path else []:
        child = getattr(parent, part, None)
        if not isinstance(child, nn.Module):
            child = nn.Module()
            parent.add_module(part, child)
        parent = child
    if getattr(parent, name, None) is not mod:
        parent.add_module(name, mod)


def _replace(gm: fx.GraphModule, node: fx.Node, target: str, args: tuple) -> None:
    with gm.graph.inserting_before(node):
        new = gm.graph.call_module(target, args)
    new.meta = dict(node.meta)
    node.replace_all_uses_with(new)
    gm.graph.erase_node(node)
