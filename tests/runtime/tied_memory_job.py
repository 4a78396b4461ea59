"""A tied model's memory, predicted against measured: run by torchrun on 2 ranks.

    torchrun --nproc-per-node 2 tied_memory_job.py OUT.json --schedule 1f1b-flush

The zoo's GPT with a vocabulary that dwarfs the rest (4096 x 64: the tied embedding is 1 MiB of
the model's 1.25 MiB), compiled for 2 straight stages with AdamW and trained for 8 minibatches
with ``measure_memory``: the embedding's owner is stage 0, and the last stage keeps its own copy
of the head's weight, with AdamW's moments, and sums the two copies' gradients with stage 0 at
each update. Rank 0 writes each stage's plan figures, walked peak and measured peak.
"""
from __future__ import annotations

import argparse
import json
import os

import torch
import torch.nn.functional as F

import fxpipe
from fxpipe.models.gpt import GPT

V, B, T = 4096, 4, 16


def adamw(params):  # noqa: ANN001, ANN201 (an optimizer factory)
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--schedule", default="1f1b-flush")
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = GPT(vocab_size=V, block_size=T, n_layer=2, n_head=2, n_embd=64)
    m = 2 if args.schedule not in ("pipedream", "2bw") else None
    compiled = fxpipe.compile(model, fxpipe.Cluster(workers=2),
                              example_inputs=(torch.randint(0, V, (B, T)),), loss_fn=loss_fn,
                              stages=2, straight=True, optimizer=adamw, schedule=args.schedule,
                              microbatches=m)
    g = torch.Generator().manual_seed(1)
    loader = [((torch.randint(0, V, (B, T), generator=g),),
               torch.randint(0, V, (B, T), generator=g)) for _ in range(8)]
    trainer = compiled.trainer(optimizer=adamw, schedule=args.schedule, microbatches=m,
                               measure_memory=True, progress=False, timeout_s=120)
    trainer.fit(loader, epochs=1)
    if int(os.environ["RANK"]) == 0:
        rows = [{"stage": c.stage, "state": c.state, "walked": c.walked, "measured": c.measured,
                 "parts": dict(c.walked_parts)} for c in compiled.memory_check(trainer)]
        plan = compiled.plan
        with open(args.out, "w") as f:
            json.dump({"rows": rows, "shared": {k: list(v) for k, v in
                                                plan.shared_parameters.items()},
                       "copy_bytes": [sp.copy_bytes for sp in plan.stages],
                       "parameter_bytes": [sp.parameter_bytes for sp in plan.stages],
                       "memory_bytes": [sp.memory_bytes for sp in plan.stages]}, f)
    trainer.close()


if __name__ == "__main__":
    main()
