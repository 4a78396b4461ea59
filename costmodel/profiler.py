"""Measured per-node costs: run the graph node by node on this machine and time each node.

The partitioner needs each node's cost separately, backward included, so :func:`iter_node_calls`
(shared with the estimator) runs each node on detached copies of its inputs. Profiling leaves the
caller's train/eval flags, buffers, RNG state and every ``.grad`` as they were.
"""
from __future__ import annotations

import contextlib
import logging
import math
import operator
import statistics
import time
from collections import ChainMap
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from fxpipe.errors import ConfigError, CostingError, InputMismatchError
from fxpipe.host_memory import keep_freed_memory
from fxpipe.tracing.shapes import differentiable

from .calibrate import calibrate
from .extract import annotate_parameters, fetch_attr
from .saved import (Origins, record_saved, state_origins, storage_id, tensors,
                    value_origins)
from .update import (OptimizerFactory, default_optimizer, measure_stash_copy, measure_updates,
                     record_stash_copy)

log = logging.getLogger(__name__)

# Calls shorter than this are repeated in an inner loop so that perf_counter's resolution and
# Python overhead do not dominate the sample.
_MIN_SAMPLE_S = 20e-6
_MAX_INNER = 64
STABLE_SPREAD = 0.1  # IQR / median above which the profiler keeps sampling
# Whole training steps timed per node sample (their median scales every node, so it gets more
# samples than a node's: on this project's 2-core machine a median of 5 whole steps moved by
# 10-15% between compiles of the same model)
WHOLE_STEP_REPEATS = 3
_INPLACE_OPERATORS = {operator.iadd, operator.isub, operator.imul, operator.itruediv,
                      operator.ifloordiv, operator.imod, operator.ipow, operator.iand,
                      operator.ior, operator.ixor, operator.ilshift, operator.irshift,
                      operator.imatmul, operator.setitem}


def schema_mutates(target: Any) -> bool:
    """Does an aten operator write into one of its arguments, by its schema (``Tensor(a!)``)?

    Why the schema and not the name: an overload such as ``aten.add_.Tensor`` is an
    ``OpOverload`` whose ``__name__`` is ``add_.Tensor``, and ``aten.index_put_`` or ops with an
    ``out=`` argument mutate without a name ending in ``_`` at all."""
    if isinstance(target, torch._ops.OpOverloadPacket):
        return any(schema_mutates(getattr(target, o)) for o in target.overloads())
    schema = getattr(target, "_schema", None)
    if schema is None:
        return False
    return any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)


def _is_inplace(node: fx.Node, gm: fx.GraphModule) -> bool:
    """Does this node mutate one of its inputs? Such nodes get private input copies, so timing
    them repeatedly never changes the values later nodes compute. Static: the op's schema, an
    ``out=`` or ``inplace=True`` argument, a module's ``inplace`` flag, a trailing-underscore
    method or function name; :func:`iter_node_calls` also catches any other write at run time
    (an input's version counter moved)."""
    if node.kwargs.get("inplace") is True or "out" in node.kwargs:
        return True
    if node.op == "call_module":
        return getattr(gm.get_submodule(str(node.target)), "inplace", False) is True
    if node.op == "call_method":
        name = str(node.target)
        return name.endswith("_") and not name.startswith("__")
    if node.op == "call_function":
        if node.target in _INPLACE_OPERATORS or schema_mutates(node.target):
            return True
        name = getattr(node.target, "__name__", "")
        return name.endswith("_") and not name.startswith("__")
    return False


def _versions(values: Any) -> list[tuple[torch.Tensor, int]]:
    """(tensor, version counter) of every tensor in ``values``: an in-place write bumps it."""
    return [(t, t._version) for t in pytree.tree_leaves(values)
            if isinstance(t, torch.Tensor) and not t.is_inference()]


def is_inplace_error(e: BaseException) -> bool:
    """Autograd's complaint about an in-place write our in-place heuristic did not foresee."""
    return "in-place" in str(e) or "inplace" in str(e)


def _tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def describe_value(value: Any) -> dict[str, Any]:
    """Fallback for the tracing phase's metadata (``bytes``, ``is_tensor``, ``sendable``), used
    only where a graph did not go through ``fxpipe.tracing`` (never overrides its keys)."""
    leaves = pytree.tree_leaves(value)
    nbytes = sum(_tensor_bytes(t) for t in leaves if isinstance(t, torch.Tensor))
    is_tensor = isinstance(value, torch.Tensor)
    static = (int, float, bool, type(None), torch.Size)
    is_static = not is_tensor and isinstance(value, (*static, tuple, list)) and all(
        isinstance(v, static) for v in leaves)
    return {"bytes": nbytes, "is_tensor": is_tensor, "sendable": is_tensor or is_static}


