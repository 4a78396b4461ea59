"""From an annotated FX graph to the torch-free :class:`~fxpipe.costmodel.profile.Profile`.

:func:`annotate_parameters` gives each parameter to the first node in program order that uses it,
by identity (tied weights have two names, one Parameter); :func:`to_profile` turns the graph's
``node.meta["fxpipe"]`` into profile nodes.
"""
from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch
import torch.fx as fx
from torch.fx.node import _get_qualified_name

from fxpipe.errors import ProfileFormatError

from .profile import Profile, ProfileNode
from .saved import saved_bytes

log = logging.getLogger(__name__)

_COMPUTE_OPS = ("call_module", "call_function", "call_method")


def fetch_attr(gm: torch.nn.Module, target: str) -> Any:
    """The object a ``get_attr`` node refers to (a Parameter, buffer or constant)."""
    obj: Any = gm
    for atom in target.split("."):
        if not hasattr(obj, atom):
            raise ProfileFormatError(f"get_attr target {target!r} does not exist in the graph module",
                                     "the graph and its module are out of sync; re-trace the model")
        obj = getattr(obj, atom)
    return obj


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _used_tensors(gm: fx.GraphModule, node: fx.Node) -> Iterable[tuple[str, torch.Tensor]]:
    """(name, tensor) of every parameter/buffer ``node`` reaches: its module's (recursively,
    FQN = module path + '.' + name) and those of the get_attr nodes among its arguments."""
    if node.op == "call_module":
        mod = gm.get_submodule(str(node.target))
        prefix = f"{node.target}."
        for name, p in mod.named_parameters(remove_duplicate=False):
            yield prefix + name, p
        for name, b in mod.named_buffers(remove_duplicate=False):
            yield prefix + name, b
    for a in node.all_input_nodes:
        if a.op == "get_attr":
            value = fetch_attr(gm, str(a.target))
            if isinstance(value, torch.Tensor):
                yield str(a.target), value


def reaches_parameters(gm: fx.GraphModule, node: fx.Node) -> bool:
    """Does ``node`` use a parameter (its module's, or a get_attr argument's)?"""
    return node.op != "placeholder" and any(
        isinstance(t, torch.nn.Parameter) for _, t in _used_tensors(gm, node))


def annotate_parameters(gm: fx.GraphModule) -> fx.GraphModule:
    """Record ``params``, ``shared_params``, ``parameter_bytes`` and ``buffer_bytes`` in each
    compute node's ``meta["fxpipe"]`` (placeholders get empty entries). A parameter reached again
    (a reused layer, tied weights, two module paths to one Parameter) is listed in the later
    node's ``shared_params`` under its owner's name (so stages can be matched by name), and
    counted only once, so
    summing ``parameter_bytes`` over nodes gives the model's parameter bytes."""
    owner: dict[int, str] = {}   # id(parameter) -> the name its owning node reaches it by
    seen_buffers: set[int] = set()
    for node in gm.graph.nodes:
        if node.op not in ("placeholder", *_COMPUTE_OPS):
            continue
        params: list[str] = []
        shared: list[str] = []
        pbytes = bbytes = 0
        local: set[int] = set()
        for name, t in _used_tensors(gm, node) if node.op != "placeholder" else ():
            if id(t) in local:  # reached twice by this very node: once is enough
                continue
            local.add(id(t))
            if isinstance(t, torch.nn.Parameter):
                if id(t) in owner:
                    shared.append(owner[id(t)])
                else:
                    owner[id(t)] = name
                    params.append(name)
                    pbytes += _nbytes(t)
            elif id(t) not in seen_buffers:  # buffers and tensor constants: state, not params
                seen_buffers.add(id(t))
                bbytes += _nbytes(t)
        meta = node.meta.setdefault("fxpipe", {})
        meta.update(params=tuple(params), shared_params=tuple(shared), parameter_bytes=pbytes,
                    buffer_bytes=bbytes)
    unowned = [n for n, p in gm.named_parameters() if id(p) not in owner]
    if unowned:
        log.debug("parameters used by no compute node (not counted): %s", ", ".join(unowned))
    return gm


