"""Whole-step calibration: node times scaled so their sums equal one training step as it runs.

Nodes timed alone run hot in cache on a one-node autograd graph; a step streams every weight,
gradient and optimizer state. :func:`calibrate` times whole steps as a stage runs them and scales
each node's forward, backward and update by the step's part over its nodes' sum (shares kept).
"""
from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from fxpipe.tracing.modelio import ModelIO

from .update import OptimizerFactory

log = logging.getLogger(__name__)

PARTS = ("forward", "backward", "update")
# The update is timed on clones of every trainable parameter (plus their optimizer state): above
# this many parameter bytes it is not (its ratio stays 1; measure_updates' per-group times
# stand), so calibrating never needs several copies of a large model's weights in memory.
UPDATE_CLONE_BYTES = 512 * 2**20
# Ratios outside this band are not applied: a whole step 5x slower (or faster) than its nodes is
# a measurement gone wrong (another process held the core), not a cache effect.
PLAUSIBLE = (0.5, 5.0)
# On a GPU every node's sample waits for the device (torch.cuda.synchronize) and pays a launch
# the whole step overlaps with the kernels before it: tens of microseconds on kernels of tens.
# On one H200 (benchmarks/one-gpu-check.md) a GPT's nodes summed to 36.1 ms where the eager
# step took 21.5 ms, optimizer included. There a whole step much faster than its nodes is what
# the device does, so the band starts lower.
CUDA_LOWEST = 0.1


@dataclass(frozen=True)
class WholeStep:
    """Median seconds of a whole training step's parts, and the nodes' sums they are held to."""

    forward_s: float
    backward_s: float
    update_s: float
    node_forward_s: float
    node_backward_s: float
    node_update_s: float
    lowest: float = PLAUSIBLE[0]  # the band's lower end: CUDA_LOWEST where timed on a GPU

    def ratio(self, part: str) -> float:
        """Whole step over the sum of its nodes for ``part`` (1 where either side is 0 or the
        ratio is implausible: outside [``lowest``, ``PLAUSIBLE[1]``])."""
        whole, nodes = getattr(self, f"{part}_s"), getattr(self, f"node_{part}_s")
        if whole <= 0 or nodes <= 0:
            return 1.0
        r = whole / nodes
        return r if self.lowest <= r <= PLAUSIBLE[1] else 1.0

    def to_dict(self) -> dict[str, float]:
        return {**asdict(self), **{f"{p}_ratio": self.ratio(p) for p in PARTS}}


def _float_leaves(value: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(value)
            if isinstance(t, torch.Tensor) and t.requires_grad
            and (t.is_floating_point() or t.is_complex())]


def time_whole_step(gm: fx.GraphModule, example_inputs: Sequence[Any],
                    optimizer_factory: OptimizerFactory, sync: Callable[[], None], *,
                    warmup: int = 2, repeats: int = 5) -> tuple[float, float, float]:
    """Median (forward, backward, update) seconds of whole steps of ``gm`` (buffers are the
    module's own: run inside the profiler's ``isolated``). Forward and backward run on the
    model's parameters (``autograd.grad`` returns new gradient tensors, as in a pipeline stage,
    and never touches ``.grad``); the optimizer steps clones of them with those gradients, its
    state persisting across steps as in training, so the caller's parameters never move
    (above :data:`UPDATE_CLONE_BYTES` of parameters the update is not timed: 0)."""
    params = list({id(p): p for p in gm.parameters() if p.requires_grad}.values())
    size = sum(p.numel() * p.element_size() for p in params)
    clones = [p.detach().clone() for p in params] if size <= UPDATE_CLONE_BYTES else []
    if size > UPDATE_CLONE_BYTES:
        log.debug("whole-step calibration: %d parameter bytes, update not timed", size)
    opt = optimizer_factory(clones) if clones else None
    call_args = ModelIO.from_graph_module(gm).call_args(example_inputs)
    times: list[tuple[float, float, float]] = []
    for _ in range(warmup + repeats):
        args, kwargs = pytree.tree_map(
            lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t,
            call_args)
        sync()
        t0 = time.perf_counter()
        with torch.enable_grad():
            out = gm(*args, **kwargs)
        sync()
        t1 = time.perf_counter()
        roots = _float_leaves(out)
        grads: Sequence[torch.Tensor | None] = [None] * len(params)
        if roots and params:
            grads = torch.autograd.grad(roots, params, [torch.ones_like(r) for r in roots],
                                        allow_unused=True)
        sync()
        t2 = time.perf_counter()
        del out, roots
        if opt is not None:
            for c, g in zip(clones, grads):
                c.grad = g
            opt.step()
            for c in clones:
                c.grad = None
        sync()
        t3 = time.perf_counter()
        del grads
        times.append((t1 - t0, t2 - t1, t3 - t2 if opt is not None else 0.0))
    kept = times[warmup:]
    return tuple(statistics.median(t[i] for t in kept) for i in range(3))  # type: ignore[return-value]


def apply_calibration(gm: fx.GraphModule, step: WholeStep) -> None:
    """Scale every timed node's ``forward_s``, ``backward_s`` and ``update_s`` (and their IQRs)
    by ``step``'s ratios and record ``step`` on the output node. Pure bookkeeping: the sums of
    the scaled node times equal the whole step's parts (where the ratio was applied)."""
    for part in PARTS:
        r = step.ratio(part)
        for n in gm.graph.nodes:
            meta = n.meta.get("fxpipe", {})
            if "forward_s" not in meta:
                continue
            for key in (f"{part}_s", f"{part}_iqr_s"):
                if key in meta:
                    meta[key] *= r
    out = next(n for n in gm.graph.nodes if n.op == "output")
    out.meta.setdefault("fxpipe", {})["calibration"] = step.to_dict()


def calibrate(gm: fx.GraphModule, example_inputs: Sequence[Any],
              optimizer_factory: OptimizerFactory, sync: Callable[[], None], *,
              warmup: int = 2, repeats: int = 5, on_gpu: bool = False) -> WholeStep | None:
    """Time whole steps of a profiled ``gm`` and scale its node times to them (see the module
    docstring); returns what was measured, or None (nothing scaled, logged) when a whole step
    cannot run the graph (the node-by-node times stand). ``on_gpu``: the nodes were timed on a
    GPU, each sample synchronised (the band starts at :data:`CUDA_LOWEST`)."""
    timed = [n for n in gm.graph.nodes if "forward_s" in n.meta.get("fxpipe", {})]
    sums = {p: sum(n.meta["fxpipe"].get(f"{p}_s", 0.0) for n in timed) for p in PARTS}
    try:
        f, b, u = time_whole_step(gm, example_inputs, optimizer_factory, sync, warmup=warmup,
                                  repeats=repeats)
    except Exception as e:  # noqa: BLE001 - calibration refines; it never stops a compile
        log.warning("whole-step calibration skipped (%s: %s); node-by-node times stand",
                    type(e).__name__, e)
        return None
    step = WholeStep(f, b, u, sums["forward"], sums["backward"], sums["update"],
                     lowest=CUDA_LOWEST if on_gpu else PLAUSIBLE[0])
    apply_calibration(gm, step)
    log.info("whole-step calibration: forward x%.2f, backward x%.2f, update x%.2f",
             *(step.ratio(p) for p in PARTS))
    return step
