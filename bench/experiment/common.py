"""Shared pieces of the emulated-cluster experiment: model, data split, plans, and the reading of a
run's results (time to a target accuracy, seconds per minibatch) that the report uses: here, not
in run.py, so report.py and run.py (which imports the report) do not import each other.

Everything here is deterministic (fixed seeds), so every torchrun rank builds the identical model,
data split and minibatch order, and the driver can re-derive the plans the workers load.
"""
from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

TRAIN_SEED, SPLIT_SEED, TEST_SIZE = 0, 0, 360


class DigitsVGG(nn.Module):
    """VGG-style CNN for 8x8 digits: a conv body (4 convs, 2 pools -> c x 2 x 2 features, most
    of the FLOPs) and a deliberately wide fully-connected tail (4c -> W -> W -> 10). "bigtail"
    (W=1024, c=32): the tail holds 1.19M of the 1.40M parameters, so data parallelism
    all-reduces 5.6 MB per step, while a pipeline cut after the body moves 512 B per sample each
    way."""

    def __init__(self, width: int = 1024, channels: tuple[int, int, int] = (64, 128, 32)) -> None:
        super().__init__()
        a, b, c = channels
        self.features = nn.Sequential(
            nn.Conv2d(1, a, 3, padding=1), nn.ReLU(),
            nn.Conv2d(a, a, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(a, b, 3, padding=1), nn.ReLU(),
            nn.Conv2d(b, c, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2))
        self.classifier = nn.Sequential(
            nn.Flatten(), nn.Linear(4 * c, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
            nn.Linear(width, 10))
        for m in self.modules():  # He init: without normalisation layers PyTorch's default
            if isinstance(m, (nn.Conv2d, nn.Linear)):  # init stalls the first epochs
                nn.init.kaiming_normal_(m.weight, nonlinearity="relu")
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


MODELS = {  # name -> (width, channels)
    "bigtail": (1024, (64, 128, 32)),   # communication-bound for data parallelism
    "small": (32, (32, 16, 16)),        # do-no-harm: few parameters, large activations
}


def build_model(name: str, seed: int = TRAIN_SEED) -> nn.Module:
    torch.manual_seed(seed)
    width, channels = MODELS[name]
    return DigitsVGG(width, channels)


def digits_split() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """sklearn digits as (N,1,8,8) floats in [0,1]; a fixed seeded split (1437 train, 360 test)."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x, dtype=torch.float32).reshape(-1, 1, 8, 8) / 16.0
    y = torch.tensor(y, dtype=torch.long)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(SPLIT_SEED))
    test, train = perm[:TEST_SIZE], perm[TEST_SIZE:]
    return x[train], y[train], x[test], y[test]


def param_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def loadavg() -> list[float]:
    return [round(v, 2) for v in os.getloadavg()]


def write_json(path: str | Path, obj: Any) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)


def now() -> float:
    return time.perf_counter()


def time_to(res: dict, target: float) -> float | None:
    for e in res["epochs"]:
        if e["test_accuracy"] is not None and e["test_accuracy"] >= target:
            return e["train_time_s"]
    return None


def measured_s_per_minibatch(res: dict, batch: int) -> float:
    """Median over epochs (the first excluded when there are more) of epoch training time per
    ``batch`` samples: the fill and drain of each epoch's schedule are included."""
    eps = res["epochs"][1:] or res["epochs"]
    return statistics.median(e["segment_time_s"] * batch / e["samples"] for e in eps)
