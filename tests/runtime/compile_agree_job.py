"""Worker for test_runtime_plan_agreement: every torchrun rank calls fxpipe.compile with measured
costs, and rank 1 measures very differently on purpose (its profiler is skewed). Each rank trains
two minibatches, then writes the plan it would make alone and the plan compile gave it to
``<outdir>/rank<R>.json``."""
import json
import os
import sys
from pathlib import Path

import torch
from torch import nn

import fxpipe
import fxpipe.api as api
from fxpipe.tracing import trace

RANK = int(os.environ["RANK"])
real_profile_graph = api.profile_graph


def skewed_profile_graph(gm, inputs, **kw):
    """Rank 1's cores are "busy": its first linear layer measures 100x slower."""
    out = real_profile_graph(gm, inputs, **kw)
    if RANK == 1:
        for node in gm.graph.nodes:
            if node.name == "_0":
                node.meta["fxpipe"]["forward_s"] *= 100
                node.meta["fxpipe"]["backward_s"] *= 100
    return out


api.profile_graph = skewed_profile_graph
torch.manual_seed(0)
model = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(32, 32), nn.ReLU())])
x = torch.randn(8, 32)
cluster = fxpipe.Cluster.from_env()
alone = api.choose_plan(api.cost_graph(trace(model, (x,)), cluster), cluster, stages=2,
                        straight=True)
compiled = fxpipe.compile(model, cluster, example_inputs=(x,), stages=2, straight=True,
                          loss_fn=lambda o, t: (o - t).pow(2).mean())
trainer = compiled.trainer(optimizer=lambda ps: torch.optim.SGD(ps, lr=0.01), timeout_s=60,
                           progress=False)
trainer.fit([(x, torch.zeros(8, 32)), (x, torch.ones(8, 32))], epochs=1)
trainer.close()
Path(sys.argv[1], f"rank{RANK}.json").write_text(json.dumps({
    "alone": [list(s.nodes) for s in alone.stages],
    "compiled": [list(s.nodes) for s in compiled.plan.stages], "trained": True}))