def describe_target(gm: fx.GraphModule, node: fx.Node) -> str:
    """Human-readable target: 'layer1.0.conv1 (Conv2d)', 'torch.flatten', 'Tensor.view'."""
    if node.op == "call_module":
        return f"{node.target} ({type(gm.get_submodule(str(node.target))).__name__})"
    if node.op == "call_method":
        return f"Tensor.{node.target}"
    if node.op == "call_function":
        try:
            name = _get_qualified_name(node.target)  # type: ignore[arg-type]
        except Exception:  # noqa: BLE001 - exotic callables: fall back to repr
            return str(node.target)
        for prefix, nicer in (("_operator.", "operator."), ("torch._C._nn.", "torch.nn.functional."),
                              ("builtins.", "")):
            if name.startswith(prefix):
                return nicer + name[len(prefix):]
        return name
    return str(node.target)


def to_profile(gm: fx.GraphModule, *, batch_size: int | None = None,
               device: str = "cpu (measured)", source: str = "fxpipe") -> Profile:
    """Build the :class:`Profile` of an annotated graph: one node per placeholder and compute
    node in program order (``get_attr`` nodes are folded into their consumers, the ``output``
    node is dropped). Times come from :func:`profile_graph` or :func:`estimate_graph`."""
    nodes: list[ProfileNode] = []
    order = [n for n in gm.graph.nodes if n.op in ("placeholder", *_COMPUTE_OPS)]
    held = dict(zip((n.name for n in order), saved_bytes(
        [n.name for n in order], {n.name: n.meta.get("fxpipe", {}) for n in order})))
    outputs = {a.name for n in gm.graph.nodes if n.op == "output" for a in n.all_input_nodes}
    for node in gm.graph.nodes:
        if node.op not in ("placeholder", *_COMPUTE_OPS):
            continue
        meta = node.meta.get("fxpipe", {})
        missing = [k for k in ("forward_s", "backward_s") if k not in meta]
        if missing:
            raise ProfileFormatError(
                f"node {node.name!r} has no {' / '.join(missing)}",
                "run fxpipe.costmodel.profile_graph(gm, example_inputs) (measure this machine) or "
                "estimate_graph(gm, example_inputs, device) before to_profile")
        if "params" not in meta:
            annotate_parameters(gm)
            meta = node.meta["fxpipe"]
        if "bytes" not in meta:
            raise ProfileFormatError(
                f"node {node.name!r} has no 'bytes' (output size) in node.meta['fxpipe']",
                "trace with fxpipe.tracing.trace (shape propagation) or run profile_graph first")
        inputs = tuple(dict.fromkeys(a.name for a in node.all_input_nodes if a.op != "get_attr"))
        nodes.append(ProfileNode(
            name=node.name, op=node.op, target=describe_target(gm, node),
            forward_s=float(meta["forward_s"]), backward_s=float(meta["backward_s"]),
            activation_bytes=float(meta["bytes"]),
            parameter_bytes=float(meta.get("parameter_bytes", 0)),
            inputs=inputs, params=tuple(meta.get("params", ())),
            shared_params=tuple(meta.get("shared_params", ())),
            sendable=bool(meta.get("sendable", meta.get("is_tensor", True))),
            # graphs costed before the update was modelled have none: 0, as in old profiles
            update_s=float(meta.get("update_s", 0.0)),
            is_output=node.name in outputs, saved_bytes=held[node.name]))
    meta: dict[str, Any] = {"graph_nodes": len(gm.graph.nodes)}
    metas = [n.meta.get("fxpipe", {}) for n in gm.graph.nodes]
    if any("forward_iqr_s" in m for m in metas):  # measured: how stable the medians are
        iqr = sum(m.get("forward_iqr_s", 0.0) + m.get("backward_iqr_s", 0.0) for m in metas)
        total = sum(n.forward_s + n.backward_s for n in nodes)
        meta["spread"] = iqr / total if total > 0 else 0.0
    calibration = next((n.meta.get("fxpipe", {}).get("calibration") for n in gm.graph.nodes
                        if n.op == "output"), None)
    if calibration is not None:  # profile_graph's whole-step ratios (costmodel/calibrate.py)
        meta["calibration"] = dict(calibration)
    copy_s = next((n.meta.get("fxpipe", {}).get("stash_copy_s") for n in gm.graph.nodes
                   if n.op == "output"), None)
    if copy_s is not None:  # the stash's copy of every weight (costmodel/update.py)
        meta["stash_copy_s"] = float(copy_s)
    return Profile(nodes=tuple(nodes), batch_size=batch_size, device=device, source=source,
                   meta=meta)
