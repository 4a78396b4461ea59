"""One host of the emulated-cluster experiment, run under torchrun on every host.

    torchrun --nnodes 2 ... -m bench.experiment.worker --mode fxpipe|straight|mp|ddp \
        --model bigtail --batch 64 --epochs 4 --plan plan.json --out DIR

Every mode trains the same model (bench/experiment/common.py) from the same seed, on the same
fixed digits split, in the same minibatch order (ShardedDataset's seeded permutation), with the
same SGD-momentum optimizer and the same number of samples per weight update (``--batch`` for the
pipeline modes; ``--batch`` per replica for a data-parallel fxpipe plan, whose replicas update
together every round; ddp splits ``--global-batch`` over the ranks):

* fxpipe: the planner's plan (``--plan``, made once by bench.experiment.plan on one core, so
  every rank loads the same one), PipeDream 1F1B schedule;
* straight: the 2-stage x 1-replica plan, 1F1B;
* mp: the same 2-stage plan with one minibatch in flight (gpipe, 1 microbatch per batch);
* flush: the same 2-stage plan, PipeDream-Flush (1f1b-flush, 2 microbatches of --batch/2 per
  update): pipelined, but no weight staleness;
* ddp: torch DistributedDataParallel over gloo (BSP);
* auto: the fxpipe plan with ``schedule="auto"`` (what a user gets by default: a pilot when the run
  is long enough, else 1f1b-flush with each --batch minibatch cut into 2 microbatches, one update
  per minibatch as in the flush mode; pipedream on a one-stage plan).

``--seed`` sets the model's initialisation and the minibatch order (the published run: 0, 1, 2).

Each rank writes OUT/rank<R>.json: per epoch the cumulative training time (evaluation excluded),
wall time since the start, train loss, test accuracy (top-1 over the whole test split with the
latest weights), samples, and its eth0 tx/rx byte counters (read from /sys inside the namespace)
at the end of training and of evaluation, with os.getloadavg().
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from .common import TRAIN_SEED, build_model, digits_split, loadavg, write_json


def net_bytes() -> dict[str, int]:
    out = {}
    for k in ("tx_bytes", "rx_bytes"):
        try:
            out[k] = int(Path(f"/sys/class/net/eth0/statistics/{k}").read_text())
        except OSError:
            out[k] = -1  # not inside an emulated host
    return out


def run_fxpipe(args: argparse.Namespace, rank: int, log: dict) -> None:
    from fxpipe.api import compile as fx_compile
    from fxpipe.costmodel import Cluster
    from fxpipe.passes import Plan
    from fxpipe.runtime.training.data import ShardedDataset

    xtr, ytr, xte, yte = digits_split()
    plan = Plan.load(args.plan)
    # flush: PipeDream-Flush (1F1B, no staleness), each --batch minibatch as 2 microbatches of
    # half the size, one update per minibatch: the same samples per update as the others
    schedule, micro = {"mp": ("gpipe", 1), "flush": ("1f1b-flush", 2),
                       "auto": ("auto", None)}.get(args.mode, ("pipedream", None))
    batch = args.batch // (micro or 1)
    # device="CPU": the plan is given, so skip measuring costs again on every rank
    compiled = fx_compile(build_model(args.model, args.seed), Cluster(workers=2, device="CPU"),
                          example_inputs=(xtr[:batch],), loss_fn=F.cross_entropy, plan=plan)
    lr, mom = args.lr, args.momentum
    # timeline=True: how long this rank's forwards, backwards and updates really took, to
    # compare with the profile the plan was made from
    trainer = compiled.trainer(optimizer=lambda ps: torch.optim.SGD(ps, lr=lr, momentum=mom),
                               schedule=schedule, microbatches=micro, timeout_s=300,
                               seed=args.seed, progress=False, timeline=True)
    train = ShardedDataset((xtr,), ytr, batch_size=batch, seed=args.seed, drop_last=True)
    test = ShardedDataset((xte,), yte, batch_size=args.eval_batch, shuffle=False, drop_last=True)
    marks: list[dict] = []
    orig = trainer.evaluate

    def evaluate(loader):  # wrap to split each epoch into training and evaluation
        marks.append({"train_end": time.perf_counter(), "net_train_end": net_bytes()})
        res = orig(loader)
        marks[-1].update(eval_end=time.perf_counter(), net_eval_end=net_bytes(),
                         loadavg=loadavg())
        return res

    trainer.evaluate = evaluate  # type: ignore[method-assign]
    log["replicas"] = list(plan.replicas)
    log["schedule"] = schedule
    log["net_start"] = net_bytes()
    t0 = log["t0"] = time.perf_counter()
    history = trainer.fit(train, epochs=args.epochs, eval_loader=test)
    log["t_end"] = time.perf_counter()
    log["schedule"] = trainer.schedule_name
    if trainer.auto_decision is not None:
        log["auto"] = trainer.auto_decision.summary()
    prev = t0
    train_time = 0.0
    for h, m in zip(history, marks):
        train_time += m["train_end"] - prev
        prev = m["eval_end"]
        log["epochs"].append({"epoch": int(h["epoch"]), "train_time_s": train_time,
                              "wall_s": m["eval_end"] - t0, "loss": h["loss"],
                              "test_accuracy": h.get("eval_accuracy"),
                              "samples": h["samples"], "segment_time_s": h["time_s"],
                              "net_train_end": m["net_train_end"], "net_eval_end": m["net_eval_end"],
                              "loadavg": m["loadavg"]})
    busy: dict[str, float] = {}
    forwards = 0
    for timeline, _ in trainer.timelines[1:]:  # the first segment warms up
        for e in timeline:
            busy[e.category] = busy.get(e.category, 0.0) + e.end - e.start
            forwards += e.category == "forward"
    # this rank's samples in the measured segments (auto may cut each minibatch into
    # trainer.split microbatches: a forward is then batch / split samples)
    n = forwards * batch // trainer.split
    log["busy_s_per_sample"] = {k: v / n for k, v in busy.items()} if n else {}
    log["stage_replica"] = list(trainer.backend.me)
    trainer.close()


def run_ddp(args: argparse.Namespace, rank: int, log: dict) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from fxpipe.runtime.training.data import ShardedDataset

    dist.init_process_group("gloo")
    world = dist.get_world_size()
    xtr, ytr, xte, yte = digits_split()
    G = args.global_batch
    assert G % world == 0
    local = G // world
    model = DDP(build_model(args.model, args.seed))
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    order_src = ShardedDataset((xtr,), ytr, batch_size=G, seed=args.seed, drop_last=True)
    log["replicas"] = [world]
    log["net_start"] = net_bytes()
    dist.barrier()
    t0 = log["t0"] = time.perf_counter()
    train_time = 0.0
    for epoch in range(args.epochs):
        t_ep = time.perf_counter()
        model.train()
        order = order_src.order(epoch)
        loss_sum, n_mb = 0.0, 0
        for k in range(len(order_src)):
            idx = order[k * G:(k + 1) * G][rank * local:(rank + 1) * local]
            loss = F.cross_entropy(model(xtr[idx]), ytr[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()  # DDP all-reduces gradients (bucketed, overlapped with backward)
            opt.step()
            loss_sum += loss.item()
            n_mb += 1
        seg = time.perf_counter() - t_ep
        train_time += time.perf_counter() - t_ep
        net_train_end = net_bytes()
        mean_loss = torch.tensor([loss_sum / max(n_mb, 1)])
        dist.all_reduce(mean_loss)  # tiny; the mean over ranks = loss of the global minibatch
        model.eval()
        with torch.no_grad():  # every rank holds the same weights: evaluate the whole test split
            acc = (model.module(xte).argmax(1) == yte).float().mean().item()
        log["epochs"].append({"epoch": epoch + 1, "train_time_s": train_time,
                              "wall_s": time.perf_counter() - t0,
                              "loss": mean_loss.item() / world, "test_accuracy": acc,
                              "samples": float(n_mb * G), "segment_time_s": seg,
                              "net_train_end": net_train_end, "net_eval_end": net_bytes(),
                              "loadavg": loadavg()})
        if args.stop_at is not None and acc >= args.stop_at:
            break  # identical on every rank (same weights), so all ranks stop together
    log["t_end"] = time.perf_counter()
    dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", required=True,
                   choices=("fxpipe", "straight", "mp", "flush", "ddp", "auto"))
    p.add_argument("--seed", type=int, default=TRAIN_SEED, help="model init and minibatch order")
    p.add_argument("--model", default="bigtail")
    p.add_argument("--plan", help="plan.json (fxpipe, straight, mp)")
    p.add_argument("--batch", type=int, default=64, help="pipeline minibatch (per replica)")
    p.add_argument("--global-batch", type=int, default=64, help="ddp: samples per update")
    p.add_argument("--eval-batch", type=int, default=120)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--lr", type=float, default=0.02)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--stop-at", type=float, default=None, help="ddp: stop once test acc >= this")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    torch.set_num_threads(1)
    rank = int(os.environ.get("RANK", "0"))
    log = {"mode": args.mode, "rank": rank, "args": vars(args), "loadavg_start": loadavg(),
           "epochs": []}
    (run_ddp if args.mode == "ddp" else run_fxpipe)(args, rank, log)
    log["net_end"] = net_bytes()
    log["loadavg_end"] = loadavg()
    write_json(Path(args.out) / f"rank{rank}.json", log)
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
