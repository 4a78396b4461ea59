"""What backward keeps: the bytes each node's forward saves for its backward.

A node's output is not what training holds (``w.t()`` is a view of a parameter, most elementwise
ops save nothing), so each node runs under ``saved_tensors_hooks`` and each saved storage counts
once: state is free, a storage made earlier is charged to the first node that saves it.
"""
from __future__ import annotations

from collections import ChainMap
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

import torch
import torch.fx as fx
from torch.autograd.graph import saved_tensors_hooks
from torch.utils import _pytree as pytree

Origins = dict[int, "str | None"]
"""Storage id -> the name of the node that made the storage (None: a parameter, buffer or
constant)."""


def storage_id(t: torch.Tensor) -> int:
    """The identity of ``t``'s storage, shared by its views (``id(t)`` for storage-less
    tensors, which then count as their own storage)."""
    try:
        return int(t.untyped_storage()._cdata)
    except (RuntimeError, NotImplementedError):
        return id(t)


def _storage_bytes(t: torch.Tensor) -> int:
    try:
        return int(t.untyped_storage().nbytes())
    except (RuntimeError, NotImplementedError):
        return t.numel() * t.element_size()


def tensors(value: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]


def state_origins(state: Iterable[torch.Tensor]) -> Origins:
    """Parameters, buffers and constants: storages that cost no activation memory."""
    return {storage_id(t): None for t in state}


def value_origins(node: fx.Node, value: Any, known: Origins) -> Origins:
    """Origins of ``value``'s storages: those already known (a view or in-place result of an
    input, or of state) keep their maker, new ones are made by ``node``."""
    return {sid: known.get(sid, node.name) for sid in map(storage_id, tensors(value))}


class NodeRun(Protocol):
    """What :func:`record_saved` needs of the walker's ``profiler.NodeCall`` (a protocol, so
    this module imports nothing of the walker that imports it)."""

    node: fx.Node
    origins: Mapping[int, str | None]
    copies: dict[int, int]
    make_inputs: Callable[[], tuple[tuple[Any, ...], dict[str, Any], list[torch.Tensor]]]
    run: Callable[[tuple[Any, ...], dict[str, Any]], Any]


class SavedRecorder:
    """Records what ``call``'s forward saves for backward while a run of it is inside the
    ``with`` block (a run the caller makes anyway: the estimator's), then :meth:`record` writes
    it to ``meta["fxpipe"]``: ``saved_values`` (names of the nodes whose values it saves,
    itself included when it saves its own output) and ``saved_internal_bytes`` (storages made
    and saved inside the node, not its output). Enter it after ``call.make_inputs()``: an
    in-place node's private copies are mapped back through ``call.copies``."""

    def __init__(self, call: NodeRun) -> None:
        self.call = call
        self.seen: dict[int, torch.Tensor] = {}
        self._hooks = saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        sid = storage_id(t)
        self.seen.setdefault(self.call.copies.get(sid, sid), t)  # in-place: runs on copies
        return t

    def __enter__(self) -> SavedRecorder:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hooks.__exit__(*exc)

    def record(self, out: Any) -> None:
        call = self.call
        known = ChainMap({}, call.origins)
        for sid in map(storage_id, tensors(out)):  # new storages of the output: this node's
            known.setdefault(call.copies.get(sid, sid), call.node.name)
        values: list[str] = []
        internal = 0
        for sid, t in self.seen.items():
            if sid in known:
                maker = known[sid]
                if maker is not None and maker not in values:
                    values.append(maker)
            else:
                internal += _storage_bytes(t)
        meta = call.node.meta.setdefault("fxpipe", {})
        meta["saved_values"], meta["saved_internal_bytes"] = tuple(values), internal


def record_saved(call: NodeRun) -> None:
    """Run ``call``'s forward once with gradients on and record what it saves for backward
    (:class:`SavedRecorder`); a placeholder saves nothing itself (its consumers are charged)."""
    if call.node.op == "placeholder":
        meta = call.node.meta.setdefault("fxpipe", {})
        meta["saved_values"], meta["saved_internal_bytes"] = (), 0
        return
    args, kwargs, _ = call.make_inputs()
    with torch.enable_grad(), SavedRecorder(call) as rec:
        out = call.run(args, kwargs)
    rec.record(out)


def saved_bytes(names: list[str], meta: dict[str, dict[str, Any]]) -> list[float | None]:
    """Per node (program order), the bytes charged to it: its internal saved storages plus the
    values it is the first to save (at their output bytes). None where the graph was costed
    without saved-tensor records (older graphs, imported profiles)."""
    counted: set[str] = set()
    out: list[float | None] = []
    for name in names:
        m = meta.get(name, {})
        if "saved_values" not in m:
            out.append(None)
            continue
        total = float(m["saved_internal_bytes"])
        for v in m["saved_values"]:
            if v not in counted:
                counted.add(v)
                total += float(meta.get(v, {}).get("bytes", 0))
        out.append(total)
    return out