@dataclass
class NodeCall:
    """One graph node ready to run in isolation, on copies of the real values it consumes."""

    node: fx.Node
    fn: Callable[..., Any]
    args: tuple[Any, ...]           # real input values (shared with the walker's environment)
    kwargs: dict[str, Any]
    grad_inputs: dict[fx.Node, bool]  # per input node: does training need its gradient?
    params: list[torch.nn.Parameter]  # trainable parameters of a call_module, by identity
    inplace: bool
    input_values: dict[fx.Node, Any] = field(default_factory=dict)  # real value per input node
    value: Any = None               # the node's real output
    origins: Mapping[int, str | None] = field(default_factory=dict)  # storage -> its maker
    copies: dict[int, int] = field(default_factory=dict)  # private copy's storage -> original's

    def meta(self) -> dict[str, Any]:
        """The node's ``meta["fxpipe"]`` with the value's description filled in where tracing
        has not already written it (profiling and estimating both start from this)."""
        meta = self.node.meta.setdefault("fxpipe", {})
        for k, v in describe_value(self.value).items():
            meta.setdefault(k, v)
        return meta

    def make_inputs(self) -> tuple[tuple[Any, ...], dict[str, Any], list[torch.Tensor]]:
        """Fresh detached inputs; floating tensors whose gradient training needs become leaves
        with ``requires_grad=True``. A value consumed twice maps to one leaf."""
        leaves: list[torch.Tensor] = []
        cache: dict[int, torch.Tensor] = {}
        self.copies.clear()  # of this call's inputs only (storage ids are reused once freed)

        def prep(t: Any, grad: bool) -> Any:
            if not isinstance(t, torch.Tensor):
                return t
            key = id(t) * 2 + grad
            if key not in cache:
                if grad and (t.is_floating_point() or t.is_complex()):
                    leaf = t.detach().requires_grad_(True)
                    leaves.append(leaf)
                    cache[key] = leaf.clone() if self.inplace else leaf
                else:
                    cache[key] = t.detach().clone() if self.inplace else t.detach()
                if self.inplace:  # the private copy stands for the value it copies
                    self.copies[storage_id(cache[key])] = storage_id(t)
            return cache[key]

        def per_node(n: fx.Node) -> Any:
            return pytree.tree_map(lambda t: prep(t, self.grad_inputs[n]), self.input_values[n])

        args = fx.node.map_arg(self.node.args, per_node)
        kwargs = fx.node.map_arg(self.node.kwargs, per_node)
        return tuple(args), dict(kwargs), leaves

    def run(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return self.fn(*args, **kwargs)

    def backward_fn(self) -> Callable[[], Any] | None:
        """Run the forward once with grad enabled and return a thunk computing this node's
        backward (input and parameter gradients), or None when the node has no backward."""
        args, kwargs, leaves = self.make_inputs()
        with torch.enable_grad():
            out = self.run(args, kwargs)
        outs = [t for t in pytree.tree_leaves(out)
                if isinstance(t, torch.Tensor) and t.requires_grad and t.grad_fn is not None]
        targets = leaves + self.params
        if not outs or not targets:
            return None
        grads = [torch.randn_like(t) for t in outs]

        def thunk() -> Any:
            return torch.autograd.grad(outs, targets, grad_outputs=grads, retain_graph=True,
                                       allow_unused=True)
        return thunk


def costing_error(call: NodeCall, e: BaseException) -> CostingError:
    """The walker's failure as an fxpipe error naming the node (and the user's line, when
    the trace recorded one), instead of a raw RuntimeError from deep inside autograd."""
    where = call.node.meta.get("stack_trace") or ""
    line = where.strip().splitlines()[-2].strip() if where.strip().count("\n") >= 1 else ""
    return CostingError(
        f"node {call.node.name!r} ({call.node.op} {call.node.target}) ran on the example inputs "
        f"but failed with gradients on: {type(e).__name__}: {e}"
        + (f" (at {line})" if line else ""),
        "training would fail there too if eager autograd fails on it; otherwise report the "
        "node and its line as an fxpipe bug (leaf_modules=[...] can keep the module opaque)")


def _grad_needed(value: Any) -> bool:
    return any(isinstance(t, torch.Tensor) and t.requires_grad for t in pytree.tree_leaves(value))


@contextlib.contextmanager
def isolated(gm: fx.GraphModule) -> Iterator[None]:
    """Train mode while inside; afterwards modes, buffers and the RNG are as they were."""
    modes = [(m, m.training) for m in gm.modules()]
    buffers = [(b, b.detach().clone()) for b in gm.buffers()]
    devices = sorted({t.device.index or 0 for t in (*gm.parameters(), *gm.buffers())
                      if t.device.type == "cuda"})
    try:
        with torch.random.fork_rng(devices=devices):
            for m, _ in modes:  # not gm.train(): export's module refuses it (mode is baked in)
                m.training = True
            yield
    finally:
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)
        for m, training in modes:
            m.training = training


