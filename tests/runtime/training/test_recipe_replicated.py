"""The default trains plain PyTorch's recipe on replicated plans too (reference executor).

Plans ``[2]`` (plain data parallelism), ``[2, 1]`` and ``[1, 2]``, forced with ``plan_for`` and
trained by ``compiled.trainer(...)`` with nothing named (``schedule="auto"``): each loader
minibatch is cut into one share per replica and their gradients are summed by their shares,
one update per minibatch. The oracle is plain PyTorch written here: the same initial weights,
one optimizer step per loader minibatch on the whole minibatch, no fxpipe code. Losses: a
per-sample mean, a sum, a token mean with -100 padding, and a class-weighted cross entropy
(a weighted mean whose weights the target decides). Minibatches of 7 samples and a short last
one of 3, so the shares are uneven.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxpipe
from fxpipe.passes.partition import plan_for

CLASS_WEIGHT = torch.tensor([1.0, 3.0, 0.25])


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                         nn.Linear(16, 3))


def data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(31, 4, generator=g), torch.randint(0, 3, (31,), generator=g)
    y[3], y[11] = -100, -100  # two padded samples: a token mean counts 29 labels, a mean 31
    return [(x[i:i + 7], y[i:i + 7]) for i in range(0, 31, 7)]  # 7, 7, 7, 7, 3


LOSSES: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "mean": lambda o, t: F.mse_loss(o, F.one_hot(t.clamp(min=0), 3).float()),
    "sum": lambda o, t: F.cross_entropy(o, t, reduction="sum"),
    "token-mean": lambda o, t: F.cross_entropy(o, t),  # ignores -100: a mean over valid labels
    "class-weighted": lambda o, t: F.cross_entropy(o, t, weight=CLASS_WEIGHT),
}
RULES = {"mean": "mean", "sum": "sum", "token-mean": "token", "class-weighted": "weighted"}
PLANS = {"[2]": ([0], [2]), "[2, 1]": ([0, 3], [2, 1]), "[1, 2]": ([0, 3], [1, 2])}


def sgd(ps: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(ps, lr=0.05, momentum=0.9)


def plain(loss: Callable[..., torch.Tensor]) -> dict[str, torch.Tensor]:
    """The oracle: one step per minibatch on the whole minibatch."""
    model, loader = mlp(), data()
    opt = sgd(model.parameters())
    for x, y in loader:
        opt.zero_grad()
        loss(model(x), y).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def compiled_for(starts: list[int], replicas: list[int], loss: Any) -> Any:
    """``mlp`` compiled onto exactly this plan (costs measured, overheads off: fast)."""
    example = (data()[0][0],)
    cluster = fxpipe.Cluster(workers=sum(replicas))
    first = fxpipe.compile(mlp(), cluster, example_inputs=example, loss_fn=loss, repeats=1,
                           overheads="off")
    plan = replace(plan_for(first.profile, first.cluster, starts, replicas),
                   model_fingerprint=first.plan.model_fingerprint)
    return fxpipe.compile(mlp(), cluster, example_inputs=example, loss_fn=loss, repeats=1,
                          overheads="off", plan=plan)


@pytest.mark.slow
@pytest.mark.parametrize("loss_name", list(LOSSES))
@pytest.mark.parametrize("plan_name", list(PLANS))
def test_default_equals_plain_pytorch_on_replicated_plans(plan_name: str, loss_name: str) -> None:
    starts, replicas = PLANS[plan_name]
    compiled = compiled_for(starts, replicas, LOSSES[loss_name])
    assert compiled.plan.replicas == replicas
    trainer = compiled.trainer(optimizer=sgd, executor="reference", progress=False)
    trainer.fit(data())
    got, want = trainer.state_dict(), plain(LOSSES[loss_name])
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-5, msg=k)
    assert trainer.loss_rule.kind == RULES[loss_name]
    assert trainer.split == sum(replicas)  # one microbatch per worker of each minibatch
    recipe = compiled.recipe
    assert recipe.startswith("schedule: 1f1b-flush, chosen by auto")
    assert f"cut: each minibatch into {sum(replicas)} microbatches (7 samples -> " in recipe
    assert "replicas take the microbatches in turn (stage " in recipe
    assert "update: one per minibatch on every stage" in recipe


@pytest.mark.slow
def test_data_parallelism_is_said_in_plain_words() -> None:
    """On one stage replicated, auto names data parallelism and the cut, not pipedream."""
    compiled = compiled_for([0], [2], LOSSES["mean"])
    trainer = compiled.trainer(optimizer=sgd, executor="reference", progress=False)
    trainer.fit(data())
    assert trainer.auto_decision.schedule == "1f1b-flush"
    assert "one stage on 2 workers (data parallelism)" in trainer.auto_decision.reason
    assert "stage 0: 2 replicas" in compiled.recipe


def test_pipedream_named_on_a_replicated_stage_says_what_it_trains_instead() -> None:
    """Naming pipedream keeps PipeDream's recipe (each replica a whole minibatch in turn), and
    the recipe says it is not plain PyTorch's step per minibatch."""
    compiled = compiled_for([0, 3], [2, 1], LOSSES["mean"])
    trainer = compiled.trainer(optimizer=sgd, executor="reference", progress=False,
                               schedule="pipedream")
    trainer.fit(data())
    assert "no cut: each minibatch trains whole on one replica of each stage" in compiled.recipe
    assert "fewer updates than plain PyTorch's step per minibatch" in compiled.recipe
