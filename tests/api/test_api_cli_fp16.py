"""`fxpipe train --precision fp16`: runs end to end with a flushing schedule (2 gloo ranks), and
the launcher refuses an asynchronous or auto schedule before starting any worker."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.multiprocess]

ROOT = Path(__file__).resolve().parents[2]


def _run(args: list[str], timeout: float) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "fxpipe.cli_train", "train", *args], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        pytest.fail(f"timed out:\n{out[-3000:]}")
    return subprocess.CompletedProcess(args, proc.returncode, out, "")


def test_fxpipe_train_fp16_with_a_flushing_schedule(tmp_path: Path) -> None:
    res = _run(["alexnet", "--data", "synthetic", "--nproc", "2", "--schedule", "1f1b-flush",
                "--precision", "fp16", "--epochs", "1", "--num-batches", "4",
                "--eval-batches", "1", "--no-progress", "--save", str(tmp_path / "w.pt")], 300)
    assert res.returncode == 0, res.stdout[-4000:]
    assert "epoch 1: loss " in res.stdout and (tmp_path / "w.pt").exists()


@pytest.mark.parametrize("schedule", ["auto", "pipedream"])
def test_fxpipe_train_fp16_refuses_asynchronous_schedules_before_launching(schedule: str
                                                                          ) -> None:
    res = _run(["alexnet", "--data", "synthetic", "--nproc", "2", "--schedule", schedule,
                "--precision", "fp16"], 60)
    assert res.returncode != 0
    assert f"--precision fp16 with --schedule {schedule}" in res.stdout
    assert "1f1b-flush" in res.stdout and "torch.distributed" not in res.stdout
