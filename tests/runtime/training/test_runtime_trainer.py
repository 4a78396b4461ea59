"""The Trainer in one process (executor="reference"): semantics, resume, bad configurations."""
from __future__ import annotations

import copy
import functools
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from rt_helpers import batches, loss_fn, plain_sgd, sgd, split, tiny_mlp
from trainer_job import dataset, stages

from fxpipe.runtime.training.checkpoint import CheckpointError, find_latest
from fxpipe.runtime.errors import RuntimeConfigError
from fxpipe.runtime.training.trainer import Trainer, make_trainer

momentum = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)


def _warmup(step: int) -> float:
    return min(1.0, (step + 1) / 4)


# stepped after every update (the default): resuming must restore it exactly
step_lr = functools.partial(torch.optim.lr_scheduler.LambdaLR, lr_lambda=_warmup)


class Crash(Exception):
    pass


def _trainer(ckpt: Path | None, schedule: str = "pipedream", **kw) -> Trainer:
    return Trainer(stages(), [1, 1], F.mse_loss, momentum, lr_scheduler=step_lr,
                   schedule=schedule, checkpoint_dir=str(ckpt) if ckpt else None,
                   checkpoint_every=2 if ckpt else None, segment=2, executor="reference",
                   progress=False, **kw)


def _crash_after(n: int):
    seen: list[tuple[int, int]] = []

    def hook(epoch: int, pos: int) -> None:
        seen.append((epoch, pos))
        if len(seen) == n:
            raise Crash(f"simulated crash after checkpoint {seen[-1]}")
    return hook


def test_one_stage_is_plain_sgd_and_updates_the_model() -> None:
    data = batches(6)
    model = tiny_mlp()
    trainer = Trainer(split(model, []), [1], loss_fn, sgd, executor="reference", progress=False)
    history = trainer.fit(data, epochs=1)
    losses, expected = plain_sgd(tiny_mlp(), data)
    assert history[0]["loss"] == pytest.approx(sum(losses) / len(losses), rel=1e-6)
    for name, p in model.named_parameters():  # written back into the user's Parameters
        torch.testing.assert_close(p.detach(), expected[name], rtol=1e-6, atol=1e-7)
    assert set(trainer.state_dict()) == {n for n, _ in model.named_parameters()}


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["pipedream", "1f1b-flush", "2bw"])
@pytest.mark.parametrize("crash_after", [2, 4])
def test_resume_reaches_exactly_the_uninterrupted_parameters(tmp_path: Path, schedule: str,
                                                             crash_after: int) -> None:
    full = _trainer(tmp_path / "full", schedule)
    full_history = full.fit(dataset(), epochs=2, eval_loader=dataset())
    crashed = _trainer(tmp_path / "run", schedule, on_checkpoint=_crash_after(crash_after))
    with pytest.raises(Crash):
        crashed.fit(dataset(), epochs=2, eval_loader=dataset())
    resumed = _trainer(tmp_path / "run", schedule)
    history = resumed.fit(dataset(), epochs=2, eval_loader=dataset(), resume=True)
    want, got = full.state_dict(), resumed.state_dict()
    assert want.keys() == got.keys()
    for name in want:
        assert torch.equal(want[name], got[name]), name
    assert [h["loss"] for h in history] == [h["loss"] for h in full_history]
    assert [h["eval_loss"] for h in history] == [h["eval_loss"] for h in full_history]


@pytest.mark.slow
def test_resume_falls_back_when_the_newest_checkpoint_is_incomplete(tmp_path: Path) -> None:
    full = _trainer(tmp_path / "full")
    full.fit(dataset(), epochs=2)
    run = tmp_path / "run"
    with pytest.raises(Crash):
        _trainer(run, on_checkpoint=_crash_after(3)).fit(dataset(), epochs=2)
    newest = find_latest(run, 2)
    (newest.folder / "stage1.pt").write_bytes(b"torn")  # as if the write had been cut short
    older = find_latest(run, 2)
    assert older.folder != newest.folder and older.manifest["minibatch"] < newest.minibatch
    resumed = _trainer(run)
    resumed.fit(dataset(), epochs=2, resume=True)
    for name, t in full.state_dict().items():
        assert torch.equal(resumed.state_dict()[name], t), name


@pytest.mark.slow
def test_resume_without_any_complete_checkpoint_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        _trainer(tmp_path / "empty").fit(dataset(), epochs=1, resume=True)
    with pytest.raises(Crash):
        _trainer(tmp_path / "run", on_checkpoint=_crash_after(1)).fit(dataset(), epochs=1)
    for f in (tmp_path / "run").glob("*/manifest.json"):
        f.write_text("{not json")
    with pytest.raises(CheckpointError, match="unreadable manifest"):
        _trainer(tmp_path / "run").fit(dataset(), epochs=1, resume=True)


@pytest.mark.slow
def test_checkpoint_for_another_pipeline_is_refused(tmp_path: Path) -> None:
    _trainer(tmp_path / "c").fit(dataset(), epochs=1)
    other = Trainer(split(tiny_mlp(), [2]), [1, 1], loss_fn, sgd, executor="reference",
                    checkpoint_dir=str(tmp_path / "c"), progress=False)
    with pytest.raises(CheckpointError, match="different model"):
        other.fit(batches(4), epochs=2, resume=True)


def test_too_few_processes_fail_at_start(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")  # never contacted: the check comes first

    def no_rendezvous(*args: object, **kwargs: object) -> None:
        raise AssertionError("the process group was started before the world size check")

    monkeypatch.setattr(torch.distributed, "init_process_group", no_rendezvous)
    with pytest.raises(RuntimeConfigError, match="has 1 process but the plan needs 2"):
        Trainer(stages(), [1, 1], F.mse_loss, sgd, executor="distributed")


def test_distributed_without_torchrun_env_says_how_to_launch(monkeypatch: pytest.MonkeyPatch
                                                             ) -> None:
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(RuntimeConfigError, match="torchrun"):
        Trainer(stages(), [1, 1], F.mse_loss, sgd, executor="distributed")


@pytest.mark.parametrize("kw, match", [({"schedule": "zigzag"}, "unknown schedule"),
                                       ({"executor": "mpi"}, "unknown executor"),
                                       ({"checkpoint_every": 3}, "without checkpoint_dir"),
                                       ({"checkpoint_dir": "x", "checkpoint_every": 3,
                                         "segment": 2}, "not a multiple"),
                                       ({"timeline": True}, "timeline=True needs executor")])
def test_bad_arguments(kw: dict, match: str) -> None:
    with pytest.raises(RuntimeConfigError, match=match):
        Trainer(stages(), [1, 1], F.mse_loss, sgd, **{"executor": "reference", **kw})


@pytest.mark.slow
def test_make_trainer_from_compiled_model() -> None:
    from fxpipe.api import compile as fx_compile

    model = tiny_mlp()
    data = batches(6)
    compiled = fx_compile(model, 2, example_inputs=(data[0][0],), loss_fn=loss_fn, stages=2,
                          straight=True, repeats=1)
    before = copy.deepcopy(compiled.state_dict())
    trainer = make_trainer(compiled, optimizer=sgd, executor="reference", progress=False)
    history = trainer.fit(data, epochs=2, eval_loader=data[:2])
    assert len(history) == 2 and history[1]["loss"] < history[0]["loss"]
    assert "eval_loss" in history[0] and history[0]["samples"] == 24
    after = compiled.state_dict()
    assert any(not torch.equal(before[n], after[n]) for n in before)
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), after[n])
