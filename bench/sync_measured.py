"""Synchronous schedules measured on processes: fxpipe's zero-bubble kinds against 1F1B-flush,
pipedream, and torch.distributed.pipelining's own schedules on fxpipe's split.

Run from the repository root:  .venv/bin/python -m bench.sync_measured
Writes its page benchmarks/sync-measured.md (``--out FILE`` writes the markdown there instead).

For S = 2 and 4 ranks (gloo on 127.0.0.1, one thread per process) and two models:

* balanced: an MLP of 8 equal blocks (Linear 512-512 + ReLU) and a classifier, which
  ``fxpipe.compile(..., stages=k, straight=True)`` cuts into equal stages;
* unbalanced: the same with block 2 replaced by a 512-2048-512 bottleneck (8x a block's work):
  no cut balances it, the stage holding it is the bottleneck.

Every configuration trains the same minibatches (microbatches of ``--batch`` samples, m = 2S per
update, SGD lr 0.01 momentum 0.9) from the same weights:

* fxpipe ``1f1b-flush``, ``zb-h1``, ``zb-h2`` (S stages, one update per m microbatches, the W's
  placed as the trainer places them: unit costs) and ``pipedream`` (one update per microbatch);
  fxpipe's own ``interleaved-1f1b`` and ``zb-v`` on the 2S-stage split, 2 stages per rank
  (``fxpipe.runtime.execution.hosted``, unit costs);
* torch ``Schedule1F1B`` on the same S stages, and ``ScheduleInterleaved1F1B``,
  ``ScheduleInterleavedZeroBubble`` (2 stages per rank, round robin) and
  ``ScheduleZBVZeroBubble`` (2 per rank, V placement) on fxpipe's 2S-stage split
  (``torch_stages``), one step per m microbatches.

Reported: steady-state samples/s on rank 0 (updates ``--warmup``..N-1), median [min-max] over
rounds that interleave the configurations in rotating order, and each one's ratio to
``1f1b-flush`` in the same round. The machine has 2 cores: 4 ranks share them, so the S = 4 rows
measure the schedules' overheads and ordering under oversubscription, not a 4-GPU pipeline.
"""
from __future__ import annotations

import argparse
import copy
import logging
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from bench import runtime_common as rc
from bench._report import publish
import fxpipe
from fxpipe.runtime.execution.launch import free_port, run_distributed
from fxpipe.runtime.schedules.placement import make_placed_schedule
from fxpipe.runtime.schedules.kinds import make_schedule

log = logging.getLogger("sync_measured")
SECTION = "sync-measured"
LR = 0.01
WIDTH = 512
FX_KINDS = ("1f1b-flush", "zb-h1", "zb-h2", "pipedream", "interleaved-1f1b", "zb-v")
PLACED = ("interleaved-1f1b", "zb-v")  # fxpipe's own 2-stages-per-rank kinds, on the 2S split
TORCH_KINDS = (("Schedule1F1B", 1, "loop"), ("ScheduleInterleaved1F1B", 2, "loop"),
               ("ScheduleInterleavedZeroBubble", 2, "loop"), ("ScheduleZBVZeroBubble", 2, "v"))


def model(unbalanced: bool, seed: int = 0) -> nn.Sequential:
    """8 blocks (block 2 an 8x bottleneck when ``unbalanced``) and a 10-way classifier."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        layers: list[nn.Module] = []
        for i in range(8):
            if unbalanced and i == 2:
                layers += [nn.Linear(WIDTH, 4 * WIDTH), nn.ReLU(), nn.Linear(4 * WIDTH, WIDTH)]
            else:
                layers.append(nn.Linear(WIDTH, WIDTH))
            layers.append(nn.ReLU())
        layers.append(nn.Linear(WIDTH, 10))
        return nn.Sequential(*layers)


def split(net: nn.Module, example: torch.Tensor, stages: int) -> Any:
    """fxpipe's straight cut into ``stages`` (planned for one worker per stage)."""
    return fxpipe.compile(copy.deepcopy(net), fxpipe.Cluster(workers=stages),
                          example_inputs=(example,), loss_fn=rc.cross_entropy, stages=stages,
                          straight=True)


