"""Summing gradients in place only where nothing else holds them (runtime/replica/stage.py,
``exclusive``): which gradients autograd hands back may be written, by hand, and a pipeline whose
middle stage is ``x + w`` (its weight gradient IS the incoming gradient, and the gradient it
sends on) trained with accumulation against plain PyTorch written here."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from rt_helpers import split
from torch import nn

from fxpipe.runtime.execution.reference import ReferenceExecutor
from fxpipe.runtime.replica.stage import exclusive
from fxpipe.runtime.schedules.kinds import make_schedule


def test_which_gradients_may_be_written() -> None:
    seed = torch.ones(4, 3)
    fresh = torch.randn(3, 4)
    wide = torch.randn(5, 3).t()            # a 2-D transpose of a contiguous tensor
    shared = torch.randn(6)
    scalar = torch.ones(())
    got = exclusive([fresh, seed, seed.t(), wide, shared[:3], shared[3:],
                     scalar.expand(2, 2), None, torch.randn(2, 3, 4).transpose(0, 2)],
                    [seed])
    # fresh and the plain transpose: yes; the seed and its view: no; two halves of one storage:
    # no; an expanded scalar (writes would collide): no; None: no; a 3-D permutation: no
    # (dense, but not a shape this check accepts: conservative)
    assert got == [True, False, False, True, False, False, False, False, False]


class AddW(nn.Module):
    """Linear, then ``h + w`` with w shaped like h (its gradient is the incoming one itself,
    also the gradient sent back), then Linear."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(3, 5)
        self.w = nn.Parameter(torch.randn(4, 5) * 0.1)
        self.b = nn.Linear(5, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x) + self.w))


def test_an_aliased_gradient_is_never_written_in_place() -> None:
    g = torch.Generator().manual_seed(2)
    data = [(torch.randn(4, 3, generator=g, dtype=torch.float64),
             torch.randn(4, 2, generator=g, dtype=torch.float64)) for _ in range(8)]
    model = AddW().double()
    want = {n: p.detach().clone() for n, p in model.named_parameters()}
    # plain PyTorch: one SGD step on the mean gradient of every 4 minibatches
    ref = AddW().double()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for i in range(0, 8, 4):
        opt.zero_grad()
        for x, y in data[i:i + 4]:
            (F.mse_loss(ref(x), y) / 4).backward()
        opt.step()
    want = dict(ref.named_parameters())
    stages = split(model, [1, 3])  # a | add w, tanh | b: the add sits in the middle stage
    sched = make_schedule("1f1b-flush", [1, 1, 1], 8, microbatches=4)
    res = ReferenceExecutor(stages, [1, 1, 1], sched, F.mse_loss,
                            lambda ps: torch.optim.SGD(ps, lr=0.1)).run(data)
    got = res.merged_params()
    for n, t in want.items():
        torch.testing.assert_close(got[n.replace(".", "_") if n not in got else n], t.detach(),
                                   rtol=1e-10, atol=1e-12, msg=n)
