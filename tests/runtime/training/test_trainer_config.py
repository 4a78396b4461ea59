"""The trainer's options in sections (runtime/training/config.py): every flat option has exactly
one section field, sections and the earlier flat keywords configure the same run, and a wrong
option is named before anything is built."""
from __future__ import annotations

import functools
import inspect
import json
from dataclasses import MISSING, fields
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from rt_helpers import batches, loss_fn, sgd, tiny_mlp
from trainer_job import dataset, stages

import fxpipe
from fxpipe.api import CompiledModel
from fxpipe.runtime.errors import RuntimeConfigError
from fxpipe.runtime.training.auto import AutoOptions
from fxpipe.runtime.training.config import FLAT, SECTIONS, flat_options
from fxpipe.runtime.training.trainer import Trainer

momentum = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)
step_lr = functools.partial(torch.optim.lr_scheduler.StepLR, step_size=2, gamma=0.5)
# the re-planning options: compiled.trainer's (make_replanner pops them), not the loop's
REPLAN = {"replan", "replan_threshold", "replan_after", "replan_max", "replan_measure"}


def test_every_option_of_the_loop_has_one_section_field() -> None:
    setup = inspect.signature(Trainer._setup).parameters
    loop = {n for n, p in setup.items() if p.kind is p.KEYWORD_ONLY} - {"replan"}
    assert set(FLAT) - REPLAN == loop
    for section, (cls, names) in SECTIONS.items():
        assert [f.name for f in fields(cls)] == list(names), section
    # the section's defaults are the loop's (None: the caller's own, e.g. schedule "auto";
    # MISSING: a field the section cannot go without, the LR scheduler's factory)
    for flat, (section, name) in FLAT.items():
        if flat in loop:
            default = next(f.default for f in fields(SECTIONS[section][0]) if f.name == name)
            assert default in (None, MISSING) or default == setup[flat].default, flat


@pytest.mark.parametrize("signature", [Trainer.__init__, CompiledModel.trainer])
def test_at_most_twelve_typed_arguments(signature) -> None:
    params = [p for n, p in inspect.signature(signature).parameters.items()
              if n != "self" and p.kind is not p.VAR_KEYWORD]
    assert len(params) <= 12
    assert all(p.annotation is not inspect.Parameter.empty for p in params)


def test_a_section_sets_only_what_differs_from_its_defaults() -> None:
    got = flat_options({"schedule": fxpipe.ScheduleConfig(kind="1f1b-flush", microbatches=4),
                        "checkpoint": fxpipe.CheckpointConfig(dir="c", keep=None),
                        "precision": "bf16", "run": None},
                       {"executor": "reference"})
    assert got == {"schedule": "1f1b-flush", "microbatches": 4, "checkpoint_dir": "c",
                   "keep_checkpoints": None, "precision": "bf16", "executor": "reference"}


@pytest.mark.parametrize("sections, aliases, says", [
    ({}, {"checkpoint_dirr": "c"}, "unknown trainer option 'checkpoint_dirr'"),
    ({"checkpoint": fxpipe.CheckpointConfig(dir="c")}, {"checkpoint_dir": "d"},
     "checkpoint_dir='d' and checkpoint=CheckpointConfig(dir=...) both given"),
    ({"checkpoint": "ckpt/"}, {}, "checkpoint='ckpt/'"),
    ({"metrics": {"path": "m.jsonl"}}, {}, "metrics={'path': 'm.jsonl'}"),
])
def test_a_wrong_option_is_named(sections, aliases, says) -> None:
    with pytest.raises(RuntimeConfigError) as info:
        flat_options(sections, aliases)
    assert says in str(info.value)
    if "checkpoint_dirr" in says:
        assert "did you mean 'checkpoint_dir'?" in str(info.value)
    if sections.get("checkpoint") == "ckpt/":
        assert "CheckpointConfig(...)" in str(info.value)


def test_a_bare_trainer_refuses_replanning_by_name() -> None:
    with pytest.raises(RuntimeConfigError, match="replan_threshold on a bare Trainer"):
        Trainer(stages(), [1, 1], F.mse_loss, momentum, replan_threshold=0.1,
                run=fxpipe.RunConfig(executor="reference"))


