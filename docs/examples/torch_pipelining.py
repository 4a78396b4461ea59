"""Auto-split for torch.distributed.pipelining: fxpipe splits, torch's schedule trains.

    torchrun --nproc-per-node 2 docs/examples/torch_pipelining.py            # interleaved 1F1B
    torchrun --nproc-per-node 2 docs/examples/torch_pipelining.py --zbv      # ZB-V zero bubble

fxpipe traces the zoo's mini GPT (tied embedding and output weights, residual connections that
skip stages), costs it and splits it into 4 balanced stages; each of the 2 ranks takes 2 of them
as torch ``PipelineStage`` s and a torch schedule trains them. Every rank builds the same model
from the same seed and compiles with estimated costs, so every rank derives the same split.
"""
from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch.distributed.pipelining import ScheduleInterleaved1F1B, ScheduleZBVZeroBubble

import fxpipe
from fxpipe import models


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--zbv", action="store_true", help="ScheduleZBVZeroBubble (V placement)")
    p.add_argument("--steps", type=int, default=5)
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)

    spec = models.get("gpt", batch_size=8)  # batches of 8 = 4 microbatches of 2
    mb = tuple(x[:2] for x in spec.example_inputs)
    compiled = fxpipe.compile(spec.model, fxpipe.Cluster(workers=2 * world, device="V100"),
                              example_inputs=mb, stages=2 * world, straight=True)
    if rank == 0:
        print(compiled.summary())
    pipe = compiled.torch_stages(rank, world, placement="v" if args.zbv else "loop")
    cls = ScheduleZBVZeroBubble if args.zbv else ScheduleInterleaved1F1B
    schedule = cls(pipe.stages, n_microbatches=4, loss_fn=spec.loss_fn)
    opt = torch.optim.AdamW(pipe.parameters(), lr=3e-3)

    for step in range(args.steps):
        (x,), y = spec.make_batch(8, seed=step)
        opt.zero_grad()
        losses: list[torch.Tensor] = []
        if pipe.first:
            schedule.step(*pipe.inputs(x), target=y, losses=losses)
        else:
            schedule.step(target=y, losses=losses)
        pipe.sync_tied_grads()  # wte.weight / lm_head.weight: one parameter on two ranks
        opt.step()
        if pipe.last:
            print(f"rank {rank} step {step}: loss {sum(float(v) for v in losses) / len(losses):.4f}",
                  flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
