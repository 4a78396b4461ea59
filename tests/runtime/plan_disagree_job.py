"""Worker for test_runtime_plan_agreement: each torchrun rank splits the same model differently,
as ranks that each profiled on their own machine might."""
import os

import torch
from torch import nn

from fxpipe.codegen.split import placed_nodes, split_graph
from fxpipe.errors import FxpipeError
from fxpipe.runtime.training.trainer import Trainer

torch.manual_seed(0)
gm = torch.fx.symbolic_trace(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)))
cut = 2 if os.environ["RANK"] == "0" else 3  # rank 1 cuts one node later
stages = split_graph(gm, {n.name: int(i >= cut) for i, n in enumerate(placed_nodes(gm))})
try:
    Trainer(stages, [1, 1], lambda o, t: (o - t).pow(2).mean(), torch.optim.SGD, timeout_s=20)
except FxpipeError as e:
    print(f"rank {os.environ['RANK']}: {e}", flush=True)
    raise SystemExit(3)
print("no error", flush=True)
