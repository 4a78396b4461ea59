"""A training script for the Trainer tests, run by torchrun (every rank) or in one process.

    python trainer_job.py OUT.pt --ckpt DIR [--crash-after 2] [--resume] [--executor reference]

Trains a 3-stage-cut MLP with dropout (2 stages, replicas [1, 1]) for 2 epochs of 7 minibatches,
SGD with momentum and a linear warm-up stepped after every update, checkpoints every 2
minibatches. ``--crash-after N`` kills the process hard (os._exit, like a crash) right after the
N-th checkpoint completes; rank 0 writes the trained state dict, the history and how often the
trainer gathered to rank 0 (during fit, then in state_dict()) to OUT.pt at the end.
``--rank-data``: each rank gets a loader seeded by its rank (a mistake the trainer must catch).
``--stages S --replicas R``: S stages (cut evenly), R replicas each; with ``--schedule localsgd``
R copies averaged every ``--average-every`` H updates, checkpoints every R x H minibatches.
``--dropout P``: the model's dropout rate. ``--optimizer adamw``: AdamW (lr 0.01, weight decay
0.1); ``--shard optimizer``: its state sharded over each stage's replicas (ZeRO-1).
``--pilot N`` (with ``--schedule auto``): a pilot of N minibatches (every rank trains its share of
the candidates; ``--where pipeline``: the candidates in turn on this job's pipeline, with no copy
of any stage allowed; ``--look-again K``: auto's second look, ``--samples N``: a longer epoch for
it); OUT.pt then holds auto's decision too. ``--optimizer muon``: the ``"muon"``
recipe (Muon on the 2-D weights, AdamW on the biases) in place of SGD. ``--no-close``: ends
without ``trainer.close()`` and prints, at exit, whether the process group is still open.
"""
from __future__ import annotations

import argparse
import functools
import os
import sys
from pathlib import Path

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from fxpipe.codegen.split import placed_nodes, split_graph
from fxpipe.runtime.training.data import ShardedDataset
from fxpipe.runtime.training.recipes import OptimizerRecipe
from fxpipe.runtime.training.trainer import Trainer


def model(dropout: float = 0.2) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Dropout(dropout), nn.Linear(8, 8),
                         nn.Tanh(), nn.Linear(8, 2))


def stages(cut: int = 3, num_stages: int = 2, dropout: float = 0.2) -> list:
    """2 stages cut after node ``cut``, or ``num_stages`` (up to 6) cut evenly."""
    gm = fx.symbolic_trace(model(dropout))
    nodes = placed_nodes(gm)
    if num_stages == 2:
        return split_graph(gm, {n.name: int(i > cut) for i, n in enumerate(nodes)})
    return split_graph(gm, {n.name: min(max(i - 1, 0) * num_stages // (len(nodes) - 1),
                                        num_stages - 1) for i, n in enumerate(nodes)})


def dataset(samples: int = 28) -> ShardedDataset:
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(samples, 4, generator=g), torch.randn(samples, 2, generator=g)
    return ShardedDataset(x, y, batch_size=4, seed=3)


def rank_data() -> list:
    """A plain loader that differs by rank (as if each rank had drawn its own shard)."""
    g = torch.Generator().manual_seed(100 + int(os.environ.get("RANK", "0")))
    return [(torch.randn(4, 4, generator=g), torch.randn(4, 2, generator=g)) for _ in range(6)]


def warmup(step: int) -> float:
    return min(1.0, (step + 1) / 4)