def fx_run(specs: list, kind: str, m: int, updates: int, pool: list) -> dict[str, Any]:
    """One fxpipe run; the placed kinds get the 2S-stage split and run 2 stages per rank
    (timeline index 0 is then stage 0, on rank 0)."""
    n = updates * m
    if kind in PLACED:
        sched: Any = make_placed_schedule(kind, len(specs) // 2, n, num_stages=len(specs),
                                          microbatches=m)
    else:
        sched = make_schedule(kind, [1] * len(specs), n,
                              microbatches=None if kind == "pipedream" else m)
    res = run_distributed(specs, [1] * len(specs), sched, rc.cross_entropy, rc.sgd_factory(LR),
                          rc.cycle(pool, n), timeout_s=180.0)
    done = rc.fxpipe_done_at(res.timeline, rank=0)  # one entry per update
    return {"done_at": done, "per_update": 1 if kind == "pipedream" else m,
            "loss": sum(res.losses[-m:]) / m}


def torch_worker(rank: int, outdir: str, port: int, ranks: int, cases: list[dict[str, Any]],
                 pool: list, m: int, updates: int) -> None:
    """One rank: every torch schedule in ``cases`` in turn, each from the compiled weights."""
    from torch.distributed import pipelining as tp

    from fxpipe.runtime.execution.torch_pipelining import torch_stages
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=ranks)
        out = []
        for case in cases:
            pipe = torch_stages(case["specs"], rank, ranks, placement=case["placement"])
            cls = getattr(tp, case["schedule"])
            sched = cls(pipe.stages if cls.__name__ not in ("Schedule1F1B", "ScheduleGPipe")
                        else pipe.stages[0], n_microbatches=m, loss_fn=rc.cross_entropy)
            opt = rc.sgd(list(pipe.parameters()), lr=LR)
            done: list[float] = []
            losses: list[float] = []
            dist.barrier()
            t0 = time.perf_counter()
            for k in range(updates):
                mbs = [pool[(k * m + i) % len(pool)] for i in range(m)]
                x = torch.cat([b[0] for b in mbs])
                y = torch.cat([b[1] for b in mbs])
                opt.zero_grad(set_to_none=True)
                ls: list[torch.Tensor] = []
                if pipe.first:
                    sched.step(*pipe.inputs(x), target=y, losses=ls)
                else:
                    sched.step(target=y, losses=ls)
                pipe.sync_tied_grads()
                opt.step()
                done.append(time.perf_counter() - t0)
                if ls:
                    losses.append(sum(float(v.detach()) for v in ls) / len(ls))
            out.append({"name": case["schedule"], "done_at": done, "losses": losses})
            dist.barrier()
        dist.destroy_process_group()
        torch.save(out, Path(outdir) / f"rank{rank}.pt")
    except BaseException as err:  # noqa: BLE001 - reported by spawn_and_collect
        rc.write_error(outdir, rank, err)
        raise


