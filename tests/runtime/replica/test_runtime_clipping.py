"""Gradient clipping by norm (Trainer(clip_grad_norm=...)), one process (executor="reference").

The oracle is plain torch written out here: ``torch.nn.utils.clip_grad_norm_`` on the unsplit
model after the batch's mean gradient (what 1f1b-flush computes), and, for the per-stage scope
of pipedream, the formula of the docstring written by hand."""
from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.nn as nn
from rt_helpers import batches, loss_fn, split, tiny_mlp

from fxpipe.runtime.errors import RuntimeConfigError
from fxpipe.runtime.training.trainer import Trainer

TIGHT = dict(rtol=1e-6, atol=1e-7)
sgd = functools.partial(torch.optim.SGD, lr=0.5, momentum=0.9)


def big_batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Targets far from the outputs: gradient norms well above the clipping threshold."""
    return [(x, 10 * y) for x, y in batches(n)]


def eager(model: nn.Module, data: list, m: int, max_norm: float, epochs: int = 1) -> None:
    """One step per batch of m minibatches (their mean loss), clipped by the global norm."""
    opt = sgd(model.parameters())
    for _ in range(epochs):
        for b in range(0, len(data), m):
            opt.zero_grad()
            loss = sum(loss_fn(model(x), y) for x, y in data[b:b + m]) / m
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            opt.step()


@pytest.mark.parametrize("schedule,cuts,replicas", [
    ("1f1b-flush", [2], [1, 1]), ("1f1b-flush", [1, 3], [1, 2, 1]), ("gpipe", [2], [2, 1]),
    ("1f1b-flush", [], [1]), ("zb-h1", [1, 3], [1, 2, 1]), ("zb-h2", [2], [1, 1])])
def test_global_norm_equals_clip_grad_norm_on_the_whole_model(schedule: str, cuts: list[int],
                                                               replicas: list[int]) -> None:
    data, m = big_batches(12), 4
    model = tiny_mlp()
    trainer = Trainer(split(copy.deepcopy(model), cuts), replicas, loss_fn, sgd,
                      schedule=schedule, microbatches=m, executor="reference", progress=False,
                      clip_grad_norm=0.3)
    trainer.fit(data, epochs=2)
    eager(model, data, m, 0.3, epochs=2)
    got = trainer.state_dict()
    for name, p in model.named_parameters():
        torch.testing.assert_close(got[name], p.detach(), **TIGHT, msg=name)


def test_clipping_changes_the_result_when_the_norm_is_above_the_threshold() -> None:
    """The test above must be able to fail: without clipping the same run is far away."""
    data, m = big_batches(8), 4
    model = tiny_mlp()
    trainer = Trainer(split(copy.deepcopy(model), [2]), [1, 1], loss_fn, sgd,
                      schedule="1f1b-flush", microbatches=m, executor="reference",
                      progress=False)
    trainer.fit(data, epochs=1)
    eager(model, data, m, 0.3)
    got = trainer.state_dict()
    assert max(float((got[n] - p.detach()).abs().max()) for n, p in model.named_parameters()
               ) > 1e-3


def test_pipedream_clips_each_stage_by_its_own_norm() -> None:
    """Per-stage scope, written out by hand on one update of a 2-stage pipeline with NOAM 1
    (replicas [1, 1], 1 minibatch: pipedream is plain SGD): stage s's gradient is scaled by
    min(1, max_norm / (||g_s|| + 1e-6)), with ||g_s|| over the stage's parameters only."""
    (x, y), = big_batches(1)
    model = tiny_mlp()
    trainer = Trainer(split(copy.deepcopy(model), [2]), [1, 1], loss_fn,
                      functools.partial(torch.optim.SGD, lr=0.5), schedule="pipedream",
                      executor="reference", progress=False, clip_grad_norm=0.2)
    trainer.fit([(x, y)], epochs=1)
    loss_fn(model(x), y).backward()
    stage_of = {"0": 0, "2": 1, "4": 1}  # cut after node 2: Linear 0, Tanh 1 | Linear 2 ...
    norms = {}
    for s in (0, 1):
        gs = [p.grad for n, p in model.named_parameters() if stage_of[n.split(".")[0]] == s]
        norms[s] = torch.sqrt(sum((g * g).sum() for g in gs))
    got = trainer.state_dict()
    for n, p in model.named_parameters():
        s = stage_of[n.split(".")[0]]
        coef = min(1.0, 0.2 / (float(norms[s]) + 1e-6))
        torch.testing.assert_close(got[n], p.detach() - 0.5 * coef * p.grad, **TIGHT, msg=n)
    assert all(float(v) > 0.2 for v in norms.values())  # both stages really clipped


@pytest.mark.parametrize("bad", [0, -1.0, float("inf"), "1", True])
def test_bad_clip_values_are_refused(bad: object) -> None:
    with pytest.raises(RuntimeConfigError, match="clip_grad_norm"):
        Trainer(split(tiny_mlp(), [2]), [1, 1], loss_fn, sgd, executor="reference",
                clip_grad_norm=bad)  # type: ignore[arg-type]


def test_tied_weight_counted_once_in_the_global_norm() -> None:
    """GPT-style tied embedding on stages 0 and 2: the norm counts it once (as
    clip_grad_norm_ over model.parameters(), which lists it once)."""
    from rt_tied import TiedLM, ce, token_batches

    data, m = token_batches(8), 4
    model = TiedLM()
    trainer = Trainer(split(copy.deepcopy(model), [1, 3]), [1, 1, 1], ce, sgd,
                      schedule="1f1b-flush", microbatches=m, executor="reference",
                      progress=False, clip_grad_norm=0.05)
    trainer.fit(data, epochs=1)
    opt = sgd(model.parameters())
    for b in range(0, len(data), m):
        opt.zero_grad()
        (sum(ce(model(x), y) for x, y in data[b:b + m]) / m).backward()
        assert float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)) > 0.05
        opt.step()
    got = trainer.state_dict()
    for name, p in model.named_parameters():
        torch.testing.assert_close(got[name], p.detach(), **TIGHT, msg=name)
