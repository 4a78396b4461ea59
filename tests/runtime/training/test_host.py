"""The trainer as auto's pilots and the re-planner see it (runtime/training/host.py): the Trainer
provides every member of ``TrainingHost``, and the modules that drive a trainer read nothing of it
that the protocol does not declare; no function outside the trainer's own modules takes
``trainer: Any``."""
from __future__ import annotations

import ast
from pathlib import Path

import torch
from rt_helpers import loss_fn, split, tiny_mlp

from fxpipe.runtime.training.host import Backend, TrainingHost
from fxpipe.runtime.training.trainer import Trainer

ROOT = Path(__file__).resolve().parents[3]
DRIVERS = ["auto_resolve", "auto_pipeline", "auto_look", "trainer_switch"]
TRAINER_OWN = {"trainer.py", "host.py"}  # the Trainer and its mixins are trainer_*.py too


def declared(protocol: type) -> set[str]:
    """Names ``protocol`` declares: annotated attributes, methods and properties."""
    return set(protocol.__annotations__) | {n for n, v in vars(protocol).items()
                    if not n.startswith("__") and (callable(v) or isinstance(v, property))}


def read_of(path: Path, name: str = "trainer") -> set[str]:
    """Every attribute read or written through a variable called ``name`` in ``path``."""
    tree = ast.parse(path.read_text())
    return {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)
            and isinstance(n.value, ast.Name) and n.value.id == name}


def test_the_trainer_is_a_training_host() -> None:
    t = Trainer(split(tiny_mlp(), [1, 3]), [1, 1, 1], loss_fn,
                lambda ps: torch.optim.SGD(ps, lr=0.05), schedule="1f1b-flush",
                executor="reference", progress=False)
    assert isinstance(t, TrainingHost)
    assert isinstance(t.backend, Backend)
    missing = sorted(n for n in declared(TrainingHost) if not hasattr(t, n))
    assert missing == []


def test_the_drivers_read_only_what_the_protocol_declares() -> None:
    known = declared(TrainingHost)
    for mod in DRIVERS:
        used = read_of(ROOT / "runtime" / "training" / f"{mod}.py")
        assert used, mod  # the scan sees the module's trainer
        assert sorted(used - known) == [], mod


def test_the_scan_sees_an_undeclared_member(tmp_path: Path) -> None:
    """The check above fails on a driver that reads a member the protocol leaves out."""
    bad = tmp_path / "driver.py"
    bad.write_text("def f(trainer):\n    return trainer.replicas, trainer._samples\n")
    assert read_of(bad) - declared(TrainingHost) == {"_samples"}


def test_no_function_outside_the_trainers_modules_takes_an_untyped_trainer() -> None:
    found = []
    for path in sorted((ROOT / "runtime").rglob("*.py")) + sorted((ROOT / "fxpipe").glob("*.py")):
        if path.name in TRAINER_OWN or path.name.startswith("trainer_") and path.name not in (
                "trainer_switch.py", "trainer_backends.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for a in node.args.args + node.args.kwonlyargs:
                    if a.arg == "trainer" and (a.annotation is None or
                                               ast.unparse(a.annotation) == "Any"):
                        found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}")
    assert found == []
