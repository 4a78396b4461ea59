"""Measure the model's per-node costs on ONE core and write the plans every rank loads.

    taskset -c 1 python -m bench.experiment.plan OUT_DIR --model bigtail --batch 64 --mbit 20 50 200

Writes OUT_DIR/profile-<MODEL>-b<B>.json and, per bandwidth, plan-<mode>-<MODEL>-b<B>-<M>mbit.json
for mode fxpipe (chosen by simulation among the planner's candidates for Cluster(workers=2,
bandwidth): ``fxpipe.compile(..., choose="simulation")``) and straight (2 stages x 1 replica),
plus plans.json describing them (and the planner's analytic optimum) (replicas, predicted time per
minibatch, the simulator's prediction). Run pinned to one core with one intra-op thread, like a
host.
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
from fxpipe.costmodel import Cluster, Profile
from fxpipe.passes import partition
from fxpipe.runtime.pricing.plan_choice import choose_by_simulation
from fxpipe.runtime.pricing.plansim import data_parallel_plan, simulate_plan

from .common import build_model, digits_split, loadavg, param_bytes


def mbit_to_bytes(mbit: float) -> float:
    return mbit * 1e6 / 8


def split_batch(profile: Profile, r: int) -> Profile:
    """The profile of one DDP replica when a minibatch is SPLIT over ``r`` replicas: forward and
    backward times and activations scale with the batch (1/r), the optimizer step does not.
    fxpipe's data-parallel plan gives each replica WHOLE minibatches (round robin); DDP with the
    same samples per update as the pipelines gives each host 1/r of one."""
    nodes = tuple(dataclasses.replace(n, forward_s=n.forward_s / r, backward_s=n.backward_s / r,
                                      activation_bytes=n.activation_bytes / r)
                  for n in profile.nodes)
    return dataclasses.replace(profile, nodes=nodes,
                               batch_size=(profile.batch_size or r) // r)


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
        # fxpipe's plan: chosen by simulation among the planner's candidates (the analytic
        # optimum charges a cut 2X/B on one link, so at 20 Mbit/s it prefers ONE worker, while
        # the emulated links are full duplex; the simulator models that)
        optimum = partition(profile, cluster)
        plans = {"fxpipe": choose_by_simulation(profile, cluster).plan,
                 "straight": partition(profile, cluster, stages=2, straight=True)}
        info["plans"][f"optimum@{mbit:g}"] = {
            "replicas": list(optimum.replicas),
            "planner_s_per_minibatch": optimum.time_per_minibatch,
            "sim_steady_s_per_minibatch": simulate_plan(
                optimum, profile, minibatches=args.minibatches).steady_state_period}
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
        # DDP with the pipelines' samples per update: each minibatch split over the 2 hosts,
        # i.e. a round-robin plan over half-minibatches, two of which make one of ours
        r = cluster.workers
        half = split_batch(profile, r)
        sdp = data_parallel_plan(half, cluster)
        ssim = simulate_plan(sdp, half, minibatches=args.minibatches * r)
        info["plans"][f"ddp@{mbit:g}"] = {
            "replicas": list(sdp.replicas), "planner_s_per_minibatch": sdp.time_per_minibatch * r,
            "sim_s_per_minibatch_epoch": ssim.makespan / args.minibatches,
            "sim_steady_s_per_minibatch": ssim.steady_state_period * r}
        print(f"{mbit:g} Mbit/s: fxpipe plan {plans['fxpipe'].replicas} "
              f"{plans['fxpipe'].time_per_minibatch * 1e3:.1f} ms/minibatch; straight "
              f"{plans['straight'].time_per_minibatch * 1e3:.1f} ms; data parallel "
              f"{dp.time_per_minibatch * 1e3:.1f} ms", flush=True)
    (out / f"plans-{tag}.json").write_text(json.dumps(info, indent=1))
    print(plans["fxpipe"].summary())
    return 0


if __name__ == "__main__":
    sys.exit(main())
