"""Any DataLoader through the Trainer: a variable last batch, dict batches of keyword inputs
(a Hugging Face collator's), and reading ahead in a thread with bounded memory (prefetch=N).
Oracles: plain torch loops over the same batches."""
from __future__ import annotations

import copy
import functools
import time
from typing import Any, Iterator

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from rt_helpers import loss_fn, split, tiny_mlp
from torch.utils.data import DataLoader, TensorDataset

from fxpipe.codegen.split import placed_nodes, split_graph
from fxpipe.runtime.errors import RuntimeConfigError
from fxpipe.runtime.training.prefetch import Prefetcher
from fxpipe.runtime.training.trainer import Trainer

TIGHT = dict(rtol=1e-6, atol=1e-7)
sgd = functools.partial(torch.optim.SGD, lr=0.1)


def _dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(4)
    return TensorDataset(torch.randn(10, 4, generator=g), torch.randn(10, 2, generator=g))


@pytest.mark.parametrize("prefetch", [0, 2])
def test_dataloader_with_a_short_last_batch_trains_as_eager(prefetch: int) -> None:
    """10 samples in batches of 4: 4, 4, 2; one update per minibatch (1f1b-flush, m=1)."""
    loader = DataLoader(_dataset(), batch_size=4)
    model = tiny_mlp()
    trainer = Trainer(split(copy.deepcopy(model), [2]), [1, 1], loss_fn, sgd,
                      schedule="1f1b-flush", microbatches=1, executor="reference",
                      progress=False, prefetch=prefetch)
    hist = trainer.fit(loader, epochs=2)
    assert hist[0]["samples"] == 10
    opt = sgd(model.parameters())
    for _ in range(2):
        for x, y in loader:
            opt.zero_grad()
            loss_fn(model(x), y).backward()
            opt.step()
    got = trainer.state_dict()
    for n, p in model.named_parameters():
        torch.testing.assert_close(got[n], p.detach(), **TIGHT, msg=n)


@pytest.mark.slow
def test_prefetch_keeps_a_shuffling_loader_deterministic() -> None:
    """shuffle=True draws the epoch's order from the seeded global RNG on the first item, which
    the prefetcher fetches in the caller's thread: the same batches as without prefetching."""
    loader = DataLoader(_dataset(), batch_size=4, shuffle=True)
    states = []
    for prefetch in (0, 3):
        trainer = Trainer(split(tiny_mlp(), [2]), [1, 1], loss_fn, sgd, executor="reference",
                          progress=False, prefetch=prefetch)
        trainer.fit(loader, epochs=3)
        states.append(trainer.state_dict())
    for n in states[0]:
        assert torch.equal(states[0][n], states[1][n]), n


def test_prefetcher_reads_ahead_a_bounded_number_of_items() -> None:
    pulled = []

    def source() -> Iterator[int]:
        for i in range(100):
            pulled.append(i)
            yield i

    pre = Prefetcher(source(), 3)
    assert next(pre) == 0
    for _ in range(500):  # wait until the thread is blocked on the full queue
        if len(pulled) >= 5:
            break
        time.sleep(0.01)
    time.sleep(0.05)
    assert len(pulled) == 5  # the first, 3 queued, 1 waiting to be queued: no more
    assert list(pre) == list(range(1, 100))
    pre.close()


def test_prefetcher_raises_the_loaders_error_and_stops_cleanly() -> None:
    def broken() -> Iterator[int]:
        yield 1
        yield 2
        raise KeyError("bad sample 7")

    pre = Prefetcher(broken(), 2)
    assert [next(pre), next(pre)] == [1, 2]
    with pytest.raises(KeyError, match="bad sample 7"):
        next(pre)
    left = Prefetcher(iter(range(1000)), 2)  # abandoned early: close() ends the thread
    next(left)
    thread = left._thread
    assert thread is not None and thread.is_alive()
    left.close()
    assert not thread.is_alive()
    with pytest.raises(RuntimeConfigError, match="prefetch"):
        Trainer(split(tiny_mlp(), [2]), [1, 1], loss_fn, sgd, executor="reference", prefetch=-1)


class KwModel(nn.Module):
    """A Hugging Face-like model: keyword inputs, the loss computed inside, a dict out."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 2)

    def forward(self, features: torch.Tensor, scale: torch.Tensor,
                labels: torch.Tensor) -> dict[str, Any]:
        logits = self.b(torch.tanh(self.a(features))) * scale[:, None]
        return {"loss": F.mse_loss(logits, labels), "logits": logits}


def test_dict_batches_of_keyword_inputs_train_as_eager() -> None:
    g = torch.Generator().manual_seed(2)
    rows = [{"features": torch.randn(4, generator=g), "scale": torch.rand((), generator=g),
             "labels": torch.randn(2, generator=g)} for _ in range(12)]
    loader = DataLoader(rows, batch_size=4)  # default collate: a dict of stacked tensors
    model = KwModel()
    gm = fx.symbolic_trace(copy.deepcopy(model))
    nodes = placed_nodes(gm)
    stages = split_graph(gm, {n.name: int(i > 4) for i, n in enumerate(nodes)})
    assert len(stages) == 2
    trainer = Trainer(stages, [1, 1], lambda out, _: out["loss"], sgd, schedule="1f1b-flush",
                      microbatches=1, executor="reference", progress=False)
    trainer.fit(loader, epochs=2)
    opt = sgd(model.parameters())
    for _ in range(2):
        for batch in loader:
            opt.zero_grad()
            model(**batch)["loss"].backward()
            opt.step()
    got = trainer.state_dict()
    for n, p in model.named_parameters():
        torch.testing.assert_close(got[n], p.detach(), **TIGHT, msg=n)
