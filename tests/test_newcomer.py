"""A newcomer's first hour, played from a folder outside the repository.

The README's quick start (PipeDream's setting, then the same model measured here) and its
training example run as written, with the installed ``fxpipe`` and ``torchrun``, and what they
print keeps the README's promises: the first plan pipelines with a speedup over data parallelism
in PipeDream's setting; the training run prints nothing that contradicts its plan (no "slower
than one worker" after a plan predicted faster, and a plan on fewer workers says so before
training); and the recipe it trains is plain PyTorch's, written below without fxpipe: the same
MLP, the same shuffled minibatches (the loader shuffled by torch's global RNG seeded per epoch
the way fxpipe documents, sha256 of "seed,epoch,-1"), one SGD step per minibatch.
"""
from __future__ import annotations

import ast
import hashlib
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

pytestmark = [pytest.mark.multiprocess]

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
README = (ROOT / "README.md").read_text()


def section(title: str) -> str:
    start = README.index(f"## {title}")
    end = README.find("\n## ", start + 1)
    return README[start:end if end > 0 else None]


def blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", text, re.M | re.S)


def run(command: str, cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
           "OMP_NUM_THREADS": "1"}
    env.pop("FXPIPE_OVERHEADS", None)  # a newcomer's defaults (conftest turns them off)
    proc = subprocess.Popen(["bash", "-c", command.replace(".venv/bin/", f"{BIN}/")], cwd=cwd,
                            env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)  # a group of its own: torchrun and its ranks
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{command!r} ran past {timeout} s\n{out[-3000:]}")
    return subprocess.CompletedProcess(command, proc.returncode, out, "")


@pytest.fixture()
def outside(tmp_path: Path) -> Path:
    assert ROOT not in tmp_path.resolve().parents  # not inside the repository
    return tmp_path


def test_the_quick_start_shows_what_fxpipe_is_for(outside: Path) -> None:
    pipedream, here = [b.strip() for b in blocks(section("Quick start"), "bash")]
    res = run(pipedream, outside)
    assert res.returncode == 0, res.stdout[-3000:]
    speedup = re.search(r"^speedup: ([\d.]+)x over data parallelism on 8 workers", res.stdout,
                        re.M)
    assert speedup and float(speedup.group(1)) > 1, res.stdout
    assert re.search(r"^\s+0 .* 7 ", res.stdout, re.M)  # 7 replicas, then the classifier
    assert "PipeDream's paper" in res.stdout and "5x" in res.stdout
    assert (outside / "vgg16-plan.svg").read_text().lstrip().startswith("<?xml")
    res = run(here, outside)
    assert res.returncode == 0, res.stdout[-3000:]
    why = [ln for ln in res.stdout.splitlines() if ln.startswith("This plan ")]
    assert why, res.stdout  # one stage (or fewer workers) here, and it says why
    assert "costs: measured on this machine" in res.stdout


def derive_seed(*parts: int) -> int:
    """The seed fxpipe's documented data contract gives the loader's shuffle in each epoch."""
    h = hashlib.sha256(",".join(str(int(p)) for p in parts).encode()).digest()
    return int.from_bytes(h[:8], "little") & ((1 << 63) - 1)


def plain_readme_recipe(epochs: int = 3) -> tuple[float, float]:
    """The README's MLP, loader and SGD in a plain loop: the last epoch's mean minibatch loss,
    and the mean per-sample loss of the final weights over the data."""
    from sklearn.datasets import load_digits
    from torch.utils.data import DataLoader, TensorDataset

    x, y = load_digits(return_X_y=True)
    data = TensorDataset(torch.tensor(x / 16, dtype=torch.float32), torch.tensor(y))
    loader = DataLoader(data, batch_size=64, shuffle=True)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                          nn.Linear(1024, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for epoch in range(epochs):
        torch.manual_seed(derive_seed(0, epoch, -1))
        losses = []
        for xb, yb in loader:
            opt.zero_grad()
            loss = F.cross_entropy(model(xb), yb)
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
    with torch.no_grad():
        full = F.cross_entropy(model(data.tensors[0]), data.tensors[1]).item()
    return sum(losses) / len(losses), full


def test_the_training_example_keeps_its_promises(outside: Path) -> None:
    train = section("Train")
    script = next(b for b in blocks(train, "python") if b.startswith("# train.py"))
    (outside / "train.py").write_text(script)
    [command] = [b.strip() for b in blocks(train, "bash")]
    res = run(command, outside)
    assert res.returncode == 0, res.stdout[-3000:]
    out = res.stdout
    assert "slower than one worker" not in out and "does harm" not in out, out[-3000:]
    used = re.search(r"^time per minibatch: .* on (\d+) of 2 workers", out, re.M)
    assert used, out[-3000:]
    if used.group(1) != "2":  # a plan on fewer workers says so, before training
        assert out.index("the plan uses 1 of the job's 2 processes") < out.index("epoch 1/3")
        assert "rank 1 is idle" in out and "This plan uses 1 of the 2 workers" in out
    else:
        assert re.search(r"^speedup: .*, ([\d.]+)x over one worker", out, re.M)
    history = ast.literal_eval(out.strip().splitlines()[-1])
    loss, full = plain_readme_recipe()
    assert history["loss"] == pytest.approx(loss, rel=1e-4)
    assert history["eval_loss"] == pytest.approx(full, rel=1e-4)  # per sample, as plain
    assert (outside / "ckpt").is_dir() and len(list((outside / "ckpt").iterdir())) == 3
    again = run(command, outside)  # the same run again: refused, nothing overwritten
    assert again.returncode != 0 and "holds another run's checkpoints" in again.stdout
