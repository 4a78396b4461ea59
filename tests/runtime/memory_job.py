"""A training script for the memory-measurement tests, run by torchrun on 2 ranks.

    torchrun --nproc-per-node 2 memory_job.py OUT.pt [--schedule 1f1b-flush] [--measure]

Trains a 2-stage MLP whose weights dwarf its activations (64 -> 512 -> 512 -> 8, batch 4) with
SGD and momentum for 6 minibatches (``--minibatches``) in segments of 2, with ``measure_memory``
when ``--measure``;
rank 0 writes the trained state dict, every rank's measured peak and the metrics records.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from pathlib import Path

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from fxpipe.codegen.split import placed_nodes, split_graph
from fxpipe.runtime.training.trainer import Trainer


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                         nn.Linear(512, 8))


def data(n: int) -> list:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 64, generator=g), torch.randn(4, 8, generator=g)) for _ in range(n)]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--schedule", default="1f1b-flush")
    p.add_argument("--measure", action="store_true")
    p.add_argument("--minibatches", type=int, default=6)
    args = p.parse_args()
    torch.set_num_threads(1)
    gm = fx.symbolic_trace(model())
    stages = split_graph(gm, {n.name: int(i > 1) for i, n in enumerate(placed_nodes(gm))})
    metrics = Path(args.out).with_suffix(".jsonl")
    trainer = Trainer(stages, [1, 1], F.mse_loss,
                      functools.partial(torch.optim.SGD, lr=0.01, momentum=0.9),
                      schedule=args.schedule, segment=2, timeout_s=30, progress=False,
                      measure_memory=args.measure, metrics_path=str(metrics),
                      microbatches=2 if args.schedule == "1f1b-flush" else None)
    trainer.fit(data(args.minibatches), epochs=1)
    state = trainer.state_dict()
    if int(os.environ.get("RANK", "0")) == 0:
        torch.save({"state": state, "peaks": trainer.memory_peaks,
                    "per_stage": trainer.measured_memory(),
                    "metrics": [json.loads(line) for line in metrics.read_text().splitlines()]},
                   Path(args.out))
    trainer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
