"""A float made from indices and sent between stages carries no gradient (the Mixture-of-Experts
routing pattern, Qwen2-MoE's ``histc`` counts fed to ``cumsum(..., dtype=int32)`` on the next
stage): the consumer does not make it a leaf that requires grad, so the integer ``cumsum`` runs as
in eager PyTorch, and training equals plain PyTorch written here."""
from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from fxpipe.codegen.split import placed_nodes, split_graph
from fxpipe.runtime.replica.stage import detached_values
from fxpipe.runtime.training.trainer import Trainer
from fxpipe.tracing.shapes import propagate_shapes

M = 2
sgd = functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9)


class Router(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        scaled = x * 2.0  # from the model input alone: a gradient could reach it from there
        counts = torch.histc(h.argmax(-1).float(), bins=8, min=0, max=7)
        # ---- the cut: h and counts cross it; stage 1 makes scaled again from x
        # (fxpipe.passes.made_here)
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        return self.b(h + scaled) * (1.0 + offs.float().mean() / 100.0)


def data(n: int = 6) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)) for _ in range(n)]


def split(model: nn.Module, shapes: bool = True) -> list:
    """Stages 0 and 1, cut before ``cumsum``; ``shapes``: tracing's shape pass annotated the
    graph first (as fxpipe.tracing.trace does on every rank)."""
    gm = fx.symbolic_trace(model)
    if shapes:
        propagate_shapes(gm, (data()[0][0],))
    nodes = placed_nodes(gm)
    cut = next(i for i, n in enumerate(nodes) if n.name == "cumsum")
    return split_graph(gm, {n.name: int(i >= cut) for i, n in enumerate(nodes)})


def plain(model: nn.Module, batches: list) -> dict[str, torch.Tensor]:
    """Eager PyTorch: one step per M minibatches of loss / M."""
    m = copy.deepcopy(model)
    opt = sgd(m.parameters())
    for i in range(0, len(batches), M):
        for x, y in batches[i:i + M]:
            (F.mse_loss(m(x), y) / M).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {n: t.detach().clone() for n, t in m.state_dict().items()}


def test_tracing_marks_what_no_gradient_reaches() -> None:
    stages = split(Router())
    assert set(stages[1].inputs) == {"a", "histc", "x"}
    nodes = {n.name: n for n in stages[1].gm.graph.nodes}
    assert nodes["histc"].meta["fxpipe"]["carries_grad"] is False
    assert nodes["a"].meta["fxpipe"]["carries_grad"] is True
    assert nodes["mul_here"].meta["fxpipe"]["carries_grad"] is True  # from a floating input
    assert detached_values(stages) == frozenset({"histc"})


def test_without_the_shape_pass_nothing_is_assumed() -> None:
    assert detached_values(split(Router(), shapes=False)) == frozenset()


@pytest.mark.parametrize("schedule", ["1f1b-flush", "gpipe", "zb-h1"])
def test_trains_as_plain_pytorch(schedule: str) -> None:
    model, batches = Router(), data()
    trainer = Trainer(split(copy.deepcopy(model)), [1, 1], F.mse_loss, sgd, schedule=schedule,
                      microbatches=M, executor="reference", progress=False)
    trainer.fit(batches)
    got, want = trainer.state_dict(), plain(model, batches)
    assert set(got) == set(want)
    for n, t in want.items():
        torch.testing.assert_close(got[n], t, rtol=1e-5, atol=1e-6, msg=n)
