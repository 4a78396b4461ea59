"""Do no harm on small models: the plan with the runtime's overheads priced against the plan
without them, both measured against one plain PyTorch process.

Run from the repository root:  .venv/bin/python -m bench.overhead_harm
Writes its page benchmarks/overhead-harm.md (``--out FILE`` writes the markdown there instead).

Why: a model whose stages compute for about as long as the runtime's messages cost gains
nothing from a pipeline, and the cost model without the overheads (the nodes' times alone) cuts
it in two all the same, since half the compute is always less than all of it. With the overheads
priced (``fxpipe.costmodel.overheads``, measured once per machine), a plan of several stages must
beat one stage priced the same way (``fxpipe.passes.partition``).

For each model ``fxpipe.compile(model, Cluster(workers=2), straight=True)`` profiles it once;
the plan it picks (overheads on) and the plan the same profile gives with them off
(``choose_plan`` on the profile without them) are each trained for N minibatches through
``run_distributed`` (pipedream, one process per stage, gloo), beside a plain PyTorch loop in
this process (forward, loss, backward, SGD step; one thread, the ranks' malloc tuning),
interleaved over the rounds. Samples/s in steady state (the input stage's update ends,
``runtime_common.fxpipe_done_at``; the loop's own step times).
"""
from __future__ import annotations

import argparse
import logging
import time
from dataclasses import replace

import torch
from torch import nn

from bench import runtime_common as rc
from bench._report import publish
import fxpipe
import fxpipe.models
from fxpipe.api import choose_plan, stage_assignment
from fxpipe.codegen import split_graph
from fxpipe.costmodel.overheads import Overheads, with_overheads
from fxpipe.host_memory import keep_freed_memory
from fxpipe.runtime.execution.launch import run_distributed
from fxpipe.runtime.schedules.kinds import make_schedule

log = logging.getLogger("overhead_harm")
SECTION = "overhead-harm"
WARMUP = 20


def models() -> dict[str, tuple[nn.Module, list, object, str]]:
    """name -> (model, minibatch pool, loss, description)."""
    out = {}
    for name, dim, hidden, batch in (("mlp-64", 64, 64, 16), ("mlp-256", 256, 256, 64),
                                     ("mlp-1024", 512, 1024, 32)):
        pool = rc.teacher_pool((dim,), batch, 16)
        out[name] = (rc.mlp(dim, hidden), pool, rc.cross_entropy,
                     f"{name}: MLP {dim}-4x{hidden}-10, batch {batch}")
    spec = fxpipe.models.get("gpt", "mini", batch_size=16)
    pool = [spec.make_batch(16, seed=k) for k in range(16)]
    pool = [((i[0] if isinstance(i, tuple) else i), t) for i, t in pool]
    out["gpt-mini"] = (spec.model, pool, spec.loss_fn,
                       "gpt-mini: the zoo's GPT mini (12 blocks, width 32), batch 16 x 16 tokens")
    return out


