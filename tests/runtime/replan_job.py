"""A torchrun job for test_runtime_replan: a compiled 2-stage MLP trains with timelines, then
every rank asks for a re-plan from the measurements; rank r saves what it got to OUT.r.pt.

    python -m torch.distributed.run --nproc-per-node 2 replan_job.py OUT
"""
from __future__ import annotations

import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

import fxpipe
from fxpipe.runtime.pricing.replan import measure


def main() -> int:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(),
                          nn.Linear(64, 4))
    x = torch.randn(4, 16)
    compiled = fxpipe.compile(model, fxpipe.Cluster(workers=2, device="cpu"), example_inputs=(x,),
                              loss_fn=F.mse_loss, stages=2)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(4, 16, generator=g), torch.randn(4, 4, generator=g)) for _ in range(16)]
    trainer = compiled.trainer(optimizer=lambda ps: torch.optim.SGD(ps, lr=0.01),
                               schedule="1f1b-flush", microbatches=4, timeline=True,
                               progress=False, timeout_s=30)
    trainer.fit(data, epochs=1)
    got = trainer.propose_replan()
    # the trainer's first segment counts from the end of its first update (warm-up), written
    # here from that definition rather than with the filter the trainer uses
    own = []
    for i, (events, _) in enumerate(trainer.timelines):
        if i == 0:
            first_end = max(e.end for e in events if e.category == "optimizer"
                            and e.args.get("update", 0) == 0)
            events = [e for e in events if e.start >= first_end]
        own.append(measure(events))
    (stage, _), = trainer.local  # one (stage, replica) per rank
    torch.save({"factors": got.factors, "gain": got.gain, "adopt": got.adopt,
                "current": got.current.replicas, "proposed": got.proposed.replicas,
                "stage": stage, "own": [(t.forward_s, t.backward_s, t.update_s) for t in own],
                "predicted": [[sum(n.forward_s for n in compiled.profile.nodes if n.name in st.nodes),
                               sum(n.backward_s for n in compiled.profile.nodes if n.name in st.nodes)]
                              for st in compiled.plan.stages]},
               f"{sys.argv[1]}.{os.environ['RANK']}.pt")
    trainer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
