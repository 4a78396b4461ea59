"""Each mistake a newcomer makes ends in an fxpipe error that names it, before any optimizer
step (not a loss-splitting problem, a raw torch error, or a failure at the first checkpoint).

The model is a plain MLP compiled onto 2 stages and trained with the DEFAULT trainer on the
reference executor (the same checks run on every rank of a torchrun job: the ranks that
compute the loss test the loader's first minibatch and share the verdict). An optimizer that
counts its steps proves none was taken."""
from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxpipe
from fxpipe.errors import InputMismatchError
from fxpipe.runtime.errors import LossFunctionError, RuntimeConfigError
from fxpipe.runtime.training.checkpoint import CheckpointError

STEPS: list[int] = []


class CountingSGD(torch.optim.SGD):
    def step(self, closure: Any = None) -> Any:  # noqa: D102
        STEPS.append(1)
        return super().step(closure)


def counting(ps: Any) -> torch.optim.Optimizer:
    return CountingSGD(ps, lr=0.1)


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 3))


def loader(features: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, features, generator=g), torch.randint(0, 3, (8,), generator=g))
            for _ in range(3)]


def fit(loss: Any = F.cross_entropy, data: Any = None, model: nn.Module | None = None,
        example: Any = None, **kw: Any) -> Any:
    STEPS.clear()
    compiled = fxpipe.compile(model or mlp(), fxpipe.Cluster(workers=2),
                              example_inputs=example or (loader()[0][0],), loss_fn=loss,
                              stages=2, straight=True, repeats=1, overheads="off")
    kw.setdefault("optimizer", counting)
    trainer = compiled.trainer(executor="reference", progress=False, **kw)
    return trainer.fit(data or loader())


@pytest.mark.slow
@pytest.mark.parametrize("loss, needle", [
    (nn.CrossEntropyLoss, "loss_fn=nn.CrossEntropyLoss is a class, not a loss"),
    (lambda out: out.sum(), "loss_fn <lambda> raised TypeError on the first minibatch: "
                            "<lambda>() takes 1 positional argument but 2 were given"),
    (lambda target, output: F.cross_entropy(output, target),
     "loss_fn <lambda> raised NotImplementedError on the first minibatch"),
    (nn.CrossEntropyLoss(reduction="none"),
     "loss_fn CrossEntropyLoss() returned a tensor of shape (8,), not one number"),
])
def test_a_wrong_loss_is_named_as_the_loss(loss: Any, needle: str) -> None:
    with pytest.raises(LossFunctionError) as err:
        fit(loss)
    assert needle in str(err.value)
    assert "combination of its parts" not in str(err.value)  # not a loss-splitting problem
    assert STEPS == []
    if not isinstance(loss, type):
        assert ("fxpipe calls loss_fn(output, target) with the model's output (tensor (8, 3) "
                "float32) and the loader's target (tensor (8,) int64)") in str(err.value)


def test_a_loss_class_is_refused_by_compile_before_tracing() -> None:
    with pytest.raises(LossFunctionError, match="pass an instance, loss_fn=CrossEntropyLoss()"):
        fxpipe.compile(mlp(), 2, example_inputs=(loader()[0][0],), loss_fn=nn.CrossEntropyLoss)


@pytest.mark.slow
def test_a_loader_of_three_items_says_how_two_inputs_are_passed() -> None:
    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 3)

        def forward(self, tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            return self.b(torch.tanh(self.a(tokens * mask)))

    data = [(x, torch.ones_like(x), y) for x, y in loader()]
    with pytest.raises(RuntimeConfigError) as err:
        fit(data=data, model=Two(), example=(data[0][0], data[0][1]))
    msg = str(err.value)
    assert "the loader yielded 3 items per minibatch (tuple of 3 (tensor (8, 4) float32" in msg
    assert "fxpipe takes each minibatch as a pair (inputs, target)" in msg
    assert ("the model takes 2 inputs (tokens, mask): yield them as one tuple, then the target: "
            "((tokens, mask), target)") in msg
    assert STEPS == []


@pytest.mark.slow
def test_inputs_unlike_the_example_name_the_input_and_dimension() -> None:
    with pytest.raises(InputMismatchError) as err:
        fit(data=loader(features=5))
    msg = str(err.value)
    assert msg.startswith("the model fails on the loader's first minibatch (RuntimeError: mat1 "
                          "and mat2 shapes cannot be multiplied")
    assert "input 'input' is (8, 5) where the example was (8, 4): dimension 1 (5 vs 4) differs" \
        in msg
    assert STEPS == []


def test_a_checkpoint_dir_that_is_a_file_is_refused_when_the_trainer_is_made(
        tmp_path: Path) -> None:
    f = tmp_path / "ckpt"
    f.write_text("not a folder")
    with pytest.raises(CheckpointError, match="checkpoint_dir=.* is a file, not a directory"):
        fit(checkpoint_dir=str(f))
    with pytest.raises(CheckpointError, match="cannot be made: .* is a file"):
        fit(checkpoint_dir=str(f / "sub"))
    assert STEPS == [] and f.read_text() == "not a folder"


@pytest.mark.slow
def test_an_optimizer_instance_is_taken_as_its_class_and_options(
        caplog: pytest.LogCaptureFixture) -> None:
    """``optimizer=SGD(model.parameters(), ...)``: every stage gets an SGD with its options, so
    training equals the factory's, and a warning says the instance itself is not stepped; an
    instance with groups of different options is refused, naming the factory it needs."""
    ref = fit(optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9))
    other = mlp()
    with caplog.at_level("WARNING"):
        got = fit(optimizer=torch.optim.SGD(other.parameters(), lr=0.1, momentum=0.9))
    assert got[-1]["loss"] == ref[-1]["loss"]
    assert "optimizer=SGD instance: each stage gets its own SGD(lr=0.1, momentum=0.9" in \
        caplog.text and "the instance itself is not stepped" in caplog.text
    groups = torch.optim.SGD([{"params": list(other[0].parameters()), "lr": 0.1},
                              {"params": list(other[2].parameters()), "lr": 0.01}], lr=0.1)
    with pytest.raises(RuntimeConfigError, match="2 parameter groups of different options") as e:
        fit(optimizer=groups)
    assert "optimizer=lambda params: torch.optim.SGD(params" in str(e.value)
    with pytest.raises(RuntimeConfigError, match="is not an optimizer factory"):
        fit(optimizer="sgd")