def test_sections_train_what_the_flat_keywords_train(tmp_path: Path) -> None:
    """Two stages under 1f1b-flush with an LR schedule, checkpoints and metrics: configured by
    sections and by the earlier flat keywords, the same losses, weights and files."""
    runs = {}
    for how in ("sections", "flat"):
        out = tmp_path / how
        if how == "sections":
            trainer = Trainer(
                stages(), [1, 1], F.mse_loss, momentum,
                schedule=fxpipe.ScheduleConfig(kind="1f1b-flush", microbatches=2, segment=2),
                checkpoint=fxpipe.CheckpointConfig(dir=str(out / "ckpt"), every=2, keep=2),
                metrics=fxpipe.MetricsConfig(path=str(out / "m.jsonl"), progress=False),
                run=fxpipe.RunConfig(executor="reference"),
                lr_scheduler=fxpipe.LrSchedulerConfig(step_lr, interval="epoch"),
                data=fxpipe.DataConfig(seed=3))
        else:
            trainer = Trainer(stages(), [1, 1], F.mse_loss, momentum, schedule="1f1b-flush",
                              microbatches=2, segment=2, checkpoint_dir=str(out / "ckpt"),
                              checkpoint_every=2, keep_checkpoints=2,
                              metrics_path=str(out / "m.jsonl"), progress=False,
                              executor="reference", lr_scheduler=step_lr,
                              lr_scheduler_interval="epoch", seed=3)
        history = trainer.fit(dataset(8), epochs=2)
        assert trainer.lr_interval == "epoch" and trainer.keep_checkpoints == 2
        rows = [json.loads(line) for line in (out / "m.jsonl").read_text().splitlines()]
        runs[how] = (history, trainer.state_dict(),
                     sorted(p.name for p in (out / "ckpt").iterdir()), len(rows))
    (h1, s1, c1, n1), (h2, s2, c2, n2) = runs["sections"], runs["flat"]
    assert [e["loss"] for e in h1] == [e["loss"] for e in h2]
    assert s1.keys() == s2.keys() and all(torch.equal(s1[k], s2[k]) for k in s1)
    assert c1 == c2 and len(c1) == 2 and n1 == n2 > 0


def test_compiled_trainer_takes_sections(tmp_path: Path) -> None:
    model = tiny_mlp()
    data = batches(4)
    compiled = fxpipe.compile(model, 1, example_inputs=(data[0][0],), loss_fn=loss_fn,
                              overheads="off")
    trainer = compiled.trainer(sgd, schedule="pipedream",
                               checkpoint=fxpipe.CheckpointConfig(dir=str(tmp_path / "c")),
                               metrics=fxpipe.MetricsConfig(progress=False),
                               run=fxpipe.RunConfig(executor="reference"))
    assert isinstance(trainer, Trainer) and trainer.kind == "pipedream"
    assert trainer.fingerprint == compiled.plan.model_fingerprint  # set by compiled.trainer
    trainer.fit(data, epochs=1)
    assert any((tmp_path / "c").iterdir())
    with pytest.raises(RuntimeConfigError, match="unknown trainer option 'checkpoint_every_'"):
        compiled.trainer(sgd, checkpoint_every_=2)
    with pytest.raises(fxpipe.ConfigError, match="no optimizer") as info:
        compiled.trainer(checkpoint=fxpipe.CheckpointConfig(dir=str(tmp_path / "d")))
    assert "torch.optim.SGD" in str(info.value)
    # auto's options as a record: what it sets goes over what compiled.trainer fills in
    auto = compiled.trainer(sgd, schedule=fxpipe.ScheduleConfig(
        kind="auto", auto=AutoOptions(max_cost=0.5)), run=fxpipe.RunConfig(executor="reference"),
        metrics=fxpipe.MetricsConfig(progress=False))
    assert auto.auto_options.max_cost == 0.5 and auto.auto_options.plan is compiled.plan