def torch_runs(cases: list[dict[str, Any]], ranks: int, pool: list, m: int, updates: int
               ) -> dict[str, dict[str, Any]]:
    per_rank = rc.spawn_and_collect(torch_worker, ranks, (free_port(), ranks, cases, pool, m,
                                                          updates), timeout_s=900.0)
    got: dict[str, dict[str, Any]] = {}
    for i, r0 in enumerate(per_rank[0]):
        losses = next((r[i]["losses"] for r in per_rank if r[i]["losses"]), [])
        got[r0["name"]] = {"done_at": r0["done_at"], "per_update": m,
                           "loss": losses[-1] if losses else float("nan")}
    return got


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--updates", type=int, default=14, help="optimizer updates per run")
    ap.add_argument("--warmup", type=int, default=3, help="updates left out of the rate")
    ap.add_argument("--batch", type=int, default=16, help="samples per microbatch")
    ap.add_argument("--out", default=None, help="write the markdown here instead of "
                    "benchmarks/sync-measured.md")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(1)
    t_start = time.perf_counter()
    pool = rc.teacher_pool((WIDTH,), args.batch, 16)
    rows: list[str] = []
    for unbalanced in (False, True):
        net = model(unbalanced)
        for ranks in args.ranks:
            m = 2 * ranks
            plain = split(net, pool[0][0], ranks)
            double = split(net, pool[0][0], 2 * ranks)
            cuts = [len(s.nodes) for s in plain.plan.stages]
            cases = [{"schedule": name, "placement": placement,
                      "specs": plain.stage_specs if per == 1 else double.stage_specs}
                     for name, per, placement in TORCH_KINDS]
            names = [f"fxpipe {k}" for k in FX_KINDS] + [f"torch {c['schedule']}" for c in cases]
            rate: dict[str, list[float]] = {n: [] for n in names}
            ratio: dict[str, list[float]] = {n: [] for n in names}
            loss: dict[str, list[float]] = {n: [] for n in names}
            for rnd in range(args.rounds):
                got: dict[str, dict[str, Any]] = {}
                order = list(FX_KINDS) + ["torch"]
                order = order[rnd % len(order):] + order[:rnd % len(order)]
                if rnd % 2:
                    order.reverse()
                for what in order:
                    if what == "torch":
                        for k, v in torch_runs(cases, ranks, pool, m, args.updates).items():
                            got[f"torch {k}"] = v
                    else:
                        specs = double.stage_specs if what in PLACED else plain.stage_specs
                        got[f"fxpipe {what}"] = fx_run(specs, what, m, args.updates, pool)
                for name, r in got.items():
                    samples = r["per_update"] * args.batch
                    warm = args.warmup * (m if r["per_update"] == 1 else 1)
                    rate[name].append(rc.steady_rate(r["done_at"], samples, warm))
                    loss[name].append(r["loss"])
                for name in names:
                    ratio[name].append(rate[name][-1] / rate["fxpipe 1f1b-flush"][-1])
                log.info("%s S=%d round %d: %s", "unbalanced" if unbalanced else "balanced",
                         ranks, rnd, {k: round(v[-1]) for k, v in rate.items()})
            for name in names:
                rows.append(f"| {'unbalanced' if unbalanced else 'balanced'} | {ranks} | "
                            f"{cuts} | {name} | {rc.spread(rate[name], '{:.0f}')} | "
                            f"{rc.spread(ratio[name], '{:.2f}')} | "
                            f"{rc.spread(loss[name], '{:.3f}')} |")
    elapsed = time.perf_counter() - t_start
    cmd = f"{rc.PY} -m bench.sync_measured" + "".join(
        f" --{k} {' '.join(map(str, v)) if isinstance(v, list) else v}"
        for k, v in dict(ranks=args.ranks, rounds=args.rounds, updates=args.updates,
                         warmup=args.warmup, batch=args.batch).items() if v != ap.get_default(k))
    md = "\n".join([
        "## Synchronous schedules measured on processes (zero-bubble, interleaved, torch's own)",
        "",
        f"Command: `{cmd}` (from the repository root; {rc.machine()}; gloo on 127.0.0.1; "
        f"{args.rounds} rounds, configurations interleaved in rotating order; "
        f"{elapsed:.0f} s in all)",
        "",
        f"Models: 8 blocks Linear {WIDTH}-{WIDTH} + ReLU and a classifier (balanced), or the same "
        f"with block 2 a {WIDTH}-{4 * WIDTH}-{WIDTH} bottleneck (unbalanced); cut by "
        "`fxpipe.compile(..., stages=S, straight=True)` (nodes per stage in the table) and, for "
        "torch's 2-stages-per-rank schedules, `stages=2S`. Microbatches of "
        f"{args.batch} samples, m = 2S per update (pipedream: an update per microbatch), SGD lr "
        f"{LR} momentum 0.9, {args.updates} updates per run, rate over updates "
        f"{args.warmup}..N-1 on rank 0. fxpipe's zero-bubble kinds place W's as the trainer "
        "does (unit costs). Ratio: samples/s over fxpipe 1f1b-flush's in the same round. "
        "Loss: mean training loss of the last update (a sanity check: the synchronous rows "
        "train the same minibatches with the same semantics).",
        "",
        "| model | ranks | nodes per stage | schedule | samples/s | / 1f1b-flush | last loss |",
        "|---|---:|---|---|---:|---:|---:|",
        *rows,
        "",
        "Cells: median [min-max] over the rounds. 2 CPU cores: at 4 ranks the processes share "
        "them, so a schedule's idle slots are partly filled by another rank's work; the ratios "
        "at 4 ranks understate what a bubble costs on 4 dedicated devices.",
    ])
    publish(SECTION, md, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
