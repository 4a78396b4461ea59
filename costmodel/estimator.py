"""Analytical per-node costs for hardware we do not have (a roofline model).

Each node runs once on fake tensors (no values, no memory: a meta-device model estimates too) to
count its forward and backward FLOPs and the bytes it moves; its time is then
``max(flops / (peak * efficiency), bytes_moved / mem_bandwidth) + launch_overhead``.
"""
from __future__ import annotations

import copy
import logging
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils import _pytree as pytree
from torch.utils.flop_counter import FlopCounterMode

from fxpipe.errors import ConfigError

from .extract import annotate_parameters, fetch_attr
from .hardware import DeviceSpec, get_device
from .profiler import NodeCall, costing_error, is_inplace_error, isolated, iter_node_calls
from .saved import SavedRecorder, record_saved
from .update import (SGD_BYTES_FACTOR, estimate_stash_copy, estimate_update_s,
                     owned_trainable, record_stash_copy, trainable)

log = logging.getLogger(__name__)


def _storage_key(t: torch.Tensor) -> tuple[str, int]:
    # the StorageImpl address, not data_ptr(): on the meta device every data_ptr() is 0
    return (str(t.device), t.untyped_storage()._cdata)


def _bytes_moved(call: NodeCall, args: tuple[Any, ...], kwargs: dict[str, Any],
                 out: Any) -> tuple[int, bool]:
    """(bytes read + written, is_view). A node whose tensor outputs all alias its inputs' storage
    (and that does not write in place) is a view: no kernel runs."""
    ins = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    outs = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
    in_storages = {_storage_key(t) for t in ins}
    fresh = [t for t in outs if _storage_key(t) not in in_storages]
    state = 0
    if call.node.op == "call_module":
        mod = call.fn
        assert isinstance(mod, torch.nn.Module)
        uniq = {id(t): t for t in (*mod.parameters(), *mod.buffers())}
        state = sum(t.numel() * t.element_size() for t in uniq.values())
    is_view = not call.inplace and not fresh and state == 0
    uniq_in = {id(t): t for t in ins}
    total = sum(t.numel() * t.element_size() for t in (*uniq_in.values(), *fresh)) + state
    if call.inplace:  # written in place: the output is the (already counted) input
        total += sum(t.numel() * t.element_size() for t in outs if _storage_key(t) in in_storages)
    return total, is_view


def _roofline(compute_s: float, nbytes: float, device: DeviceSpec) -> float:
    return max(compute_s, nbytes / device.mem_bandwidth) + device.launch_overhead_s


@dataclass(frozen=True)
class Arithmetic:
    """Which units a node's products run on: its operands' dtype, and whether torch lets
    float32 matrix products and convolutions use TF32 tensor cores (read once per estimate
    from torch's own settings, as the run would find them)."""

    tf32_matmul: bool
    tf32_conv: bool

    @classmethod
    def from_torch(cls) -> Arithmetic:
        return cls(tf32_matmul=torch.get_float32_matmul_precision() != "highest",
                   tf32_conv=bool(torch.backends.cudnn.allow_tf32))

    def seconds(self, flop_counts: dict[Any, int], dtype: str, device: DeviceSpec) -> float:
        """Seconds of ``flop_counts`` (FlopCounterMode's per-operator totals) at ``device``'s
        derated peak for ``dtype``: convolutions and the other products (matrix products,
        attention) each at the units torch would run them on."""
        total = 0.0
        for op, flops in flop_counts.items():
            tf32 = self.tf32_conv if "conv" in str(op) else self.tf32_matmul
            total += flops / (device.peak_flops(dtype, tf32=tf32) * device.efficiency)
        return total


