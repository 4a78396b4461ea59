"""The overhead probe's model, and the overheads measured in this process, without ranks.

The cost per parameter tensor is the stage replica's, not the links', so it is measured here: each
replica step paired with a plain step of the same layers, the median difference kept.
"""
from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from fxpipe.codegen import StageSpec, split_graph
from fxpipe.codegen.split import placed_nodes
from fxpipe.costmodel.profiler import pinned_threads
from fxpipe.tracing import trace

from ..replica.stage import StageReplica
from ..replica.stash import WeightStash

WIDTH, LAYERS, BATCH = 256, 4, 64
SMALL, SMALLS = 4, 96  # the many-tensor variant: 96 more layers of two 4-element tensors

Batch = tuple[torch.Tensor, torch.Tensor]


def probe_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The probe's loss (module level: the spawned ranks unpickle it)."""
    return F.mse_loss(out, target)


def probe_optimizer(params: list[torch.Tensor]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.01, momentum=0.9)


class _Small(nn.Module):
    """``x + (x[:, :SMALL] @ w)`` padded: two parameter tensors and next to no compute."""

    def __init__(self, g: torch.Generator) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(SMALL, SMALL, generator=g) * 0.01)
        self.b = nn.Parameter(torch.zeros(SMALL))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.pad(x[:, :SMALL] @ self.w + self.b, (0, x.shape[1] - SMALL))


def probe_model(small: int = 0) -> nn.Module:
    """The probe (docs/design-notes.md); ``small`` more layers of two tiny parameter tensors
    each, for the cost per parameter tensor."""
    g = torch.Generator().manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(LAYERS):
        lin = nn.Linear(WIDTH, WIDTH)
        with torch.no_grad():
            lin.weight.copy_(torch.randn(WIDTH, WIDTH, generator=g) / WIDTH ** 0.5)
        layers += [lin, nn.Tanh()]
    layers += [_Small(g) for _ in range(small)]
    return nn.Sequential(*layers)


class FanProbe(nn.Module):
    """The probe's layers with ``fan`` small values (``SMALL`` columns each) made after its
    second layer and added after its third: cut after the values are made (:func:`fan_cut`),
    ``fan`` values more cross it than the probe's one, for the cost of a value beyond the first
    across a cut. ``fan=0`` computes what :func:`probe_model` computes."""

    def __init__(self, fan: int) -> None:
        super().__init__()
        self.body = probe_model()
        self.fan = fan

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body[3](self.body[2](self.body[1](self.body[0](x))))
        extra = [h[:, i * SMALL:(i + 1) * SMALL] * 0.5 for i in range(self.fan)]
        h = self.body[5](self.body[4](h))
        for v in extra:
            h = h + F.pad(v, (0, WIDTH - SMALL))
        return self.body[7](self.body[6](h))


def fan_cut(gm: torch.fx.GraphModule) -> dict[str, int]:
    """Two stages of a traced :class:`FanProbe`: the first ends before its third layer."""
    placed = placed_nodes(gm)
    third = next(i for i, n in enumerate(placed) if n.op == "call_module" and n.target == "body.4")
    return {n.name: int(i >= third) for i, n in enumerate(placed)}


def eager_step(model: nn.Module, batches: list[Batch]) -> float:
    """Median seconds of a plain training step (forward, loss, backward, SGD step) of
    ``model`` (:func:`probe_model` or :class:`FanProbe`), one thread."""
    opt = probe_optimizer(list(model.parameters()))
    times = []
    with pinned_threads(1):
        for i, (x, y) in enumerate(batches[:60]):
            t0 = time.perf_counter()
            probe_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if i >= 10:
                times.append(time.perf_counter() - t0)
    return statistics.median(times)


def one_stage(small: int, example: torch.Tensor) -> StageSpec:
    """The probe (with ``small`` tiny layers) traced and split as one stage."""
    traced = trace(probe_model(small), (example,))
    return split_graph(traced.gm, {n.name: 0 for n in placed_nodes(traced.gm)})[0]


def replica_step_excess(small: int, batches: list[Batch], warmup: int = 10) -> float:
    """Median over ``batches`` of (the stage replica's F, B and U of a minibatch) - (a plain
    step of the same layers, run right after it): what one stage of the probe with ``small``
    tiny layers pays in the replica beyond plain PyTorch, one thread, no links."""
    rep = StageReplica(one_stage(small, batches[0][0]), probe_optimizer, loss_fn=probe_loss,
                       model_input_grads=False)  # as every rank's replica
    model = probe_model(small)
    opt = probe_optimizer(list(model.parameters()))
    diffs = []
    with pinned_threads(1):
        for k, (x, y) in enumerate(batches):
            t0 = time.perf_counter()
            rep.forward(k, None, [x], y)
            rep.backward(k, [])
            rep.apply_local_update()
            t1 = time.perf_counter()
            probe_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            t2 = time.perf_counter()
            if k >= warmup:
                diffs.append((t1 - t0) - (t2 - t1))
    return statistics.median(diffs)


def replica_per_tensor(batches: list[Batch]) -> float:
    """Seconds per parameter tensor the stage replica adds to plain PyTorch: the excess of
    :func:`replica_step_excess` with ``SMALLS`` tiny layers over the one without, per tensor
    (clamped at 0)."""
    return max(replica_step_excess(SMALLS, batches) - replica_step_excess(0, batches),
               0.0) / (2 * SMALLS)


def _updates(tensors: int, held: bool, steps: int = 120) -> float:
    """Median seconds of a stash update of ``tensors`` 4-element parameters (SGD), with the
    current version still read by a minibatch in flight (``held``: a copy-on-write) or not."""
    params = {f"p{i}": torch.zeros(4, requires_grad=True) for i in range(tensors)}
    stash = WeightStash(params, probe_optimizer)
    grads: dict[str, torch.Tensor | None] = {n: torch.ones(4) for n in params}
    times = []
    for k in range(steps):
        if held:
            stash.acquire(k, None)
        t0 = time.perf_counter()
        stash.update(grads)
        times.append(time.perf_counter() - t0)
        if held:
            stash.release(k)
    return statistics.median(times[steps // 4:])


def stash_per_tensor(tensors: int = 128) -> float:
    """Seconds per parameter tensor that a copy-on-write update adds to a plain one, beyond
    copying the bytes (4-element tensors: next to none)."""
    return max(_updates(tensors, True) - _updates(tensors, False), 0.0) / tensors