def _node_fn(gm: fx.GraphModule, node: fx.Node) -> Callable[..., Any]:
    if node.op == "call_module":
        return gm.get_submodule(str(node.target))
    if node.op == "call_method":
        name = str(node.target)
        return lambda self, *a, **k: getattr(self, name)(*a, **k)
    return node.target  # type: ignore[return-value]


def _bind_inputs(gm: fx.GraphModule, example_inputs: Any) -> dict[fx.Node, Any]:
    inputs = example_inputs if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(inputs) > len(placeholders):
        raise InputMismatchError(
            f"{len(inputs)} example inputs given but the graph takes {len(placeholders)} "
            f"({', '.join(str(p.target) for p in placeholders)})",
            "pass example_inputs as a tuple with one value per forward() argument")
    bound: dict[fx.Node, Any] = {}
    for i, p in enumerate(placeholders):
        if i < len(inputs):
            bound[p] = inputs[i]
        elif p.args:  # default value of an optional argument
            bound[p] = p.args[0]
        else:
            raise InputMismatchError(
                f"missing example input for {p.target!r}: {len(inputs)} given, "
                f"{len(placeholders)} expected", "pass one example value per forward() argument")
    # the walk runs the model for real: an in-place op on an input must not write into the
    # caller's example tensors (later phases, and the user, still read them)
    return {p: pytree.tree_map(lambda t: t.detach().clone() if isinstance(t, torch.Tensor)
                               else t, v) for p, v in bound.items()}


def iter_node_calls(gm: fx.GraphModule, example_inputs: Any) -> Iterator[NodeCall]:
    """Execute ``gm`` node by node (like ``fx.Interpreter``) and yield a :class:`NodeCall` for
    every placeholder and compute node, after its real value is computed. Values are freed after
    their last use so peak memory stays that of a forward pass without autograd."""
    bound = _bind_inputs(gm, example_inputs)
    nodes = list(gm.graph.nodes)
    last_use: dict[fx.Node, int] = {}
    for i, n in enumerate(nodes):
        for a in n.all_input_nodes:
            last_use[a] = i
    env: dict[fx.Node, Any] = {}
    needs_grad: dict[fx.Node, bool] = {}
    state = state_origins([*gm.parameters(), *gm.buffers()])
    origins: dict[fx.Node, Origins] = {}  # per live value: which node made each storage
    for i, node in enumerate(nodes):
        if node.op == "output":
            break
        if node.op == "placeholder":
            env[node] = bound[node]
            needs_grad[node] = _grad_needed(bound[node])
            origins[node] = value_origins(node, bound[node], {})
            yield NodeCall(node, lambda: None, (), {}, {}, [], False, value=bound[node])
        elif node.op == "get_attr":
            env[node] = fetch_attr(gm, str(node.target))
            needs_grad[node] = _grad_needed(env[node])
            origins[node] = state_origins(tensors(env[node]))  # a constant: state
        else:
            fn = _node_fn(gm, node)
            params = []
            if node.op == "call_module":
                seen: set[int] = set()
                for p in gm.get_submodule(str(node.target)).parameters():
                    if p.requires_grad and id(p) not in seen:
                        seen.add(id(p))
                        params.append(p)
            grad_in = {a: needs_grad[a] for a in node.all_input_nodes}
            args = fx.node.map_arg(node.args, env.__getitem__)
            kwargs = fx.node.map_arg(node.kwargs, env.__getitem__)
            before = _versions((args, kwargs))
            try:
                with torch.no_grad():
                    value = fn(*args, **kwargs)
            except Exception as e:  # noqa: BLE001 - re-raised with the node's name
                raise InputMismatchError(
                    f"node {node.name!r} ({node.op} {node.target}) failed on the example inputs: "
                    f"{type(e).__name__}: {e}",
                    "check that example_inputs match what the model's forward() expects") from e
            env[node] = value
            # as autograd decides it per tensor: a value needs a gradient when it is floating
            # and made from something that does; an integer output ends the chain (so a float
            # made from indices is a constant, never a leaf that requires grad)
            floating = differentiable(value)
            needs_grad[node] = (bool(params) or any(grad_in.values())) and floating
            if not floating:
                grad_in = {a: False for a in grad_in}
            wrote = any(t._version != v for t, v in before)
            if wrote and not _is_inplace(node, gm):
                log.debug("node %r wrote into an input; profiled on private copies", node.name)
            known = ChainMap(*(origins.get(a, {}) for a in node.all_input_nodes), state)
            origins[node] = value_origins(node, value, known)
            call = NodeCall(node, fn, tuple(args), dict(kwargs), grad_in, params,
                            wrote or _is_inplace(node, gm),
                            {a: env[a] for a in node.all_input_nodes}, value=value,
                            origins=known)
            yield call
        for a in node.all_input_nodes:
            if last_use.get(a) == i and a.op != "get_attr":
                env.pop(a, None)
                origins.pop(a, None)
        if not node.users:  # dead value (e.g. an unused tuple element)
            env.pop(node, None)
            origins.pop(node, None)


