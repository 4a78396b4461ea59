"""The weight update's cost: one optimizer step for the parameters each node owns.

Under ``pipedream`` (1F1B) every replica steps after each minibatch, so the step is stage time:
measured on clones per group of owning nodes (:func:`measure_updates`) or estimated from bytes
(:func:`estimate_update_s`). The stash's copy of the weights is priced here too.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx

from .extract import fetch_attr
from .hardware import DeviceSpec

OptimizerFactory = Callable[[list[torch.Tensor]], torch.optim.Optimizer]
# Median seconds of one call of the thunk (the profiler's timer, injected to avoid a cycle).
Timer = Callable[[Callable[[], Any]], float]

# Largest parameter group timed in one step: big enough that the fixed overhead is negligible,
# small enough that the clones (parameter, gradient, optimizer state) fit beside the model.
GROUP_BYTES = 64 * 2**20
SGD_BYTES_FACTOR = 5.0  # SGD momentum: read param, grad, momentum; write param, momentum


def default_optimizer(params: list[torch.Tensor]) -> torch.optim.Optimizer:
    """What the cost model assumes when the caller names no optimizer (a module-level function,
    not a lambda, so it pickles)."""
    return torch.optim.SGD(params, lr=0.01, momentum=0.9)


def owned_trainable(gm: fx.GraphModule, node: fx.Node) -> list[torch.Tensor]:
    """The trainable parameters ``node`` owns (``meta["fxpipe"]["params"]``, written by
    :func:`~fxpipe.costmodel.extract.annotate_parameters`). Frozen ones are skipped: no
    optimizer steps them."""
    out: list[torch.Tensor] = []
    for name in node.meta.get("fxpipe", {}).get("params", ()):
        t = fetch_attr(gm, name)
        if isinstance(t, torch.nn.Parameter) and t.requires_grad:
            out.append(t)
    return out


def _nbytes(ts: Sequence[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def estimate_update_s(params: Sequence[torch.Tensor], device: DeviceSpec,
                      optimizer_bytes_factor: float = SGD_BYTES_FACTOR) -> float:
    """Roofline time of one optimizer step over ``params``: memory-bound (an element-wise update
    does a few FLOPs per 4-byte element), plus one kernel launch per tensor."""
    if not params:
        return 0.0
    return (optimizer_bytes_factor * _nbytes(params) / device.mem_bandwidth
            + len(params) * device.launch_overhead_s)


def trainable(gm: fx.GraphModule) -> list[torch.Tensor]:
    """The graph's trainable parameters, each once (tied ones are one tensor)."""
    return list({id(p): p for p in gm.parameters() if p.requires_grad}.values())


def measure_stash_copy(gm: fx.GraphModule, timer: Timer, *,
                       group_bytes: int = GROUP_BYTES) -> float:
    """Seconds to copy every trainable parameter of ``gm`` into spare tensors with one
    ``torch._foreach_copy_`` per group of at most ``group_bytes`` (so the spares stay small on a
    big model; the runtime copies a stage in one call, so this over-counts the fixed cost by a
    call per extra group). The parameters are only read."""
    total = 0.0
    group: list[torch.Tensor] = []
    size = 0
    params = trainable(gm)
    for i, p in enumerate(params):
        group.append(p.detach())
        size += p.numel() * p.element_size()
        if size >= group_bytes or i == len(params) - 1:
            spares = [torch.empty_like(t) for t in group]
            total += timer(lambda s=spares, g=group: torch._foreach_copy_(s, g))
            del spares
            group, size = [], 0
    return total


def record_stash_copy(gm: fx.GraphModule, seconds: float) -> None:
    """Record the stash's copy time on the graph's output node (``meta["fxpipe"]``), from where
    :func:`~fxpipe.costmodel.extract.to_profile` copies it into ``Profile.meta``."""
    for node in gm.graph.nodes:
        if node.op == "output":
            node.meta.setdefault("fxpipe", {})["stash_copy_s"] = float(seconds)


def estimate_stash_copy(params: Sequence[torch.Tensor], device: DeviceSpec) -> float:
    """Roofline time of the stash's copy of ``params``: every byte read and written once, one
    multi-tensor launch."""
    if not params:
        return 0.0
    return 2.0 * _nbytes(params) / device.mem_bandwidth + device.launch_overhead_s


def _step_time(tensors: Sequence[torch.Tensor], factory: OptimizerFactory, timer: Timer) -> float:
    """Median seconds of ``step()`` of a fresh optimizer over clones of ``tensors`` with random
    gradients, after a first step (which allocates momentum/moment buffers) outside the timing."""
    clones = [t.detach().clone().requires_grad_(True) for t in tensors]
    for c in clones:
        c.grad = torch.randn_like(c)
    opt = factory(clones)
    opt.step()  # warm-up: optimizer state (momentum buffers) is created on the first step
    try:
        return timer(opt.step)
    finally:
        del opt, clones


def measure_updates(gm: fx.GraphModule, optimizer_factory: OptimizerFactory, timer: Timer,
                    *, group_bytes: int = GROUP_BYTES) -> dict[str, float]:
    """Seconds per optimizer step per node name, for every compute node that owns trainable
    parameters (see docs/design-notes.mdstring for the grouping and apportioning)."""
    owners = [(n.name, ps) for n in gm.graph.nodes
              if n.op in ("call_module", "call_function", "call_method")
              for ps in (owned_trainable(gm, n),) if ps]
    groups: list[list[tuple[str, list[torch.Tensor]]]] = []
    size = group_bytes
    for name, ps in owners:
        if size >= group_bytes:
            groups.append([])
            size = 0
        groups[-1].append((name, ps))
        size += _nbytes(ps)
    out: dict[str, float] = {}
    with torch.random.fork_rng(devices=[]):  # the random gradients must not move the CPU RNG
        for group in groups:
            tensors = [p for _, ps in group for p in ps]
            t_full = _step_time(tensors, optimizer_factory, timer)
            tiny = [torch.zeros(1, dtype=p.dtype, device=p.device) for p in tensors]
            t_base = min(_step_time(tiny, optimizer_factory, timer), t_full)
            total = _nbytes(tensors)
            for name, ps in group:
                share = _nbytes(ps) / total if total else 1.0 / len(group)
                out[name] = t_base * len(ps) / len(tensors) + (t_full - t_base) * share
    return out