@pytest.mark.slow
def test_a_second_run_into_a_run_s_checkpoints_is_refused_unless_it_resumes_or_overwrites(
        tmp_path: Path) -> None:
    d = str(tmp_path / "ckpt")
    fit(checkpoint_dir=d, checkpoint_every=1)
    first = sorted(p.name for p in Path(d).iterdir())  # 4 made, the newest 3 kept
    assert first == ["e0000-m0000002", "e0000-m0000003", "e0001-m0000000"]
    with pytest.raises(CheckpointError, match="holds another run's checkpoints") as err:
        fit(checkpoint_dir=d)
    assert "fit(..., resume=True)" in str(err.value) and STEPS == []
    assert sorted(p.name for p in Path(d).iterdir()) == first  # nothing overwritten
    fit(checkpoint_dir=d, overwrite_checkpoints=True, checkpoint_every=2)
    assert sorted(p.name for p in Path(d).iterdir()) == ["e0000-m0000002", "e0001-m0000000"]


@pytest.mark.slow
def test_resuming_a_finished_run_says_there_is_nothing_left(tmp_path: Path,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    d = str(tmp_path / "ckpt")
    first = fit(checkpoint_dir=d)
    STEPS.clear()
    compiled = fxpipe.compile(mlp(), fxpipe.Cluster(workers=2), example_inputs=(loader()[0][0],),
                              loss_fn=F.cross_entropy, stages=2, straight=True, repeats=1,
                              overheads="off")
    trainer = compiled.trainer(optimizer=counting, executor="reference", progress=False,
                               checkpoint_dir=d)
    with caplog.at_level("WARNING"):
        again = trainer.fit(loader(), resume=True)
    assert again == first and STEPS == []
    assert ("nothing left to train: the checkpoint resumed is at the end of epoch 1, and fit "
            "was asked for 1 epoch(s) in all") in caplog.text


@pytest.mark.slow
def test_the_newest_checkpoints_are_kept(tmp_path: Path) -> None:
    d = tmp_path / "ckpt"
    data = loader() * 3  # 9 minibatches a checkpoint each, and one at the epoch's end
    fit(checkpoint_dir=str(d), checkpoint_every=1, data=data)
    assert sorted(p.name for p in d.iterdir()) == ["e0000-m0000008", "e0000-m0000009",
                                                   "e0001-m0000000"]  # 10 made
    every = tmp_path / "all"
    fit(checkpoint_dir=str(every), checkpoint_every=1, data=data, keep_checkpoints=None)
    assert len(list(every.iterdir())) == 10
    with pytest.raises(RuntimeConfigError, match="keep_checkpoints=0"):
        fit(checkpoint_dir=str(tmp_path / "x"), keep_checkpoints=0)


@pytest.mark.slow
def test_eval_loss_is_the_mean_over_samples() -> None:
    """A short last minibatch weighs by its samples: the mean of per-sample losses of the same
    weights (plain PyTorch, written here), not the mean of the minibatches' means."""
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(21, 4, generator=g), torch.randint(0, 3, (21,), generator=g)
    evals = [(x[i:i + 8], y[i:i + 8]) for i in range(0, 21, 8)]  # 8, 8, 5
    compiled = fxpipe.compile(mlp(), fxpipe.Cluster(workers=2), example_inputs=(x[:8],),
                              loss_fn=F.cross_entropy, stages=2, straight=True, repeats=1,
                              overheads="off")
    trainer = compiled.trainer(optimizer=counting, executor="reference", progress=False)
    history = trainer.fit(loader(), eval_loader=evals)
    model = copy.deepcopy(mlp())
    model.load_state_dict(trainer.state_dict())
    with torch.no_grad():
        per_sample = F.cross_entropy(model(x), y, reduction="none").mean().item()
        per_batch = sum(F.cross_entropy(model(a), b).item() for a, b in evals) / 3
    assert history[-1]["eval_loss"] == pytest.approx(per_sample, rel=1e-6)
    assert abs(per_sample - per_batch) > 1e-4  # the two differ on this data
