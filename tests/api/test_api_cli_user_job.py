"""`fxpipe train` for a user's own job: model and data from file.py:factory, AdamW with named
groups (or Muon on the hidden matrices with AdamW on the rest), warm-up + cosine per update,
clipping, bf16, metrics log, on 2 gloo ranks; equal to the same recipe written out in plain torch
here (no fxpipe code in the oracle)."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from fxpipe.errors import ConfigError
from fxpipe.runtime.training.recipes import WarmupCosine

ROOT = Path(__file__).resolve().parents[2]

JOB = textwrap.dedent('''
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    from fxpipe.models import ModelSpec

    def net():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 16), nn.LayerNorm(16), nn.Tanh(), nn.Linear(16, 16),
                             nn.Tanh(), nn.Linear(16, 3))

    def model():
        return ModelSpec(name="user", size="custom", model=net(),
                         example_inputs=(torch.zeros(4, 4),), loss_fn=F.cross_entropy,
                         make_batch=None, batch_size=4)

    def data():
        g = torch.Generator().manual_seed(1)
        x, y = 3 * torch.randn(48, 4, generator=g), torch.randint(0, 3, (48,), generator=g)
        return ([(x[i:i + 4], y[i:i + 4]) for i in range(0, 32, 4)],
                [(x[i:i + 4], y[i:i + 4]) for i in range(32, 48, 4)])
''')


def lr_factor(k: int, warmup: int = 2, total: int = 8, floor: float = 0.1) -> float:
    """Linear warm-up over 2 updates, then a cosine to 10% at update 8 (by hand)."""
    if k < warmup:
        return (k + 1) / warmup
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, (k - warmup) / 6)))


def test_warmup_cosine_by_hand() -> None:
    f = WarmupCosine(2, 8, 0.1)
    assert [f(k) for k in range(10)] == pytest.approx([lr_factor(k) for k in range(10)])
    assert f(0) == 0.5 and f(2) == 1.0 and f(8) == pytest.approx(0.1) and f(20) == pytest.approx(0.1)


def eager(job: dict, optimizer: str = "adamw") -> tuple[dict[str, torch.Tensor], list[float]]:
    """The recipe in plain torch: 2 epochs of 8 minibatches, 2 per update (gradient
    accumulation), AdamW (decay on 2-D weights only; with muon: Muon on the two hidden matrices
    and AdamW on the rest), LambdaLR, clip 0.5, bf16 autocast;
    evaluation (forward and loss) under the same autocast."""
    model, (train, val) = job["net"](), job["data"]()
    # muon: the hidden matrices by hand (the head, 5.weight, stays with AdamW)
    hidden = ["0.weight", "3.weight"] if optimizer == "muon" else []
    named = [(n, p) for n, p in model.named_parameters() if n not in hidden]
    decay = [p for _, p in named if p.dim() >= 2]
    rest = [p for _, p in named if p.dim() < 2]
    opts = [torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                               {"params": rest, "weight_decay": 0.0}], lr=0.02,
                              betas=(0.9, 0.95))]  # nanoGPT's (fxpipe's recipe's)
    if hidden:
        opts.insert(0, torch.optim.Muon([p for n, p in model.named_parameters() if n in hidden],
                                        lr=0.02, weight_decay=0.1, momentum=0.95,
                                        nesterov=True, adjust_lr_fn="match_rms_adamw"))
    scheds = [torch.optim.lr_scheduler.LambdaLR(opt, lr_factor) for opt in opts]
    evals = []
    for _ in range(2):
        model.train()
        for k, (x, y) in enumerate(train):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = torch.nn.functional.cross_entropy(model(x), y)
            (loss / 2).backward()
            if k % 2 == 1:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
                for opt, sched in zip(opts, scheds):
                    opt.step()
                    sched.step()
                    opt.zero_grad()
        model.eval()
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            losses = [float(torch.nn.functional.cross_entropy(model(x), y)) for x, y in val]
        evals.append(sum(losses) / len(losses))
    return model.state_dict(), evals


@pytest.mark.multiprocess
@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_fxpipe_train_user_job_equals_the_recipe_in_plain_torch(tmp_path: Path,
                                                                 optimizer: str) -> None:
    job_file = tmp_path / "job.py"
    job_file.write_text(JOB)
    out, metrics = tmp_path / "out.pt", tmp_path / "m.jsonl"
    cmd = [sys.executable, "-m", "fxpipe.cli_train", "train", f"{job_file}:model",
           "--data", f"{job_file}:data", "--nproc", "2", "--stages", "2", "--straight",
           "--schedule", "1f1b-flush", "--microbatches", "2", "--epochs", "2",
           "--optimizer", optimizer, "--lr", "0.02", "--weight-decay", "0.1", "--warmup", "2",
           "--schedule-lr", "cosine", "--clip", "0.5", "--precision", "bf16",
           "--metrics", str(metrics), "--save", str(out), "--no-progress", "--prefetch", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        text, _ = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        proc.kill()
        text, _ = proc.communicate()
        pytest.fail(f"timed out:\n{text[-3000:]}")
    assert proc.returncode == 0, text[-3000:]
    scope: dict = {}
    exec(compile(JOB, "job", "exec"), scope)  # the user's factories, no fxpipe code involved
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks (OMP_NUM_THREADS=1): bf16 matmuls block by thread
    try:
        want, evals = eager(scope, optimizer)
    finally:
        torch.set_num_threads(threads)
    got = torch.load(out, weights_only=True)
    assert got.keys() == want.keys()
    for k, t in want.items():
        torch.testing.assert_close(got[k], t, rtol=1e-5, atol=1e-6, msg=k)
    recs = [json.loads(line) for line in metrics.read_text().splitlines()]
    ev = [r for r in recs if r["kind"] == "eval"]
    assert [r["step"] for r in ev] == [4, 8]
    assert [r["eval_loss"] for r in ev] == pytest.approx(evals, rel=1e-5)
    train = [r for r in recs if r["kind"] == "train"]
    assert train[-1]["step"] == 8 and train[-1]["lr"] == pytest.approx(0.02 * lr_factor(8))


def test_bad_user_data_is_a_clear_error(tmp_path: Path) -> None:
    from fxpipe.cli_train import _check_data, _user_loaders

    with pytest.raises(ConfigError, match="does not exist"):
        _check_data(str(tmp_path / "missing.py") + ":data")
    bad = tmp_path / "bad.py"
    bad.write_text("def data():\n    return [1, 2, 3]\n")
    with pytest.raises(ConfigError, match="return \\(train_loader, val_loader\\)"):
        _user_loaders(f"{bad}:data")
    with pytest.raises(ConfigError, match="no callable 'nothing'"):
        _user_loaders(f"{bad}:nothing")
