"""Two stages on two processes: fxpipe's PipeDream runtime against torch.distributed.pipelining.

Run from the repository root:  .venv/bin/python -m bench.runtime_vs_pipelining
Writes its page benchmarks/runtime_vs_pipelining.md (``--out FILE`` writes the markdown there
instead).

Same model (a mid-size MLP, 512-4x1024-10), same split (fxpipe's 2-stage plan: the pipelining
stages wrap the very stage GraphModules fxpipe produced), same initial weights, same minibatches
(batch 32, a fixed teacher-labelled set of 16 minibatches, cycled), same optimizer (SGD lr 0.01,
momentum 0.9, one step per minibatch of 32 samples), gloo on 127.0.0.1, one thread per process:

* fxpipe: ``run_distributed`` with the ``pipedream`` schedule (async 1F1B, weight stashing, no
  flush); one update per minibatch.
* ``torch.distributed.pipelining``: ``PipelineStage`` + ``Schedule1F1B`` / ``ScheduleGPipe``; each
  ``step`` splits the minibatch into m microbatches, flushes the pipeline and the optimizer steps
  once (gradients averaged over the microbatches: the same update a 32-sample minibatch gives).
  m is chosen per schedule by a short sweep over --microbatches (best steady-state samples/s).

Reported: steady-state samples/s (completion times of minibatches --warmup..N-1 on the input
stage), and time to a target training loss (running mean of the last 16 minibatch losses, i.e.
one pass over the data), timed from a barrier after the process group is up, so process start-up
is excluded for both. Rounds interleave the three configurations (order rotating) and repeat.
"""
from __future__ import annotations

import argparse
import copy
import logging
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from bench import runtime_common as rc
from bench._report import publish
import fxpipe
from fxpipe.runtime.execution.launch import free_port, run_distributed
from fxpipe.runtime.schedules.kinds import make_schedule

log = logging.getLogger("runtime_vs_pipelining")
SECTION = "runtime_vs_pipelining"
BATCH = 32
POOL = 16
LR = 0.01


class StageModule(nn.Module):
    """An fxpipe stage GraphModule as a pipelining submodule: one input, one output tensor."""

    def __init__(self, gm: nn.Module) -> None:
        super().__init__()
        self.gm = gm

    def forward(self, *xs: torch.Tensor) -> torch.Tensor:
        out = self.gm(*xs)
        return out[0] if isinstance(out, tuple) and len(out) == 1 else out


