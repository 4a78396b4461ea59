"""Trainer(schedule="zb-v" | "interleaved-1f1b" | "dualpipev") on the reference executor: the
placed kinds' per-stage lists train exactly like minibatch SGD (plain torch written out here, momentum and an
LR schedule included); what the Trainer does not run is refused with what to do."""
from __future__ import annotations

import copy
import functools

import pytest
import torch
from rt_helpers import SkipMLP, batches, loss_fn, split, tiny_mlp

from fxpipe.runtime.errors import RuntimeConfigError
from fxpipe.runtime.training.trainer import Trainer

TIGHT = dict(rtol=1e-6, atol=1e-7)
momentum = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)


def plain(model: torch.nn.Module, data, m: int, epochs: int) -> dict[str, torch.Tensor]:
    opt = momentum(model.parameters())
    for _ in range(epochs):
        for b in range(0, len(data), m):
            xs, ys = zip(*data[b:b + m])
            opt.zero_grad()
            loss_fn(model(torch.cat(xs)), torch.cat(ys)).backward()
            opt.step()
    return {n: p.detach() for n, p in model.named_parameters()}


@pytest.mark.parametrize("make, cuts, replicas, kind", [
    (tiny_mlp, [1, 2, 3], [1, 1, 1, 1], "zb-v"),
    (tiny_mlp, [1, 2, 3], [1, 1, 1, 1], "interleaved-1f1b"),
    (SkipMLP, [2, 4], [1, 1, 1], "interleaved-1f1b"),
    (tiny_mlp, [1, 2, 3], [2, 2, 2, 2], "zb-v"),
    (tiny_mlp, [1, 2, 3], [1, 1, 1, 1], "dualpipev"),
])
def test_trainer_with_a_placed_kind_equals_minibatch_sgd(make, cuts, replicas, kind) -> None:
    data = batches(16)
    model = make()
    trainer = Trainer(split(copy.deepcopy(model), cuts), replicas, loss_fn, momentum,
                      schedule=kind, microbatches=4, executor="reference", progress=False)
    trainer.fit(data, epochs=2)
    got = trainer.state_dict()
    for name, p in plain(model, data, 4, 2).items():
        torch.testing.assert_close(got[name], p, **TIGHT, msg=name)
    sched = trainer._schedule(16)
    assert sched.kind == kind and any(a.kind == "W" for a in sched.actions[(0, 0)]) == \
        (kind in ("zb-v", "dualpipev"))


def test_trainer_refuses_what_it_does_not_run() -> None:
    stages = split(tiny_mlp(), [1, 2, 3])
    with pytest.raises(RuntimeConfigError) as info:
        Trainer(stages, [1, 1, 1, 1], loss_fn, momentum, schedule="zb-v")
    assert info.value.message == "schedule 'zb-v' with executor='distributed'"
    assert "run_placed" in (info.value.hint or "")
    with pytest.raises(RuntimeConfigError, match="replicate the whole pipeline"):
        Trainer(stages, [2, 1, 1, 1], loss_fn, momentum, schedule="interleaved-1f1b",
                executor="reference", progress=False).fit(batches(10), epochs=1)
