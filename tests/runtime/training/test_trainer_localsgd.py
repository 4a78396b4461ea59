"""``Trainer(schedule="localsgd")`` in one process against plain PyTorch, and the configurations
it refuses before any step.

The oracle is LocalSGD written here from its definition: R copies of the model, copy j trains
with momentum SGD on minibatches j, j + R, ... of each epoch (one step per minibatch), and the
copies' weights are replaced by their mean after every H-th round and at the end of the epoch;
each copy keeps its momentum."""
from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from rt_helpers import batches, split, tiny_mlp

from fxpipe.runtime.errors import RuntimeConfigError
from fxpipe.runtime.training.trainer import Trainer

LR, MOM = 0.05, 0.9
momentum = functools.partial(torch.optim.SGD, lr=LR, momentum=MOM)


def local_sgd(model: nn.Module, data: list, R: int, H: int, epochs: int
              ) -> tuple[list[float], dict[str, torch.Tensor]]:
    copies = [copy.deepcopy(model) for _ in range(R)]
    opts = [torch.optim.SGD(c.parameters(), lr=LR, momentum=MOM) for c in copies]
    means = []
    rounds = -(-len(data) // R)
    for _ in range(epochs):
        losses = []
        for i in range(rounds):
            for j, (c, o) in enumerate(zip(copies, opts)):
                if i * R + j < len(data):
                    x, y = data[i * R + j]
                    o.zero_grad()
                    loss = F.mse_loss(c(x), y)
                    loss.backward()
                    o.step()
                    losses.append(float(loss.detach()))
            if (i + 1) % H == 0 or i == rounds - 1:
                with torch.no_grad():
                    for ps in zip(*(c.parameters() for c in copies)):
                        mean = torch.stack(ps).mean(0)
                        for p in ps:
                            p.copy_(mean)
        means.append(sum(losses) / len(losses))
    return means, {n: p.detach() for n, p in copies[0].named_parameters()}


@pytest.mark.parametrize("R,H,n", [(2, 2, 10), (3, 1, 7), (2, 3, 12)])
def test_localsgd_trainer_is_r_copies_averaged_every_h_rounds(R: int, H: int, n: int) -> None:
    model, data = tiny_mlp(), batches(n)
    trainer = Trainer(split(model, [1, 3]), [R] * 3, F.mse_loss, momentum, schedule="localsgd",
                      average_every=H, executor="reference", progress=False)
    history = trainer.fit(data, epochs=2)
    want_losses, want = local_sgd(tiny_mlp(), data, R, H, 2)
    assert [h["loss"] for h in history] == pytest.approx(want_losses, rel=1e-6)
    for name, p in model.named_parameters():  # written back into the user's Parameters
        torch.testing.assert_close(p.detach(), want[name], rtol=1e-6, atol=1e-7)


def test_segments_are_whole_rounds_of_h_updates() -> None:
    """An average only where the definition puts one: segments (and checkpoints) hold whole
    multiples of R x H minibatches; a segment that is not one is refused."""
    trainer = Trainer(split(tiny_mlp(), [2]), [2, 2], F.mse_loss, momentum,
                      schedule="localsgd", average_every=3, executor="reference",
                      progress=False)
    assert trainer.segment % 6 == 0 and trainer._first % 6 == 0
    with pytest.raises(RuntimeConfigError, match="segment=4 with schedule 'localsgd'"):
        Trainer(split(tiny_mlp(), [2]), [2, 2], F.mse_loss, momentum, schedule="localsgd",
                average_every=3, segment=4, executor="reference", progress=False)


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        return self.b(torch.nn.functional.linear(h, self.a.weight))


@pytest.mark.parametrize("kw,match", [
    (dict(replicas=[2, 1]), r"(?s)replicas \[2, 1\].*same number R >= 2"),
    (dict(replicas=[1, 1]), r"replicas \[1, 1\]"),
    (dict(average_every=0), r"average_every=0"),
    (dict(clip_grad_norm=1.0), r"clip_grad_norm with schedule 'localsgd'"),
    (dict(microbatches=2), r"microbatches=2.*localsgd"),
    (dict(schedule="pipedream", average_every=2), r"average_every=2 with schedule 'pipedream'"),
])
def test_localsgd_refuses_what_it_cannot_train(kw: dict, match: str) -> None:
    options = {"schedule": "localsgd", "executor": "reference", "progress": False, **kw}
    replicas = options.pop("replicas", [2, 2])
    with pytest.raises(RuntimeConfigError, match=match):
        Trainer(split(tiny_mlp(), [2]), replicas, F.mse_loss, momentum, **options)


def test_localsgd_refuses_tied_weights_before_any_step() -> None:
    from fxpipe.codegen.split import placed_nodes, split_graph
    import torch.fx as fx

    gm = fx.symbolic_trace(Tied())
    nodes = placed_nodes(gm)
    stages = split_graph(gm, {nd.name: int(i > 2) for i, nd in enumerate(nodes)})
    if len(stages) < 2 or not any(len(s.gm.graph.nodes) for s in stages):
        pytest.skip("the tied model did not split")
    with pytest.raises(RuntimeConfigError, match="LocalSGD with parameter .* tied"):
        Trainer(stages, [2] * len(stages), F.mse_loss, momentum, schedule="localsgd",
                executor="reference", progress=False)


def test_a_compiled_plan_trains_as_many_copies_as_its_workers_hold() -> None:
    from fxpipe.runtime.training.trainer_schedule import local_sgd_replicas

    assert local_sgd_replicas(2, 4) == [2, 2]
    assert local_sgd_replicas(3, 8) == [2, 2, 2]  # two workers idle
    with pytest.raises(RuntimeConfigError, match=r"(?s)2 stages for 3 workers.*compile for 4"):
        local_sgd_replicas(2, 3)


def test_the_recipe_says_what_localsgd_trains() -> None:
    trainer = Trainer(split(tiny_mlp(), [2]), [3, 3], F.mse_loss, momentum, schedule="localsgd",
                      average_every=5, executor="reference", progress=False)
    text = trainer.recipe()
    assert "schedule: localsgd" in text
    assert "3 copies of the pipeline" in text and "after every 5 of their updates" in text
    assert "gradient accumulation" not in text
    assert "not for these 3 copies on 6 workers" in text
