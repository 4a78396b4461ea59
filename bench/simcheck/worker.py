"""One rank of a simulator-validation run (see bench/simcheck/run.py), under torchrun:

    torchrun --nnodes H ... -m bench.simcheck.worker --plan plan.json --minibatches 48 --out DIR

Trains ``SleepChain`` with the given plan (PipeDream 1F1B, weight stashing) for ``--epochs``
segments of ``--minibatches`` and writes OUT/rank<R>.json: each segment's wall time (the
runtime's own ``time_s``) and the last segment's timeline (absolute ``perf_counter`` times:
every emulated host shares this machine's monotonic clock, so the ranks line up).
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from fxpipe.api import compile as fx_compile
from fxpipe.costmodel import Cluster
from fxpipe.passes import Plan
from fxpipe.runtime.training.data import ShardedDataset

from bench.experiment.common import write_json

from .model import BATCH, SleepLayer, build, data


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--plan", required=True)
    p.add_argument("--minibatches", type=int, default=48)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    plan = Plan.load(args.plan)
    x, y = data(args.minibatches)
    # device="CPU": the plan is given; do not measure the (sleeping) costs again on every rank
    compiled = fx_compile(build(), Cluster(workers=plan.workers_used, device="CPU"),
                          example_inputs=(x[:BATCH],), loss_fn=F.cross_entropy, plan=plan,
                          leaf_modules=[SleepLayer])
    trainer = compiled.trainer(optimizer=lambda ps: torch.optim.SGD(ps, lr=0.01),
                               schedule="pipedream",  # what the simulator is checked on
                               timeout_s=120, progress=False, timeline=True)
    loader = ShardedDataset((x,), y, batch_size=BATCH, seed=0, drop_last=True)
    history = trainer.fit(loader, epochs=args.epochs)
    t0 = trainer.timeline_origin
    timeline, background = trainer.timelines[-1]
    events = [{"category": e.category, "name": e.name, "start": t0 + e.start, "end": t0 + e.end,
               "args": {k: v for k, v in e.args.items() if isinstance(v, (int, float, str))}}
              for e in [*timeline, *background] if e.category != "idle"]
    out = {"rank": rank, "stage_replica": list(trainer.backend.me), "replicas": list(plan.replicas),
           "segment_s": [h["time_s"] for h in history], "minibatches": args.minibatches,
           "events": events}
    write_json(Path(args.out) / f"rank{rank}.json", out)  # atomic: the driver reads it after
    trainer.close()
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
