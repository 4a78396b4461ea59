"""A torchrun job for the re-partitioning tests: trains test_runtime_repartition's model under the
plan given on the command line (cuts, replicas: one process per stage replica).

    python -m torch.distributed.run --nproc-per-node N repartition_job.py OUT.pt --ckpt DIR \
        --cuts 5 --replicas 1,1 [--crash-after K] [--resume]

``--crash-after K`` kills every process hard (os._exit) right after the K-th checkpoint is
complete; rank 0 saves the trained state dict and the history to OUT.pt at the end.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from test_runtime_repartition import EPOCHS, M, adamw, data, lambda_lr, stages

from fxpipe.runtime.training.trainer import Trainer


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--ckpt", required=True)
    p.add_argument("--cuts", type=_ints, default=[])
    p.add_argument("--replicas", type=_ints, required=True)
    p.add_argument("--crash-after", type=int, default=None)
    p.add_argument("--resume", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(1)
    done: list[tuple[int, int]] = []

    def crash(epoch: int, pos: int) -> None:
        done.append((epoch, pos))
        if len(done) == args.crash_after:
            sys.stdout.flush()
            os._exit(3)

    trainer = Trainer(stages(args.cuts), args.replicas, F.mse_loss, adamw, lr_scheduler=lambda_lr,
                      schedule="1f1b-flush", microbatches=M, checkpoint_dir=args.ckpt,
                      checkpoint_every=M, executor="distributed", timeout_s=30, progress=False,
                      on_checkpoint=crash if args.crash_after else None)
    history = trainer.fit(data(), epochs=EPOCHS, resume=args.resume)
    state = trainer.state_dict()
    if int(os.environ.get("RANK", "0")) == 0:
        torch.save({"state": state, "history": history}, Path(args.out))
    trainer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
