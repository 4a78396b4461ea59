"""`fxpipe train --measure-memory`: each stage's measured peak printed beside the plan's
prediction at the end (2 gloo ranks), for the schedule that ran."""
from __future__ import annotations

import re

import pytest
from test_api_cli_fp16 import _run

pytestmark = [pytest.mark.multiprocess]


def test_fxpipe_train_prints_measured_against_predicted_memory() -> None:
    res = _run(["alexnet", "--data", "synthetic", "--nproc", "2", "--schedule", "1f1b-flush",
                "--epochs", "1", "--num-batches", "4", "--eval-batches", "1", "--no-progress",
                "--stages", "2", "--straight", "--measure-memory"], 300)
    assert res.returncode == 0, res.stdout[-4000:]
    # the plan is made for the schedule named (it once kept PipeDream's rule whatever ran)
    table = res.stdout.split("memory per stage, predicted by the plan (priced for 1f1b-flush) "
                             "and measured (MiB):")[1]
    rows = [line for line in table.splitlines() if re.match(r"\| \d ", line)]
    assert [r.split("|")[1].strip() for r in rows] == ["0", "1"]
    for r in rows:
        predicted, measured = float(r.split("|")[2]), float(r.split("|")[6])
        assert predicted > 0 and measured > 0, r
