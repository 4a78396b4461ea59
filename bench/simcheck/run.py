"""Validate the plan simulator (and the planner) against the runtime's measured timelines.

    .venv/bin/python -m bench.simcheck.run                 # as root; ~2-3 min
    .venv/bin/python -m bench.simcheck.run --mbit 200 --minibatches 48

Why: ``fxpipe simulate`` predicts plans for clusters we do not have, and the planner picks plans
by an analytic bottleneck formula. Both are only worth something if they predict what the
runtime does. A 2-core machine cannot run a 4-worker pipeline of real compute, so the model here
is ``SleepChain`` (bench/simcheck/model.py): layers that sleep their forward/backward time and
hold real weights. The schedule, the stash, the activations and gradients on the wire and the
replicas' all-reduces are the runtime's own; only the arithmetic is replaced by sleeping.

Steps: (1) profile the model with fxpipe's profiler (so the costs are measured, not assumed);
(2) for each plan below (straight, unevenly replicated, data parallel, and the planner's choice)
cost it with the planner's formulas (``fxpipe.passes.plan_for``) and simulate it
(``simulate_plan``); (3) run it on a fresh emulated cluster of ``sum(replicas)`` hosts
(tools/cluster: network namespaces, HTB-shaped links at ``--mbit``), one torchrun process per
host, and collect each rank's timeline; (4) reduce the measured timeline exactly as the simulator
reduces its own (``plansim.steady_state`` over stage 0's backward completions) and report both
predictions' errors. Writes OUT/traces/<plan>-{measured,simulated}.json (open both in
ui.perfetto.dev), OUT/summary.json and benchmarks/simulator-validation.md.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import shutil
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch.nn.functional as F

from tools.cluster import EmulatedCluster, read_output, torchrun_across, wait_all
from fxpipe.api import compile as fx_compile
from fxpipe.costmodel import Cluster
from fxpipe.passes import Plan, partition, plan_for
from fxpipe.runtime.pricing.plansim import simulate_plan, steady_state
from fxpipe.runtime.schedules.kinds import make_schedule
from fxpipe.runtime.timeline import TimelineEvent, write_chrome_trace

from .model import BATCH, LAYERS, WIDTH, SleepLayer, build, data

ROOT = Path(__file__).resolve().parents[2]
log = logging.getLogger("bench.simcheck")

# name -> (first layer of each stage, replicas); node 0 is the input, node i+1 layer i, then head
PLANS: dict[str, tuple[list[int], list[int]]] = {
    "straight 2": ([0, 3], [1, 1]),
    "1-2": ([0, 4], [1, 2]),
    "2-1": ([0, 4], [2, 1]),
    "3-1": ([0, 4], [3, 1]),
    "2-2": ([0, 3], [2, 2]),
    "2-1-1": ([0, 3, 4], [2, 1, 1]),
    "straight 4": ([0, 2, 3, 4], [1, 1, 1, 1]),
    "data parallel 4": ([0], [4]),
}


def mbit_to_bytes(mbit: float) -> float:
    return mbit * 1e6 / 8


def make_plans(out: Path, mbit: float, workers: int) -> tuple[Any, dict[str, Plan]]:
    x, _ = data(1)
    compiled = fx_compile(build(), Cluster(workers=workers, bandwidth=mbit_to_bytes(mbit)),
                          example_inputs=(x[:BATCH],), loss_fn=F.cross_entropy,
                          leaf_modules=[SleepLayer], repeats=5)
    profile, fp = compiled.profile, compiled.plan.model_fingerprint
    plans = {name: plan_for(profile, Cluster(workers=sum(reps), bandwidth=mbit_to_bytes(mbit)),
                            starts, reps) for name, (starts, reps) in PLANS.items()}
    plans[f"planner's choice ({workers} workers)"] = partition(
        profile, Cluster(workers=workers, bandwidth=mbit_to_bytes(mbit)))
    plans = {n: dataclasses.replace(p, model_fingerprint=fp) for n, p in plans.items()}
    (out / "plans").mkdir(parents=True, exist_ok=True)
    profile.save(out / "profile.json")
    for i, p in enumerate(plans.values()):
        p.save(out / "plans" / f"plan{i}.json")
    return profile, plans


def run_plan(plan_path: Path, hosts: int, mbit: float, n: int, run_dir: Path,
             timeout: float) -> list[dict]:
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    with EmulatedCluster(hosts=hosts, bandwidth=f"{mbit:g}Mbit", latency=0,
                         prefix="fxpsim") as c:
        procs = torchrun_across(c, ["-m", "bench.simcheck.worker", "--plan", str(plan_path),
                                    "--minibatches", str(n), "--out", str(run_dir)],
                                env={"PYTHONPATH": str(ROOT)}, log_dir=run_dir)
        codes = wait_all(procs, timeout=timeout)
        if any(codes):
            for p in procs:
                print(read_output(p)[-3000:], file=sys.stderr)
            raise RuntimeError(f"{plan_path.name} failed: exit codes {codes}")
    return [json.loads((run_dir / f"rank{r}.json").read_text()) for r in range(hosts)]


def measured(plan: Plan, ranks: list[dict], n: int) -> dict[str, Any]:
    """The last segment's makespan and steady-state period, reduced like the simulator's."""
    sched = make_schedule("pipedream", plan.replicas, n)
    evs = [e for r in ranks for e in r["events"]]
    t0 = min(e["start"] for e in evs if e["category"] in ("forward", "backward"))
    t1 = max(e["end"] for e in evs if e["category"] in ("forward", "backward", "allreduce",
                                                          "optimizer"))
    done = [0.0] * n
    for r in ranks:
        if r["stage_replica"][0] == 0:
            for e in r["events"]:
                if e["category"] == "backward":
                    done[int(e["args"]["minibatch"])] = e["end"] - t0
    period, _, _ = steady_state(sched, done, t1 - t0)
    return {"makespan_s": t1 - t0, "steady_s": period,
            "segment_s": max(r["segment_s"][-1] for r in ranks)}


def traces(name: str, sim: Any, ranks: list[dict], out: Path) -> None:
    slug = "".join(ch if ch.isalnum() else "_" for ch in name)
    write_chrome_trace(dict(sim.events), out / f"{slug}-simulated.json", dict(sim.rank_names))
    t0 = min(e["start"] for r in ranks for e in r["events"])
    tl: dict[int, list[TimelineEvent]] = defaultdict(list)
    bg: dict[int, list[TimelineEvent]] = defaultdict(list)
    for r in ranks:
        for e in r["events"]:
            ev = TimelineEvent(e["category"], e["name"], e["start"] - t0, e["end"] - t0, e["args"])
            (bg if e["args"].get("async") else tl)[r["rank"]].append(ev)
    names = {r["rank"]: f"stage {r['stage_replica'][0]} replica {r['stage_replica'][1]}"
             for r in ranks}
    write_chrome_trace(dict(tl), out / f"{slug}-measured.json", names, dict(bg))


def pct(pred: float, meas: float) -> str:
    return f"{(pred - meas) / meas * 100:+.0f}%"


def report(rows: list[dict], args: argparse.Namespace, elapsed: float, la: list) -> str:
    lines = [
        "### Simulator and planner against the runtime's measured timelines",
        "",
        f"Command: `.venv/bin/python -m bench.simcheck.run --mbit {args.mbit:g} --minibatches "
        f"{args.minibatches}` (as root; driver took {elapsed / 60:.1f} min; load average "
        f"{la[0]} at start, {la[1]} at end).",
        "",
        f"Model `SleepChain` (bench/simcheck/model.py): {len(LAYERS)} layers of Linear({WIDTH}, "
        f"{WIDTH}) + a sleep of (forward, backward) ms {list(LAYERS)}, then Linear({WIDTH}, 10); "
        f"minibatch {BATCH}. Costs from fxpipe's profiler. Each plan ran on a fresh emulated "
        f"cluster of sum(replicas) hosts at {args.mbit:g} Mbit/s (network namespaces, HTB; no "
        "added latency), PipeDream 1F1B with weight stashing, 2 segments of "
        f"{args.minibatches} minibatches; the second is measured. steady = seconds per minibatch "
        "once the pipeline is full (stage 0's backward completions over the middle half, the "
        "simulator's own reduction applied to the measured timeline); makespan = first forward "
        "to last update of the segment, per minibatch.",
        "",
        "| plan | replicas | planner ms | sim steady ms | measured steady ms | planner err "
        "| sim err | sim makespan ms/mb | measured makespan ms/mb | sim err |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        n = args.minibatches
        lines.append(
            f"| {r['name']} | {r['replicas']} | {r['planner_s'] * 1e3:.1f} | "
            f"{r['sim_steady_s'] * 1e3:.1f} | {r['meas']['steady_s'] * 1e3:.1f} | "
            f"{pct(r['planner_s'], r['meas']['steady_s'])} | "
            f"{pct(r['sim_steady_s'], r['meas']['steady_s'])} | "
            f"{r['sim_makespan_s'] / n * 1e3:.1f} | {r['meas']['makespan_s'] / n * 1e3:.1f} | "
            f"{pct(r['sim_makespan_s'], r['meas']['makespan_s'])} |")
    pe = [abs(r["planner_s"] - r["meas"]["steady_s"]) / r["meas"]["steady_s"] for r in rows]
    se = [abs(r["sim_steady_s"] - r["meas"]["steady_s"]) / r["meas"]["steady_s"] for r in rows]
    lines += ["", f"Mean absolute error of the steady-state prediction: planner "
              f"{sum(pe) / len(pe) * 100:.0f}% (max {max(pe) * 100:.0f}%), simulator "
              f"{sum(se) / len(se) * 100:.0f}% (max {max(se) * 100:.0f}%). Traces (measured and "
              f"simulated, same format): `{args.out}/traces/`."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--mbit", type=float, default=200.0)
    p.add_argument("--minibatches", type=int, default=48)
    p.add_argument("--workers", type=int, default=4, help="cluster size for the planner's choice")
    p.add_argument("--only", nargs="*", help="run only these plan names")
    p.add_argument("--out", default="/tmp/fxpipe-simcheck")
    p.add_argument("--timeout", type=float, default=300)
    p.add_argument("--no-report", action="store_true")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started, la0 = time.perf_counter(), [round(v, 2) for v in os.getloadavg()]
    profile, plans = make_plans(out, args.mbit, args.workers)
    rows = []
    for i, (name, plan) in enumerate(plans.items()):
        if args.only and name not in args.only:
            continue
        n = args.minibatches
        sim = simulate_plan(plan, profile, minibatches=n)
        ranks = run_plan(out / "plans" / f"plan{i}.json", plan.workers_used, args.mbit, n,
                         out / "runs" / f"plan{i}", args.timeout)
        row = {"name": name, "replicas": list(plan.replicas), "planner_s": plan.time_per_minibatch,
               "sim_steady_s": sim.steady_state_period, "sim_makespan_s": sim.makespan,
               "meas": measured(plan, ranks, n)}
        traces(name, sim, ranks, out / "traces")
        log.info("%s: planner %.1f ms, sim %.1f ms, measured %.1f ms per minibatch", name,
                 row["planner_s"] * 1e3, row["sim_steady_s"] * 1e3, row["meas"]["steady_s"] * 1e3)
        rows.append(row)
    (out / "summary.json").write_text(json.dumps(rows, indent=1))
    text = report(rows, args, time.perf_counter() - started,
                  [la0, [round(v, 2) for v in os.getloadavg()]])
    if args.no_report or args.only:
        print(text)
    else:
        from bench._report import publish
        publish("simulator-validation", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