def make_trainer(args: argparse.Namespace, on_checkpoint=None) -> Trainer:
    optimizer = (OptimizerRecipe("muon", 0.02, weight_decay=0.1) if args.optimizer == "muon"
                 else functools.partial(torch.optim.AdamW, lr=0.01, weight_decay=0.1)
                 if args.optimizer == "adamw"
                 else functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9))
    local = args.schedule == "localsgd"
    return Trainer(stages(num_stages=args.stages, dropout=args.dropout),
                   [args.replicas] * args.stages, F.mse_loss, optimizer,
                   lr_scheduler=functools.partial(torch.optim.lr_scheduler.LambdaLR,
                                                  lr_lambda=warmup),
                   schedule=args.schedule, checkpoint_dir=args.ckpt,
                   executor=args.executor, timeout_s=30, progress=False,
                   on_checkpoint=on_checkpoint, timeline=args.timeline,
                   average_every=args.average_every if local else None, shard=args.shard,
                   checkpoint_every=args.replicas * args.average_every if local else 2,
                   auto_options=None if args.pilot is None else
                   {"pilot": args.pilot, "min_pilot": 4, "max_fraction": 1.0, "max_cost": None,
                    "where": args.where, "look_again": args.look_again})


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--ckpt", required=True)
    p.add_argument("--crash-after", type=int, default=None)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--executor", default="distributed")
    p.add_argument("--schedule", default="pipedream")
    p.add_argument("--timeline", action="store_true", help="record; save per-segment counts")
    p.add_argument("--stages", type=int, default=2, help="stages of the pipeline")
    p.add_argument("--replicas", type=int, default=1, help="replicas of every stage")
    p.add_argument("--average-every", type=int, default=2, help="LocalSGD's H")
    p.add_argument("--dropout", type=float, default=0.2, help="the model's dropout rate")
    p.add_argument("--rank-data", action="store_true", help="a loader that differs by rank")
    p.add_argument("--pilot", type=int, default=None, help="auto's pilot length")
    p.add_argument("--optimizer", default="sgd", choices=["sgd", "muon", "adamw"])
    p.add_argument("--shard", default=None, choices=["optimizer"],
                   help="each replicated stage's optimizer state split over its replicas")
    p.add_argument("--samples", type=int, default=28, help="samples per epoch (4 a minibatch)")
    p.add_argument("--look-again", type=float, default=2.0, help="auto's second look")
    p.add_argument("--no-close", action="store_true",
                   help="end without trainer.close(), as the README's script does; at exit, "
                        "print whether the process group is still open")
    p.add_argument("--where", default="copies", choices=["copies", "pipeline"],
                   help="auto's pilot: on copies of the model, or on the job's pipeline (then "
                   "any copy of the stages for a pilot is an error)")
    args = p.parse_args()
    if args.where == "pipeline":
        from fxpipe.runtime.training import auto_pilot

        def no_copies(*a, **kw):
            raise AssertionError("the pilot on the pipeline copied the stages")
        auto_pilot.shared_copy = no_copies
    torch.set_num_threads(1)
    done = []

    def crash(epoch: int, pos: int) -> None:
        done.append((epoch, pos))
        if len(done) == args.crash_after:
            sys.stdout.flush()
            os._exit(3)

    if args.no_close:  # runs after fxpipe's own exit hook (atexit is last in, first out)
        import atexit

        import torch.distributed as dist
        atexit.register(lambda: print(f"rank {os.environ.get('RANK')} at exit: process group "
                                      f"{'open' if dist.is_initialized() else 'closed'}",
                                      flush=True))
    trainer = make_trainer(args, crash if args.crash_after else None)
    gathers = [0]
    real_gather = getattr(trainer.backend, "gather", None)
    if real_gather is not None:
        def counted(*a, **kw):
            gathers[0] += 1
            return real_gather(*a, **kw)
        trainer.backend.gather = counted
    data = rank_data() if args.rank_data else dataset(args.samples)
    history = trainer.fit(data, epochs=2, eval_loader=None if args.rank_data else dataset(),
                          resume=args.resume)
    in_fit = gathers[0]
    state = trainer.state_dict()  # collective: every rank; rank 0 gets the whole model
    if int(os.environ.get("RANK", "0")) == 0:
        opt = next(iter(trainer.local.values())).stash.optimizer  # stage 0's first replica
        held = len(getattr(opt, "optim", opt).state)  # its parameters with optimizer state
        counts = [[sum(e.category == c for e in tl) for c in ("forward", "backward")]
                  for tl, _ in trainer.timelines]
        torch.save({"state": state, "history": history, "timelines": counts,
                    "gathers": [in_fit, gathers[0] - in_fit], "auto": trainer.auto_decision,
                    "optimizer_states": held},
                   Path(args.out))
    if not args.no_close:
        trainer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
