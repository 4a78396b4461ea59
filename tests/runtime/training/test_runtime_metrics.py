"""The metrics log (Trainer(metrics_path=..., metrics_every=N)): its records, read back and
checked against numbers computed here (learning rates by hand, losses from the run's history)."""
from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch
from rt_helpers import batches, loss_fn, split, tiny_mlp

from fxpipe.runtime.errors import RuntimeConfigError
from fxpipe.runtime.training.trainer import Trainer

sgd = functools.partial(torch.optim.SGD, lr=0.1)
warmup = functools.partial(torch.optim.lr_scheduler.LambdaLR, lr_lambda=lambda k: min(1, k / 3))


def _run(path: Path, every: int) -> tuple[list[dict], list[dict]]:
    trainer = Trainer(split(tiny_mlp(), [2]), [1, 1], loss_fn, sgd, lr_scheduler=warmup,
                      schedule="1f1b-flush", microbatches=2, segment=4, executor="reference",
                      progress=False, metrics_path=str(path), metrics_every=every)
    hist = trainer.fit(batches(8), epochs=2, eval_loader=batches(2, seed=9))
    return [json.loads(line) for line in path.read_text().splitlines()], hist


def test_metrics_log_records(tmp_path: Path) -> None:
    """8 minibatches per epoch in segments of 4 = 2 updates each: a record per segment."""
    recs, hist = _run(tmp_path / "m.jsonl", every=2)
    train = [r for r in recs if r["kind"] == "train"]
    evals = [r for r in recs if r["kind"] == "eval"]
    assert [r["step"] for r in train] == [2, 4, 6, 8]
    assert [r["epoch"] for r in train] == [1, 1, 2, 2]
    assert [r["minibatches"] for r in train] == [4] * 4
    # learning rate after k updates of a 3-update linear warm-up from 0.1
    assert [r["lr"] for r in train] == pytest.approx([0.1 * 2 / 3, 0.1, 0.1, 0.1])
    for e in (0, 1):  # the two records of an epoch average to its loss
        pair = train[2 * e:2 * e + 2]
        assert sum(r["loss"] for r in pair) / 2 == pytest.approx(hist[e]["loss"], rel=1e-12)
    assert [(r["epoch"], r["step"]) for r in evals] == [(1, 4), (2, 8)]
    assert [r["eval_loss"] for r in evals] == [h["eval_loss"] for h in hist]
    for r in train:
        assert r["samples_per_s"] == pytest.approx(16 / r["time_s"])  # 4 minibatches of 4
        assert len(r["busy_s"]) == 2 and all(0 < b <= r["time_s"] for b in r["busy_s"])


def test_metrics_every_counts_updates(tmp_path: Path) -> None:
    recs, _ = _run(tmp_path / "m.jsonl", every=3)
    train = [r for r in recs if r["kind"] == "train"]
    assert [r["step"] for r in train] == [4, 8]
    assert [r["minibatches"] for r in train] == [8, 8]  # everything since the last record


@pytest.mark.slow
def test_tensorboard_missing_or_bad_every_is_a_clear_error(tmp_path: Path) -> None:
    try:
        import torch.utils.tensorboard  # noqa: F401
    except ImportError:
        with pytest.raises(RuntimeConfigError, match="pip install tensorboard"):
            Trainer(split(tiny_mlp(), [2]), [1, 1], loss_fn, sgd, executor="reference",
                    tensorboard_dir=str(tmp_path / "tb"))
    else:  # installed: it writes event files
        trainer = Trainer(split(tiny_mlp(), [2]), [1, 1], loss_fn, sgd, executor="reference",
                          progress=False, tensorboard_dir=str(tmp_path / "tb"), segment=2)
        trainer.fit(batches(4), epochs=1)
        trainer.close()
        assert list((tmp_path / "tb").glob("events.out.tfevents.*"))
    with pytest.raises(RuntimeConfigError, match="metrics_every"):
        Trainer(split(tiny_mlp(), [2]), [1, 1], loss_fn, sgd, executor="reference",
                metrics_path=str(tmp_path / "m.jsonl"), metrics_every=0)
