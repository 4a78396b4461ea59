"""Measured memory of a sharded replica group, run by torchrun on 3 ranks.

    torchrun --nproc-per-node 3 shard_memory_job.py OUT.json [--shard optimizer|never]

An MLP whose weights dwarf its activations (64 -> 256, then four 256 -> 256 layers and a head,
batch 4) compiled for 3 workers, planned as stage 0 = the first layer on one worker and stage 1
= the rest on two (``plan_for``, sharded or not as asked, memory priced for 1f1b-flush with 2
microbatches per update), trained with AdamW for 8 minibatches with ``measure_memory``; rank 0
writes, per stage, the measured peak (the largest over the stage's replicas), the walked peak
(``compiled.memory_check``) and the plan's state bytes.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

import fxpipe
from fxpipe.passes.partition import plan_for
from fxpipe.runtime.pricing.memory import memory_rule
from fxpipe.runtime.replica.state_size import state_parts


def model() -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(64, 256), nn.ReLU()]
    for _ in range(4):
        layers += [nn.Linear(256, 256), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(256, 8))


def adamw(params):  # noqa: ANN001, ANN201 (an optimizer factory)
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--shard", default="optimizer", choices=["optimizer", "never"])
    args = p.parse_args()
    torch.set_num_threads(1)
    net = model()
    x = torch.randn(4, 64)
    cluster = fxpipe.Cluster(workers=3)
    first = fxpipe.compile(net, cluster, example_inputs=(x,), loss_fn=F.mse_loss, stages=2,
                           optimizer=adamw, overheads="off", repeats=1)
    prof = first.profile
    cut = prof.names.index("_2")  # the second Linear: stage 0 is the first and its ReLU
    factor, split = state_parts(list(net.parameters()), adamw)
    plan = plan_for(prof, cluster, [0, cut], [1, 2], optimizer_state_factor=factor,
                    sharded_state=split, shard=args.shard,
                    memory_rule=memory_rule("1f1b-flush", 2))
    compiled = fxpipe.compile(net, cluster, example_inputs=(x,), loss_fn=F.mse_loss, plan=plan,
                              optimizer=adamw, overheads="off", repeats=1)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(4, 64, generator=g), torch.randn(4, 8, generator=g)) for _ in range(8)]
    trainer = compiled.trainer(adamw, schedule="1f1b-flush", microbatches=2,
                               metrics=fxpipe.MetricsConfig(measure_memory=True, progress=False),
                               run=fxpipe.RunConfig(timeout_s=60))
    trainer.fit(data, epochs=1)
    checks = compiled.memory_check(trainer)
    rank = int(os.environ.get("RANK", "0"))
    if rank == 0:
        Path(args.out).write_text(json.dumps({
            "shard": compiled.plan.shard, "replicas": compiled.plan.replicas,
            "parameter_bytes": [sp.parameter_bytes for sp in compiled.plan.stages],
            "state_bytes": [sp.state_bytes for sp in compiled.plan.stages],
            "measured": [c.measured for c in checks], "walked": [c.walked for c in checks],
            "parts": [dict(c.parts) for c in checks],
            "walked_parts": [dict(c.walked_parts) for c in checks]}))
    trainer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
