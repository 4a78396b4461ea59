"""Files a user saved before the runtime moved into its five packages still load.

``fixtures/pre_move/`` was written by the code of commit 631a2be (``runtime/`` as one flat
folder), before any module moved: ``export/`` by ``compiled.export`` (plan.json, stage files),
``ckpt/`` by a 2-stage ``1f1b-flush`` run with ``checkpoint_every=3`` (two checkpoints), and
``expected_state.pt`` = ``load_model_state("ckpt")`` as that code read it. The script::

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))
    compiled = fxpipe.compile(model, fxpipe.Cluster(workers=2, bandwidth="1Gbps"),
                              example_inputs=(torch.randn(4, 6),), loss_fn=F.cross_entropy,
                              stages=2)
    compiled.export("export")
    data = [(torch.randn(4, 6), torch.randint(0, 3, (4,))) for _ in range(6)]
    compiled.trainer(optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
                     schedule="1f1b-flush", microbatches=2, executor="reference",
                     checkpoint_dir="ckpt", checkpoint_every=3).fit(data, epochs=1)

Why it holds: checkpoints and plans store tensors, numbers and names, never a class path (checked
below on the files themselves), so where a module lives does not matter to them.
"""
from __future__ import annotations

import shutil
import zipfile
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import fxpipe
from fxpipe.passes.plan import Plan
from fxpipe.runtime.training.checkpoint import find_latest, load_model_state

FIXTURE = Path(__file__).parents[1] / "fixtures" / "pre_move"  # tests/runtime/fixtures


def test_saved_files_hold_no_class_path() -> None:
    pickles = [p for p in FIXTURE.rglob("*.pt")]
    assert len(pickles) == 7  # two checkpoints of two stages, two exported stages, the state
    for path in pickles:
        with zipfile.ZipFile(path) as z:
            for name in z.namelist():
                if name.endswith(".pkl"):
                    assert b"fxpipe" not in z.read(name), (path, name)
    for path in FIXTURE.rglob("*.json"):
        assert "fxpipe.runtime." not in path.read_text(), path


def test_a_checkpoint_saved_before_the_move_loads_and_resumes(tmp_path: Path) -> None:
    expected = torch.load(FIXTURE / "expected_state.pt", weights_only=True)
    state = load_model_state(FIXTURE / "ckpt")
    assert sorted(state) == sorted(expected)
    for name, value in expected.items():
        assert torch.equal(state[name], value), name

    plan = Plan.load(FIXTURE / "export" / "plan.json")
    assert plan.replicas == [1, 1]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))
    compiled = fxpipe.compile(model, fxpipe.Cluster(workers=2, bandwidth="1Gbps"),
                              example_inputs=(torch.randn(4, 6),), loss_fn=F.cross_entropy,
                              plan=plan)
    assert compiled.plan.to_dict() == plan.to_dict()
    ckpt = tmp_path / "ckpt"
    shutil.copytree(FIXTURE / "ckpt", ckpt)  # resuming may prune or add checkpoints
    assert (find_latest(ckpt, 2).epoch, find_latest(ckpt, 2).minibatch) == (1, 0)
    data = [(torch.randn(4, 6), torch.randint(0, 3, (4,))) for _ in range(6)]
    trainer = compiled.trainer(optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
                               schedule="1f1b-flush", microbatches=2, executor="reference",
                               checkpoint_dir=str(ckpt), checkpoint_every=3, progress=False)
    history = trainer.fit(data, epochs=2, resume=True)  # epoch 1 was trained before the move
    assert [h["epoch"] for h in history] == [1.0, 2.0]
    assert history[0]["loss"] == 1.1060274640719097  # what the run before the move logged
    state = trainer.state_dict()
    assert sorted(state) == sorted(expected)
    assert any(not torch.equal(state[n], expected[n]) for n in expected)  # it trained on