def plain_rate(model: nn.Module, loss_fn, batches: list) -> float:
    """Samples/s of a plain training loop (a copy of ``model``)."""
    import copy

    m = copy.deepcopy(model)
    opt = rc.sgd(list(m.parameters()))
    times = []
    for i, (x, y) in enumerate(batches):
        t0 = time.perf_counter()
        loss_fn(m(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= WARMUP:
            times.append(time.perf_counter() - t0)
    return len(batches[0][0]) / rc.med(times)


def pipeline_rate(c, plan, loss_fn, batches: list) -> float:
    specs = split_graph(c.traced.gm, stage_assignment(plan))
    sched = make_schedule("pipedream", plan.replicas, len(batches))
    res = run_distributed(specs, plan.replicas, sched, loss_fn, rc.sgd, batches, timeout_s=120.0)
    return rc.steady_rate(rc.fxpipe_done_at(res.timeline), len(batches[0][0]), WARMUP)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--minibatches", type=int, default=200)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(1)
    keep_freed_memory()
    t_start = time.perf_counter()
    cases = {}
    for name, (model, pool, loss_fn, descr) in models().items():
        batches = rc.cycle(pool, args.minibatches)
        cluster = fxpipe.Cluster(workers=2)
        c = fxpipe.compile(model, cluster, example_inputs=(pool[0][0],), loss_fn=loss_fn,
                           straight=True)
        bare = choose_plan(replace(c.profile, meta=with_overheads(c.profile.meta,
                                                                  Overheads(source="off"))),
                           cluster, straight=True)
        cases[name] = dict(c=c, bare=bare, model=model, loss=loss_fn, batches=batches,
                           descr=descr, got={"plain": [], "with": [], "without": []})
    for rnd in range(args.rounds):
        for name, k in (cases.items() if rnd % 2 == 0 else reversed(list(cases.items()))):
            k["got"]["plain"].append(plain_rate(k["model"], k["loss"], k["batches"]))
            k["got"]["with"].append(pipeline_rate(k["c"], k["c"].plan, k["loss"], k["batches"]))
            k["got"]["without"].append(pipeline_rate(k["c"], k["bare"], k["loss"], k["batches"]))
            log.info("round %d %s: %s", rnd, name, {x: round(v[-1]) for x, v in k["got"].items()})
    elapsed = time.perf_counter() - t_start
    ov = next(iter(cases.values()))["c"].profile.overheads
    rows = []
    for name, k in cases.items():
        g = k["got"]
        ratio = {x: [a / b for a, b in zip(g[x], g["plain"])] for x in ("with", "without")}
        p, b = k["c"].plan, k["bare"]
        rows.append(
            f"| {name} | {len(b.stages)} ({b.time_per_minibatch * 1e3:.2f} ms) | "
            f"{rc.spread(ratio['without'], '{:.2f}')} | {len(p.stages)} "
            f"({p.time_per_minibatch * 1e3:.2f} ms) | **{rc.spread(ratio['with'], '{:.2f}')}** | "
            f"{rc.spread(g['plain'], '{:.0f}')} |")
    cmd = f"{rc.PY} -m bench.overhead_harm" + (
        f" --rounds {args.rounds}" if args.rounds != 3 else "") + (
        f" --minibatches {args.minibatches}" if args.minibatches != 200 else "")
    md = "\n".join([
        "## Do no harm on small models: the runtime's overheads in the plan",
        "",
        f"Command: `{cmd}` (from the repository root; {rc.machine()}; {args.rounds} rounds, the "
        f"runs interleaved; {elapsed:.0f} s in all)",
        "",
        "Models: " + "; ".join(k["descr"] for k in cases.values()) + ". Two workers, one per "
        "stage (`fxpipe.compile(model, Cluster(workers=2), straight=True)`), SGD lr 0.01 "
        f"momentum 0.9, {args.minibatches} minibatches per run, pipedream through "
        "`run_distributed`. The overheads priced: "
        f"{ov.action_s * 1e3:.2f} ms per stage and minibatch, {ov.tensor_s * 1e6:.1f} us per "
        f"parameter tensor, {ov.message_s * 1e3:.2f} ms per message ({ov.source}). "
        "\"Without\" plans the same profile with them off (the cost model before them). "
        "Ratios: fxpipe's samples/s over the plain loop's, per round.",
        "",
        "| model | without the overheads: stages (predicted) | its run / one process | with "
        "them: stages (predicted) | its run / one process | one process, samples/s |",
        "|---|---:|---:|---:|---:|---:|",
        *rows,
        "",
        "Cells: median [min-max] over the rounds. A one-stage plan runs on one rank of the "
        "runtime (its calls and stash, no messages), so its ratio is the runtime's own cost "
        "against a plain loop.",
    ])
    if args.out:
        with open(args.out, "w") as f:
            f.write(md + "\n")
    else:
        publish(SECTION, md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
