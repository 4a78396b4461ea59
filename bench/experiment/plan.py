"""Measure the model's per-node costs on ONE core and write the plans every rank loads.

    taskset -c 1 python -m bench.experiment.plan OUT_DIR --model bigtail --batch 64 --mbit 20 50 200

Writes OUT_DIR/profile-<MODEL>-b<B>.json and, per bandwidth, plan-<mode>-<MODEL>-b<B>-<M>mbit.json for
mode fxpipe (the planner's choice for Cluster(workers=2, bandwidth)) and straight (2 stages x 1
replica), plus plans.json describing them (replicas, predicted time per minibatch, the
simulator's prediction). Run pinned to one core with one intra-op thread, like a host.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from fxpipe.api import compile as fx_compile
from fxpipe.costmodel import Cluster
from fxpipe.passes import partition
from fxpipe.runtime.plansim import data_parallel_plan, simulate_plan

from .common import build_model, digits_split, loadavg, param_bytes


def mbit_to_bytes(mbit: float) -> float:
    return mbit * 1e6 / 8


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--model", default="bigtail", help="bigtail | small")
    p.add_argument("--batch", type=int, default=64, help="minibatch the profile is measured at")
    p.add_argument("--mbit", type=float, nargs="+", default=[20, 50, 200])
    p.add_argument("--minibatches", type=int, default=22, help="per epoch, for the simulator")
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    xtr, *_ = digits_split()
    model = build_model(args.model)
    tag = f"{args.model}-b{args.batch}"
    la0 = loadavg()
    compiled = fx_compile(model, Cluster(workers=2, bandwidth=mbit_to_bytes(args.mbit[0])),
                          example_inputs=(xtr[:args.batch],), loss_fn=F.cross_entropy,
                          repeats=args.repeats)
    profile = compiled.profile
    fp = compiled.plan.model_fingerprint
    profile.save(out / f"profile-{tag}.json")
    info = {"model": args.model, "batch": args.batch, "param_bytes": param_bytes(model),
            "profile_compute_s": profile.total_compute_s, "loadavg_profiling": [la0, loadavg()],
            "plans": {}}
    for mbit in args.mbit:
        cluster = Cluster(workers=2, bandwidth=mbit_to_bytes(mbit))
        plans = {"fxpipe": partition(profile, cluster),
                 "straight": partition(profile, cluster, stages=2, straight=True)}
        dp = data_parallel_plan(profile, cluster)
        for mode, plan in plans.items():
            plan = dataclasses.replace(plan, model_fingerprint=fp)
            path = out / f"plan-{mode}-{tag}-{mbit:g}mbit.json"
            plan.save(path)
            n = args.minibatches
            sim = simulate_plan(plan, profile, minibatches=n)
            entry = {"path": str(path), "replicas": list(plan.replicas),
                     "stages": [list(s.nodes) for s in plan.stages],
                     "stage_times_s": [s.stage_time_s for s in plan.stages],
                     "comm_s": [s.comm_s for s in plan.stages],
                     "input_bytes": [s.input_bytes for s in plan.stages],
                     "planner_s_per_minibatch": plan.time_per_minibatch,
                     "sim_s_per_minibatch_epoch": sim.makespan / n,
                     "sim_steady_s_per_minibatch": sim.steady_state_period,
                     "data_parallel_s_per_minibatch": plan.data_parallel_time}
            if mode == "straight":  # mp = the same split, one minibatch in flight
                mp = simulate_plan(plan, profile, minibatches=n, noam=1)
                entry["mp_sim_s_per_minibatch_epoch"] = mp.makespan / n
                entry["mp_sim_steady_s_per_minibatch"] = mp.steady_state_period
                entry["mp_planner_s_per_minibatch"] = sum(
                    s.stage_time_s + s.comm_s for s in plan.stages)
            info["plans"][f"{mode}@{mbit:g}"] = entry
        dsim = simulate_plan(dp, profile, minibatches=args.minibatches)
        info["plans"][f"dp@{mbit:g}"] = {
            "replicas": list(dp.replicas), "planner_s_per_minibatch": dp.time_per_minibatch,
            "sim_s_per_minibatch_epoch": dsim.makespan / args.minibatches,
            "sim_steady_s_per_minibatch": dsim.steady_state_period}
        print(f"{mbit:g} Mbit/s: fxpipe plan {plans['fxpipe'].replicas} "
              f"{plans['fxpipe'].time_per_minibatch * 1e3:.1f} ms/minibatch; straight "
              f"{plans['straight'].time_per_minibatch * 1e3:.1f} ms; data parallel "
              f"{dp.time_per_minibatch * 1e3:.1f} ms", flush=True)
    (out / f"plans-{tag}.json").write_text(json.dumps(info, indent=1))
    print(plans["fxpipe"].summary())
    return 0


if __name__ == "__main__":
    sys.exit(main())