def pp_worker(rank: int, outdir: str, port: int, gms: list, batches: list,
              cfgs: list[tuple[str, int, int]]) -> None:
    """One rank of torch.distributed.pipelining; runs every (schedule, m, n) in ``cfgs`` in turn,
    each from the same initial weights."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=2)
        results = []
        for kind, m, n in cfgs:
            mod = StageModule(copy.deepcopy(gms[rank]))
            mod.train()
            stage = PipelineStage(mod, rank, 2, torch.device("cpu"))
            sched_cls = Schedule1F1B if kind == "1f1b" else ScheduleGPipe
            sched = sched_cls(stage, n_microbatches=m, loss_fn=rc.cross_entropy)
            opt = rc.sgd(list(mod.parameters()), lr=LR)
            done, losses = [], []
            dist.barrier()
            t0 = time.perf_counter()
            for x, y in batches[:n]:
                opt.zero_grad(set_to_none=True)
                if rank == 0:
                    sched.step(x)
                else:
                    ls: list = []
                    sched.step(target=y, losses=ls)
                    losses.append(sum(float(v.detach()) for v in ls) / len(ls))
                opt.step()
                done.append(time.perf_counter() - t0)
            results.append({"kind": kind, "m": m, "done_at": done, "losses": losses})
            dist.barrier()
        dist.destroy_process_group()
        torch.save(results, Path(outdir) / f"rank{rank}.pt")
    except BaseException as err:  # noqa: BLE001
        rc.write_error(outdir, rank, err)
        raise


def run_pipelining(gms: list, batches: list, cfgs: list[tuple[str, int, int]]) -> list[dict]:
    r0, r1 = rc.spawn_and_collect(pp_worker, 2, (free_port(), gms, batches, cfgs))
    return [{**a, "losses": b["losses"]} for a, b in zip(r0, r1)]


def run_fxpipe(specs, batches) -> dict:
    sched = make_schedule("pipedream", [1, 1], len(batches))
    res = run_distributed(specs, [1, 1], sched, rc.cross_entropy, rc.sgd_factory(LR), batches,
                          timeout_s=120.0)
    # time origin: the input stage's first forward, as pipelining's is its first step (both
    # exclude their set-up; fxpipe's set-up after the rendezvous barrier is reported apart)
    first = rc.fxpipe_first_forward(res.timeline, rank=0)
    return {"done_at": [t - first for t in rc.fxpipe_done_at(res.timeline, rank=0)],
            "losses": res.losses, "setup": first}


def run_baseline(root: str, plan_path: str, n: int) -> dict:
    """fxpipe pipedream as another checkout runs it (``root``, with its own ``.venv`` and a copy
    of this script), on the same plan and minibatches: the side-by-side against older code."""
    import json
    import subprocess
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        subprocess.run([str(Path(root) / ".venv" / "bin" / "python"), "-m",
                        "bench.runtime_vs_pipelining", "--fxpipe-only", f.name, "--plan",
                        plan_path, "--minibatches", str(n)], cwd=root, check=True,
                       timeout=900)
        return json.loads(Path(f.name).read_text())


def time_to_target(done_at: list[float], losses: list[float], target: float,
                   window: int = POOL) -> tuple[float, int] | None:
    """(seconds, minibatch) when the running mean of the last ``window`` losses first reaches
    ``target``: the completion time of that minibatch on the input stage."""
    for k in range(window - 1, len(losses)):
        if sum(losses[k - window + 1:k + 1]) / window <= target:
            return done_at[k], k
    return None


def _describe(root: str) -> str:
    """The baseline checkout's commit, for the page."""
    import subprocess

    out = subprocess.run(["git", "-C", root, "log", "-1", "--format=%h"], capture_output=True,
                         text=True)
    return out.stdout.strip() or root


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--minibatches", type=int, default=320, help="N per measured run")
    ap.add_argument("--sweep-minibatches", type=int, default=60)
    ap.add_argument("--microbatches", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--target", type=float, default=0.5, help="target running-mean training loss")
    ap.add_argument("--out", default=None, help="write the markdown here instead of "
                    "benchmarks/runtime_vs_pipelining.md")
    ap.add_argument("--baseline", default=None, metavar="DIR",
                    help="also run fxpipe pipedream from the checkout DIR (its .venv, a copy of "
                    "this script) in every round, on the same plan: old code side by side")
    ap.add_argument("--fxpipe-only", default=None, help=argparse.SUPPRESS)  # a baseline's run
    ap.add_argument("--plan", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(1)
    t_start = time.perf_counter()

    model = rc.mlp()
    pool = rc.teacher_pool((512,), BATCH, POOL)
    plan = fxpipe.Plan.load(args.plan) if args.plan else None
    compiled = fxpipe.compile(model, fxpipe.Cluster(workers=2), example_inputs=(pool[0][0],),
                              loss_fn=rc.cross_entropy, stages=2, straight=True, plan=plan)
    specs = compiled.stage_specs
    if args.fxpipe_only:  # a baseline checkout's run (see run_baseline)
        import json

        res = run_fxpipe(specs, rc.cycle(pool, args.minibatches))
        Path(args.fxpipe_only).write_text(json.dumps(res))
        return 0
    plan_file = Path(tempfile.mkdtemp(prefix="fxp-rvp-")) / "plan.json"
    compiled.plan.save(plan_file)
    assert len(specs) == 2 and specs[0].outputs and len(specs[1].inputs) == 1, specs
    split = [f"stage {s.index}: {list(compiled.plan.stages[s.index].nodes)[0]}.."
             f"{list(compiled.plan.stages[s.index].nodes)[-1]}" for s in specs]
    gms = [s.gm for s in specs]
    batches = rc.cycle(pool, args.minibatches)

    # 1. sweep m for each pipelining schedule (one world, configs run back to back, twice in
    #    opposite orders; the better median rate wins)
    sweep_cfgs = [(k, m, args.sweep_minibatches) for k in ("1f1b", "gpipe") for m in args.microbatches]
    sweep: dict[tuple[str, int], list[float]] = {}
    for rep in range(2):
        order = sweep_cfgs if rep == 0 else sweep_cfgs[::-1]
        for r in run_pipelining(gms, batches, order):
            sweep.setdefault((r["kind"], r["m"]), []).append(
                rc.steady_rate(r["done_at"], BATCH, args.warmup))
    best = {k: max(args.microbatches, key=lambda m: rc.med(sweep[(k, m)])) for k in ("1f1b", "gpipe")}
    log.info("sweep: %s -> best %s", {f"{k}/m={m}": [round(v) for v in vs] for (k, m), vs in sweep.items()}, best)

    # 2. measured rounds: fxpipe, 1F1B at its best m, GPipe at its best m, interleaved
    names = ["fxpipe pipedream", f"pipelining Schedule1F1B (m={best['1f1b']})",
             f"pipelining ScheduleGPipe (m={best['gpipe']})"]
    if args.baseline:
        names.append(f"fxpipe pipedream, baseline {_describe(args.baseline)}")
    rate: dict[str, list[float]] = {n: [] for n in names}
    ttt: dict[str, list[float]] = {n: [] for n in names}
    tt_mb: dict[str, list[int]] = {n: [] for n in names}
    final: dict[str, list[float]] = {n: [] for n in names}
    ratio: dict[str, list[float]] = {n: [] for n in names[1:]}
    setup: list[float] = []
    n = args.minibatches
    for rnd in range(args.rounds):
        got: dict[str, dict] = {}
        pp_cfgs = [("1f1b", best["1f1b"], n), ("gpipe", best["gpipe"], n)]
        if rnd % 2:
            pp_cfgs.reverse()
        steps = ["fx", "pp"] if rnd % 2 == 0 else ["pp", "fx"]
        if args.baseline:
            steps.insert(rnd % 3, "base")
        for s in steps:
            if s == "base":
                got[names[3]] = run_baseline(args.baseline, str(plan_file), n)
            elif s == "fx":
                got[names[0]] = run_fxpipe(specs, batches)
            else:
                for r in run_pipelining(gms, batches, pp_cfgs):
                    got[names[1] if r["kind"] == "1f1b" else names[2]] = r
        for name, r in got.items():
            rate[name].append(rc.steady_rate(r["done_at"], BATCH, args.warmup))
            hit = time_to_target(r["done_at"], r["losses"], args.target)
            ttt[name].append(hit[0] if hit else float("inf"))
            tt_mb[name].append(hit[1] if hit else -1)
            final[name].append(sum(r["losses"][-POOL:]) / POOL)
        setup.append(got[names[0]]["setup"])
        for name in names[1:]:
            ratio[name].append(rate[names[0]][-1] / rate[name][-1])
        log.info("round %d: %s", rnd, {k: (round(rate[k][-1]), round(ttt[k][-1], 2), tt_mb[k][-1])
                                       for k in names})
    elapsed = time.perf_counter() - t_start

    cmd = f"{rc.PY} -m bench.runtime_vs_pipelining" + "".join(
        f" --{k.replace('_', '-')} {v}" for k, v in
        dict(rounds=args.rounds, minibatches=args.minibatches, target=args.target,
             baseline=args.baseline).items()
        if v != ap.get_default(k))
    rows = []
    for name in names:
        rr = " / ".join(f"{v:.2f}" for v in ratio[name]) if name in ratio else "1"
        ratio_cell = (f"**{rc.spread(ratio[name], '{:.2f}')}**x" if name in ratio else "-")
        tt_ok = [v for v in ttt[name] if v != float("inf")]
        tt_cell = (rc.spread(tt_ok, "{:.2f}") + " s" if len(tt_ok) == len(ttt[name])
                   else f"not reached in {len(ttt[name]) - len(tt_ok)} of {len(ttt[name])} rounds"
                   + (f"; {rc.spread(tt_ok, '{:.2f}')} s" if tt_ok else ""))
        tt_ratio = ""
        if name in ratio and all(v != float("inf") for v in ttt[name] + ttt[names[0]]):
            tt_ratio = rc.spread([b / a for a, b in zip(ttt[names[0]], ttt[name])], "{:.2f}") + "x"
        rows.append(f"| {name} | {rc.spread(rate[name], '{:.0f}')} | {ratio_cell} | {tt_cell} | "
                    f"{tt_ratio or '-'} | {rc.spread(tt_mb[name], '{:.0f}')} | "
                    f"{rc.spread(final[name], '{:.3f}')} |")
        del rr
    sweep_rows = [f"| {k} | {m} | {rc.spread(sweep[(k, m)], '{:.0f}')} |"
                  for k in ("1f1b", "gpipe") for m in args.microbatches]
    md = "\n".join([
        "## Two stages on two processes: fxpipe against torch.distributed.pipelining",
        "",
        f"Command: `{cmd}` (from the repository root; {rc.machine()}; gloo on 127.0.0.1; "
        f"{args.rounds} measured rounds interleaved; {elapsed:.0f} s in all)",
        "",
        f"Model: MLP 512-4x1024-10 (3.7M parameters), split by `fxpipe.compile(..., "
        f"Cluster(workers=2), stages=2, straight=True)` ({'; '.join(split)}); the pipelining "
        "stages wrap the same stage GraphModules. Batch 32 per optimizer step for everyone (fxpipe: "
        "one minibatch of 32 per update, no flush; pipelining: the 32 split into m microbatches, "
        f"flush, one step). SGD lr {LR}, momentum 0.9; {args.minibatches} minibatches per run (16 "
        "distinct teacher-labelled minibatches, cycled), same initial weights. Samples/s: steady "
        f"state, minibatches {args.warmup}..N-1 on the input stage. Time to target: seconds from "
        "the first minibatch's start (fxpipe: its input stage's first forward on the runtime's timeline; pipelining: the first `step`, after a barrier) until the running mean of the last 16 minibatch losses is "
        f"<= {args.target} (excludes process start-up and set-up for both).",
        "",
        "| configuration | samples/s | fxpipe speed-up (samples/s) | time to target loss | "
        "its time / fxpipe's | minibatch reaching target | final loss (last 16) |",
        "|---|---:|---:|---:|---:|---:|---:|",
        *rows,
        "",
        *([f"The baseline row is fxpipe pipedream as the checkout of commit "
           f"{_describe(args.baseline)} runs it, in the same rounds, on the same plan and "
           "minibatches: its speed-up column is this code's samples/s over the baseline's.", ""]
          if args.baseline else []),
        "Cells: median [min-max] over the rounds; ratios are per round. Set-up not counted above: "
        f"fxpipe's input-stage rank spent {rc.spread(setup, '{:.2f}')} s between the runtime's "
        "post-rendezvous barrier (its timeline's zero) and its first forward (building the "
        "stage replica and optimizer; in a fresh process the first `torch.optim` optimizer "
        "imports `torch._dynamo`); the pipelining processes build stage, schedule and optimizer "
        "before their barrier. Microbatch sweep "
        f"({args.sweep_minibatches} minibatches per run, 2 runs in opposite orders, samples/s):",
        "",
        "| schedule | m | samples/s |",
        "|---|---:|---:|",
        *sweep_rows,
    ])
    publish(SECTION, md, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
