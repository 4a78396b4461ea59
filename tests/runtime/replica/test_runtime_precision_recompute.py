"""bf16 autocast (Trainer(precision="bf16")) equals eager under the same autocast; activation
recomputation (Trainer(recompute=...)) equals no recomputation bit for bit, dropout and
BatchNorm included. One process (executor="reference"); oracles are plain torch loops."""
from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.nn as nn
from rt_helpers import batches, loss_fn, split, tiny_mlp

from fxpipe.runtime.errors import RuntimeConfigError
from fxpipe.runtime.replica.stage import StageReplica
from fxpipe.runtime.training.trainer import Trainer

sgd = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)
EXACT = dict(rtol=0.0, atol=0.0)


def bf16_eager(model: nn.Module, data: list, m: int, epochs: int = 1) -> None:
    """Gradient accumulation as users write it (the HF Trainer's loop): each microbatch's
    forward under its own autocast region, its backward, one step per m microbatches. (One
    autocast region around all m forwards is NOT the same computation: autocast caches one
    bfloat16 copy of each weight, whose gradient then accumulates in bfloat16.)"""
    opt = sgd(model.parameters())
    for _ in range(epochs):
        for b in range(0, len(data), m):
            opt.zero_grad()
            for x, y in data[b:b + m]:
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = loss_fn(model(x), y) / m
                loss.backward()
            opt.step()


def test_bf16_one_minibatch_per_update_is_bitwise_eager_autocast() -> None:
    """2 stages, one minibatch per update (1f1b-flush, m=1): every operation is eager's."""
    data = batches(6)
    model = tiny_mlp()
    trainer = Trainer(split(copy.deepcopy(model), [2]), [1, 1], loss_fn, sgd,
                      schedule="1f1b-flush", microbatches=1, executor="reference",
                      progress=False, precision="bf16")
    trainer.fit(data, epochs=1)
    bf16_eager(model, data, 1)
    got = trainer.state_dict()
    for name, p in model.named_parameters():
        torch.testing.assert_close(got[name], p.detach(), **EXACT, msg=name)
        assert got[name].dtype == torch.float32  # master weights stay float32


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1f1b-flush", "gpipe"])
def test_bf16_batches_of_microbatches_equal_eager_autocast(schedule: str) -> None:
    """m = 4 microbatches per update: the same per-microbatch bf16 products, the same float32
    accumulation (dividing by 4 is exact, so sum-then-divide equals accumulating quarters)."""
    data, m = batches(12), 4
    model = tiny_mlp()
    trainer = Trainer(split(copy.deepcopy(model), [1, 3]), [1, 2, 1], loss_fn, sgd,
                      schedule=schedule, microbatches=m, executor="reference", progress=False,
                      precision="bf16")
    trainer.fit(data, epochs=2)
    bf16_eager(model, data, m, epochs=2)
    fp32 = Trainer(split(tiny_mlp(), [1, 3]), [1, 2, 1], loss_fn, sgd, schedule=schedule,
                   microbatches=m, executor="reference", progress=False)
    fp32.fit(data, epochs=2)
    got, far = trainer.state_dict(), fp32.state_dict()
    for name, p in model.named_parameters():
        torch.testing.assert_close(got[name], p.detach(), rtol=1e-6, atol=1e-7, msg=name)
    # the comparison can fail: float32 training ends measurably elsewhere
    assert max(float((far[n] - p.detach()).abs().max()) for n, p in model.named_parameters()
               ) > 1e-4


def test_unknown_precisions_are_refused() -> None:
    # "fp16" is accepted (flushing schedules only): tests/runtime/replica/test_runtime_fp16.py
    for bad, match in (("half", "precision='half'"), ("float16", "use one of")):
        with pytest.raises(RuntimeConfigError, match=match):
            Trainer(split(tiny_mlp(), [2]), [1, 1], loss_fn, sgd, executor="reference",
                    precision=bad)


class Noisy(nn.Module):
    """Dropout and BatchNorm on both stages: recomputation must redraw the same masks and must
    not update the running statistics twice."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.bn, self.drop = nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Dropout(0.3)
        self.b, self.drop2, self.c = nn.Linear(8, 8), nn.Dropout(0.3), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(torch.tanh(self.bn(self.a(x))))
        return self.c(self.drop2(torch.tanh(self.b(h))))


@pytest.mark.slow
@pytest.mark.parametrize("schedule,recompute,precision", [
    ("pipedream", True, "fp32"), ("1f1b-flush", [True, False], "fp32"),
    ("pipedream", [False, True], "bf16"), ("2bw", True, "fp32")])
def test_recomputation_is_bitwise_no_recomputation(schedule: str, recompute: object,
                                                   precision: str) -> None:
    data = batches(12)
    runs = {}
    for rc in (None, recompute):
        trainer = Trainer(split(Noisy(), [4]), [1, 1], loss_fn, sgd, schedule=schedule,
                          executor="reference", progress=False, recompute=rc,
                          precision=precision, microbatches=2 if schedule != "pipedream" else None)
        hist = trainer.fit(data, epochs=2)
        runs[rc is not None] = (trainer.state_dict(), [h["loss"] for h in hist])
    (plain, lp), (rec, lr) = runs[False], runs[True]
    assert lp == lr
    assert plain.keys() == rec.keys()
    for n in plain:  # running_mean/var and num_batches_tracked included
        torch.testing.assert_close(rec[n], plain[n], **EXACT, msg=n)


def test_recomputing_replica_keeps_no_activation_graph() -> None:
    """The memory claim: after a forward only the inputs are kept (no outputs, no graph)."""
    st = split(Noisy(), [4])[0]
    keep, rec = (StageReplica(st, sgd, recompute=r) for r in (False, True))
    x = torch.randn(4, 4)
    torch.manual_seed(5)
    outs_keep, _ = keep.forward(0, None, [x])
    torch.manual_seed(5)
    outs_rec, _ = rec.forward(0, None, [x])
    torch.manual_seed(6)  # the recomputation must not depend on the generator's state now
    assert keep._flight[0].outputs is not None and rec._flight[0].outputs is None
    assert all(not o.requires_grad or o.grad_fn is None for o in outs_rec)
    g = [torch.ones_like(o) for o in outs_keep]
    for a, b in zip(keep.backward(0, g), rec.backward(0, g)):
        assert (a is None and b is None) or torch.equal(a, b)
    for n in keep.grad_sums:
        assert torch.equal(keep.grad_sums[n], rec.grad_sums[n]), n


def test_bad_recompute_is_refused() -> None:
    with pytest.raises(RuntimeConfigError, match="recompute"):
        Trainer(split(tiny_mlp(), [2]), [1, 1], loss_fn, sgd, executor="reference",
                recompute=[True])