def _sync_fn(gm: fx.GraphModule, example_inputs: Any) -> Callable[[], None]:
    tensors = [*gm.parameters(), *gm.buffers(),
               *(t for t in pytree.tree_leaves(example_inputs) if isinstance(t, torch.Tensor))]
    if any(t.device.type == "cuda" for t in tensors):
        return torch.cuda.synchronize
    return lambda: None


@dataclass(frozen=True)
class Timing:
    """Median seconds of one call and the interquartile range of the samples behind it."""

    median_s: float
    iqr_s: float
    samples: int


def _timing(make: Callable[[], Callable[[], Any]], warmup: int, repeats: int,
            sync: Callable[[], None], reuse: bool, max_repeats: int) -> Timing:
    """Time the thunks ``make()`` returns: ``repeats`` samples after ``warmup``, then more (up
    to ``max_repeats``) while the spread (IQR / median) exceeds :data:`STABLE_SPREAD`, so a
    sample taken while another process held the core does not decide the median. With ``reuse``
    one thunk may run many times (an inner loop for sub-20µs calls); otherwise every call gets a
    fresh one."""
    thunk = make()
    inner = 1
    for w in range(max(warmup, 1)):
        if w and not reuse:
            thunk = make()
        sync()
        t0 = time.perf_counter()
        thunk()
        sync()
        dt = time.perf_counter() - t0
        if reuse and dt < _MIN_SAMPLE_S:
            inner = min(_MAX_INNER, max(inner, math.ceil(_MIN_SAMPLE_S / max(dt, 1e-7))))
    samples: list[float] = []
    while len(samples) < max(repeats, 1) or (
            len(samples) < max_repeats and _iqr(samples) > STABLE_SPREAD * statistics.median(samples)):
        if not reuse:
            thunk = make()
        sync()
        t0 = time.perf_counter()
        for _ in range(inner):
            thunk()
        sync()
        samples.append((time.perf_counter() - t0) / inner)
    return Timing(statistics.median(samples), _iqr(samples), len(samples))


def _iqr(samples: list[float]) -> float:
    if len(samples) < 2:
        return 0.0
    q = statistics.quantiles(samples, n=4, method="inclusive")
    return q[2] - q[0]