def _compute_dtype(out: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    """The dtype a node computes in: its first floating output's (a product's output has its
    operands' dtype), else its first floating input's; "float32" if it has neither."""
    for value in (out, (args, kwargs)):
        for t in pytree.tree_leaves(value):
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                return str(t.dtype).removeprefix("torch.")
    return "float32"


def estimate_graph(gm: fx.GraphModule, example_inputs: Sequence[Any] | Any,
                   device: DeviceSpec | str, *,
                   optimizer_bytes_factor: float = SGD_BYTES_FACTOR) -> fx.GraphModule:
    """Annotate every placeholder and compute node of ``gm`` with ``flops``, ``backward_flops``,
    ``bytes_moved`` and roofline ``forward_s``/``backward_s``/``update_s`` for ``device`` (a
    :class:`DeviceSpec` or a name from the device table). Returns ``gm``, annotated.

    ``optimizer_bytes_factor``: bytes an optimizer step moves per parameter byte (5 for SGD with
    momentum: read param, grad, momentum, write param, momentum; about 7 for Adam).

    The backward covers what training computes: gradients of the node's inputs that need one
    and of its trainable parameters (see :func:`fxpipe.costmodel.profiler.profile_graph`).
    """
    spec = device if isinstance(device, DeviceSpec) else get_device(device)
    if not isinstance(optimizer_bytes_factor, (int, float)) or optimizer_bytes_factor < 0:
        raise ConfigError(f"optimizer_bytes_factor must be >= 0, got {optimizer_bytes_factor!r}",
                          "about 5 for SGD with momentum, 7 for Adam, 3 for plain SGD")
    annotate_parameters(gm)
    mode = FakeTensorMode(allow_non_fake_inputs=True)  # tensor constants in node args
    fake_gm, fake_inputs = _fake_copy(gm, example_inputs, mode)
    with mode:
        _estimate_nodes(fake_gm, fake_inputs, spec, optimizer_bytes_factor,
                        Arithmetic.from_torch())
    for node, fake in zip(gm.graph.nodes, fake_gm.graph.nodes):
        if "fxpipe" in fake.meta:
            meta = node.meta.setdefault("fxpipe", {})
            for stale in ("forward_iqr_s", "backward_iqr_s"):  # an earlier measurement's
                meta.pop(stale, None)
            meta.update(fake.meta["fxpipe"])
    record_stash_copy(gm, estimate_stash_copy(trainable(gm), spec))
    log.info("estimated %d nodes for %s", len(gm.graph.nodes), spec.name)
    return gm


def _fake_copy(gm: fx.GraphModule, example_inputs: Sequence[Any] | Any,
               mode: FakeTensorMode) -> tuple[fx.GraphModule, tuple[Any, ...]]:
    """A copy of ``gm`` whose parameters and buffers are fake tensors of the same shapes,
    dtypes and devices (tied ones stay tied, Parameters stay Parameters), and fake inputs."""
    memo: dict[int, Any] = {}
    for t in (*gm.parameters(), *gm.buffers()):
        if id(t) not in memo:
            fake = mode.from_tensor(t.detach(), static_shapes=True)
            memo[id(t)] = (torch.nn.Parameter(fake, t.requires_grad)
                           if isinstance(t, torch.nn.Parameter) else fake)
    for node in gm.graph.nodes:  # tensor constants read by get_attr (export's lifted tensors)
        if node.op == "get_attr":
            t = fetch_attr(gm, str(node.target))
            if isinstance(t, torch.Tensor) and id(t) not in memo:
                memo[id(t)] = mode.from_tensor(t, static_shapes=True)
    with warnings.catch_warnings():  # pytree's LeafSpec deprecation, raised by its own copy
        warnings.simplefilter("ignore", FutureWarning)
        fake_gm = copy.deepcopy(gm, memo)
    inputs = example_inputs if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    fake_inputs = tuple(mode.from_tensor(x, static_shapes=True) if isinstance(x, torch.Tensor)
                        else x for x in inputs)
    return fake_gm, fake_inputs


def _backward_key(call: NodeCall, args: tuple[Any, ...], kwargs: dict[str, Any]
                  ) -> tuple[Any, ...] | None:
    """What a function node's backward FLOPs depend on: the function, and its arguments with
    each tensor by shape, strides, dtype and whether it wants a gradient (the values do not
    change FLOPs). A model's repeated blocks repeat these keys, so each backward is counted
    once. None for a module call (its own state is not in the arguments)."""
    if call.node.op not in ("call_function", "call_method") or call.params:
        return None

    def sig(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return ("T", tuple(x.shape), tuple(x.stride()), x.dtype, x.requires_grad)
        return repr(x)
    try:
        return (call.node.op, str(call.node.target), call.inplace,
                tuple(sig(x) for x in pytree.tree_leaves((args, kwargs))),
                str(pytree.tree_structure((args, kwargs))))
    except RuntimeError:  # a tensor without strides (sparse, nested): count it each time
        return None


def _estimate_nodes(gm: fx.GraphModule, example_inputs: tuple[Any, ...], spec: DeviceSpec,
                    optimizer_bytes_factor: float, arithmetic: Arithmetic) -> None:
    counter = FlopCounterMode(display=False)
    backwards: dict[tuple[Any, ...], tuple[int, dict[Any, int], bool]] = {}
    with isolated(gm):
        for call in iter_node_calls(gm, example_inputs):
            meta = call.meta()
            if call.node.op == "placeholder":
                meta.update(flops=0, backward_flops=0, bytes_moved=0, forward_s=0.0,
                            backward_s=0.0, update_s=0.0)
                record_saved(call)  # a model input: charged to the nodes that save it
                continue
            try:
                args, kwargs, leaves = call.make_inputs()
                with torch.enable_grad(), counter, SavedRecorder(call) as saved:
                    out = call.run(args, kwargs)
            except RuntimeError as e:
                if call.inplace or not is_inplace_error(e):
                    raise costing_error(call, e) from e
                call.inplace = True  # an in-place write the heuristic missed: private copies
                args, kwargs, leaves = call.make_inputs()
                with torch.enable_grad(), counter, SavedRecorder(call) as saved:
                    out = call.run(args, kwargs)
            flops = counter.get_total_flops()
            forward_counts = counter.get_flop_counts().get("Global", {})
            dtype = _compute_dtype(out, args, kwargs)
            saved.record(out)  # what this very run saved for backward: no second forward
            nbytes, is_view = _bytes_moved(call, args, kwargs, out)
            outs = [t for t in pytree.tree_leaves(out)
                    if isinstance(t, torch.Tensor) and t.requires_grad and t.grad_fn is not None]
            targets = leaves + call.params
            bflops = 0
            backward_counts: dict[Any, int] = {}
            has_backward = bool(outs and targets)
            # a pure view's backward is a view of the gradient: no FLOPs, no bytes (below), so
            # it costs 0 without asking autograd (a third of an aten graph's nodes are views)
            if has_backward and not (is_view and flops == 0):
                key = _backward_key(call, args, kwargs)
                if key is not None and key in backwards:
                    bflops, backward_counts, has_backward = backwards[key]
                else:
                    grads = [torch.ones_like(t) for t in outs]  # values do not change FLOPs
                    try:
                        with counter:
                            torch.autograd.grad(outs, targets, grad_outputs=grads,
                                                allow_unused=True)
                        bflops = counter.get_total_flops()
                        backward_counts = counter.get_flop_counts().get("Global", {})
                    except RuntimeError as e:  # no derivative: training would fail there too
                        log.warning("no backward for node %r (%s)", call.node.name, e)
                        has_backward = False
                    if key is not None:
                        backwards[key] = (bflops, backward_counts, has_backward)
            nbytes_in_flight = 0 if is_view and flops == 0 else nbytes
            works = flops > 0 or nbytes_in_flight > 0
            meta.update(
                flops=flops, backward_flops=bflops, bytes_moved=nbytes_in_flight,
                forward_s=(_roofline(arithmetic.seconds(forward_counts, dtype, spec),
                                     nbytes_in_flight, spec) if works else 0.0),
                backward_s=(_roofline(arithmetic.seconds(backward_counts, dtype, spec),
                                      2 * nbytes_in_flight, spec)
                            if has_backward and (bflops > 0 or nbytes_in_flight > 0) else 0.0),
                update_s=estimate_update_s(owned_trainable(gm, call.node), spec,
                                           optimizer_bytes_factor))
            del out, outs
