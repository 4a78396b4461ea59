"""pipedream on 2 torchrun ranks across segment boundaries, for test_runtime_continuity_dist.py.

    torchrun --nproc-per-node 2 continuity_job.py OUT_DIR SEGMENT
    python continuity_job.py OUT_DIR SEGMENT --executor reference

A 2-stage MLP trains one epoch of 16 minibatches in segments of SEGMENT minibatches, timeline
on, no checkpoint; every rank writes its weights and its events (category, name, start, end,
minibatch, and a receive's posting time) per segment to OUT_DIR/rank<i>.pt.
"""
from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from fxpipe.codegen.split import placed_nodes, split_graph
from fxpipe.runtime.training.trainer import Trainer


def main() -> int:
    out, segment = Path(sys.argv[1]), int(sys.argv[2])
    executor = sys.argv[4] if len(sys.argv) > 4 and sys.argv[3] == "--executor" else "distributed"
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                          nn.Linear(16, 2))
    gm = fx.symbolic_trace(model)
    stages = split_graph(gm, {n.name: int(i > 2) for i, n in enumerate(placed_nodes(gm))})
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)) for _ in range(16)]
    trainer = Trainer(stages, [1, 1], F.mse_loss,
                      functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9),
                      schedule="pipedream", segment=segment, executor=executor,
                      timeout_s=60, progress=False, timeline=executor == "distributed")
    trainer.fit(data, epochs=1)
    rank = int(os.environ.get("RANK", "0"))
    events = [[(e.category, e.name, e.start, e.end, e.args.get("minibatch"),
                e.args.get("posted")) for e in tl] for tl, _ in trainer.timelines]
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    torch.save({"events": events, "weights": weights,
                "stage": trainer.backend.me[0] if executor == "distributed" else None},
               out / f"rank{rank}{'' if executor == 'distributed' else '-ref'}.pt")
    trainer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