@contextlib.contextmanager
def pinned_threads(threads: int | None) -> Iterator[None]:
    """Run with ``threads`` intra-op threads (None: as is), restoring the count afterwards.

    Why: with torch's default (one thread per core) a node's time depends on what else the
    machine runs; the same tiny Llama measured 620-710 ms per stage on a loaded 2-core machine
    and 3.6 ms with one thread. One thread is also what each rank of a CPU pipeline gets under
    torchrun (OMP_NUM_THREADS=1)."""
    if threads is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def profile_graph(gm: fx.GraphModule, example_inputs: Sequence[Any] | Any, *, warmup: int = 2,
                  repeats: int = 5, max_repeats: int | None = None, threads: int | None = 1,
                  optimizer_factory: OptimizerFactory | None = None,
                  whole_step: bool = True) -> fx.GraphModule:
    """Measure ``forward_s``, ``backward_s`` and ``update_s`` of every placeholder and compute
    node of ``gm`` on this machine and annotate parameters.

    Each time is a median: ``repeats`` samples after ``warmup`` runs, extended up to
    ``max_repeats`` (default ``4 * repeats``) while the samples spread by more than 10% (IQR /
    median); the IQRs are recorded too (``forward_iqr_s``, ``backward_iqr_s``), and the profile
    reports their total as its spread. ``threads``: intra-op threads while measuring (default 1,
    as each torchrun rank on a CPU; None keeps torch's setting).

    Forward is timed with grad enabled, as in training (autograd bookkeeping included). Backward
    is ``autograd.grad`` of the node's outputs w.r.t. its gradient-needing inputs and trainable
    parameters; inputs that training never differentiates (model inputs, integer tensors, values
    computed from them alone) are not differentiated here either.

    ``update_s`` is one ``step()`` of ``optimizer_factory(params)`` (default: SGD, lr 0.01,
    momentum 0.9) for the trainable parameters the node owns, timed on clones with random
    gradients (see :mod:`fxpipe.costmodel.update`); nodes owning none get 0.

    ``whole_step`` (default): then time whole training steps of the graph and scale the node
    times so their sums equal the step's forward, backward and update
    (:mod:`fxpipe.costmodel.calibrate`: what a node timed alone in a loop does not pay, caches
    and the allocator, is then in its cost). Returns ``gm``.

    Host memory is measured as the runtime uses it: glibc keeps freed blocks in this process
    from here on (:func:`fxpipe.host_memory.keep_freed_memory`, what every rank does), so
    neither the nodes nor the whole step pay page faults a rank does not pay.
    """
    if repeats < 1 or warmup < 0:
        raise ConfigError(f"need repeats >= 1 and warmup >= 0, got {repeats=}, {warmup=}")
    if threads is not None and (not isinstance(threads, int) or threads < 1):
        raise ConfigError(f"threads={threads!r}", "use a positive number of threads, or None")
    top = max(repeats, max_repeats if max_repeats is not None else 4 * repeats)
    sync = _sync_fn(gm, example_inputs)
    t_start = time.perf_counter()
    keep_freed_memory()
    annotate_parameters(gm)

    def timing(make: Callable[[], Callable[[], Any]], reuse: bool) -> Timing:
        return _timing(make, warmup, repeats, sync, reuse, top)

    with pinned_threads(threads), isolated(gm):
        for call in iter_node_calls(gm, example_inputs):
            meta = call.meta()
            meta["forward_s"] = meta["backward_s"] = 0.0
            meta["forward_iqr_s"] = meta["backward_iqr_s"] = 0.0
            if call.node.op == "placeholder":
                record_saved(call)  # a model input: charged to the nodes that save it
                continue

            def make_forward(call: NodeCall = call) -> Callable[[], Any]:
                args, kwargs, _ = call.make_inputs()
                return lambda: call.run(args, kwargs)

            try:
                with torch.enable_grad():
                    fwd = timing(make_forward, reuse=not call.inplace)
            except RuntimeError as e:
                if call.inplace or not is_inplace_error(e):
                    raise costing_error(call, e) from e
                log.debug("node %r writes in place; retrying on private copies", call.node.name)
                call.inplace = True
                with torch.enable_grad():
                    fwd = timing(make_forward, reuse=False)
            meta["forward_s"], meta["forward_iqr_s"] = fwd.median_s, fwd.iqr_s
            record_saved(call)
            try:
                backward = call.backward_fn()
                if backward is not None:
                    bwd = timing(lambda b=backward: b, reuse=True)
                    meta["backward_s"], meta["backward_iqr_s"] = bwd.median_s, bwd.iqr_s
            except RuntimeError as e:  # e.g. an op without a derivative: training would fail too
                log.warning("cannot time the backward of node %r (%s); recording 0",
                            call.node.name, e)
            backward = None
        updates = measure_updates(gm, optimizer_factory or default_optimizer,
                                  lambda step: timing(lambda: step, reuse=True).median_s)
        for node in gm.graph.nodes:
            if node.op in ("placeholder", "call_module", "call_function", "call_method"):
                node.meta["fxpipe"]["update_s"] = updates.get(node.name, 0.0)
        record_stash_copy(gm, measure_stash_copy(
            gm, lambda copy: timing(lambda: copy, reuse=True).median_s))
        if whole_step:
            calibrate(gm, example_inputs if isinstance(example_inputs, (tuple, list))
                      else (example_inputs,), optimizer_factory or default_optimizer, sync,
                      warmup=max(warmup, 2), repeats=WHOLE_STEP_REPEATS * repeats,
                      on_gpu=sync is torch.cuda.synchronize)
    log.info("profiled %d nodes in %.2f s (%s thread(s))", len(gm.graph.nodes),
             time.perf_counter() - t_start, threads or torch.get_num_threads())
    return gm
