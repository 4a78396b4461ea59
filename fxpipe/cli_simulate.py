"""``fxpipe simulate``: predict a plan's training speed on a cluster we do not have.

MODEL_OR_PROFILE is anything ``fxpipe plan`` takes; without ``--plan`` the planner chooses one.
The plan's schedule is event-simulated (:mod:`fxpipe.runtime.pricing.plansim`) and compared with
the planner's prediction and with BSP data parallelism; ``--trace`` writes a Perfetto trace.
"""
from __future__ import annotations

import argparse
import logging
from typing import Any

from fxpipe.cli_args import parse_noam
from fxpipe.errors import ConfigError

log = logging.getLogger("fxpipe")
SCHEDULES = ("auto", "pipedream", "1f1b-flush", "gpipe", "2bw", "zb-h1", "zb-h2", "interleaved-1f1b",
             "zb-v", "dualpipev")
PLACED = ("interleaved-1f1b", "zb-v", "dualpipev")  # several stages per process (placement)


def add_simulate_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``fxpipe simulate`` on the ``fxpipe`` command's subparsers."""
    p = subparsers.add_parser("simulate", help="event-simulate a plan on a (hypothetical) cluster")
    p.add_argument("model", metavar="MODEL_OR_PROFILE",
                   help="zoo name, file.py:factory, pipedream:<name> (PipeDream's published "
                   "profiles), PipeDream graph.txt or profile.json")
    p.add_argument("--workers", type=int, required=True)
    p.add_argument("--bandwidth", default="10Gbps", help="e.g. 10Gbps, 25Gbit/s, 1.25GB/s")
    p.add_argument("--latency", type=float, default=0.0, help="seconds per message")
    p.add_argument("--device", default=None, help="estimate costs for this device (V100, ...)")
    p.add_argument("--memory", default=None, help="memory per worker, e.g. 16GB")
    p.add_argument("--workers-per-machine", type=int, default=1)
    p.add_argument("--intra-bandwidth", default=None, help="link inside a machine (two-level)")
    p.add_argument("--sync", default="allreduce", choices=["allreduce", "parameter-server"])
    p.add_argument("--plan", default=None, metavar="FILE", help="simulate this plan.json")
    p.add_argument("--stages", type=int, default=None, help="force the number of stages")
    p.add_argument("--straight", action="store_true", help="one worker per stage")
    p.add_argument("--choose", default="auto", choices=["auto", "planner", "simulation"],
                   help="which plan to simulate: the planner's optimum, or the fastest simulated "
                   "of its candidates (as fxpipe plan --choose; auto: the planner's for "
                   "pipedream, the simulation for the other schedules)")
    p.add_argument("--schedule", default="auto", choices=SCHEDULES,
                   help="the schedule to simulate (auto, the default: what the default trainer "
                   "trains, 1f1b-flush with each minibatch cut into one microbatch per worker)")
    p.add_argument("--chunks", type=int, default=2,
                   help="interleaved-1f1b: stages per worker (the plan gets chunks x workers "
                   "stages, placed round robin; zb-v and dualpipev always 2, in a V)")
    p.add_argument("--minibatches", type=int, default=200)
    p.add_argument("--noam", default="auto", type=parse_noam,
                   help="minibatches in flight at the input stage of pipedream and 2bw, as "
                        "`fxpipe train --noam`: auto (the default, what the trainer admits: "
                        "the fewest that hide the plan's round trips), pipedream, or a number")
    p.add_argument("--microbatches", type=int, default=None,
                   help="minibatches per update of the synchronous schedules (default: workers)")
    p.add_argument("--half-duplex", action="store_true",
                   help="one port per worker for both directions (the planner's assumption)")
    p.add_argument("--trace", default=None, metavar="FILE", help="write a Chrome/Perfetto trace")
    p.add_argument("--size", default="mini", help="zoo model size: mini or full")
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--input-shape", default=None, help="for factories that return a bare module")
    from fxpipe.cli_args import add_model_arguments, add_recompute_argument

    add_model_arguments(p)
    add_recompute_argument(p)
    p.set_defaults(func=cmd_simulate)
    return p


def _profile_and_plan(args: argparse.Namespace, cluster: Any) -> tuple[Any, Any]:
    from fxpipe.cli_args import load_profile, profile_of
    from fxpipe.passes import Plan

    path = profile_of(args.model)
    if path is not None:
        profile = load_profile(path)
    else:
        from fxpipe.api import compile as fx_compile
        from fxpipe.cli_args import resolve_model

        spec = resolve_model(args)
        profile = fx_compile(spec.model, cluster, example_inputs=spec.example_inputs,
                             stages=args.stages, straight=args.straight, sync=args.sync,
                             tracer=args.tracer, recompute=args.recompute,
                             overheads=args.overheads).profile
    if args.plan:
        plan = Plan.load(args.plan)
        missing = set(plan.stage_of()) - set(profile.names)
        if missing:
            raise ConfigError(f"plan {args.plan!r} names nodes the profile lacks "
                              f"(e.g. {sorted(missing)[0]!r})", "pass the model the plan was made for")
    else:
        from fxpipe.api import choose_fitted_plan, choose_plan

        if args.schedule in PLACED:  # v x workers stages, v per worker (runtime.pricing.placed_sim)
            from fxpipe.runtime.pricing.placed_sim import stages_per_process, virtual_cluster

            v = stages_per_process(args.schedule, args.chunks)
            plan = choose_plan(profile, virtual_cluster(cluster, v), sync=args.sync,
                               stages=v * (args.stages or cluster.workers), straight=True,
                               choose="planner", recompute=args.recompute)
        else:  # the cap held against the walked peak, as `fxpipe plan` does
            plan = choose_fitted_plan(profile, cluster, sync=args.sync, stages=args.stages,
                                      straight=args.straight, choose=args.choose,
                                      schedule=args.schedule, recompute=args.recompute,
                                      microbatches=args.microbatches)
    return profile, plan


def cmd_simulate(args: argparse.Namespace) -> int:
    from fxpipe.costmodel import Cluster
    from fxpipe.runtime.pricing.plansim import (data_parallel_plan, minibatches_for,
                                                simulate_plan, trainer_window)
    from fxpipe.units import format_bytes, format_seconds

    from fxpipe.runtime.schedules.spec import priced_kind

    cluster = Cluster(workers=args.workers, bandwidth=args.bandwidth, device=args.device,
                      memory=args.memory, workers_per_machine=args.workers_per_machine,
                      intra_bandwidth=args.intra_bandwidth, latency=args.latency)
    if args.schedule == "auto":
        args.schedule = priced_kind("auto")
        print(f"schedule auto: simulated as {args.schedule}, what the default trainer trains")
    profile, plan = _profile_and_plan(args, cluster)
    noam = (trainer_window(plan, profile, args.schedule) if args.noam == "auto" else
            None if args.noam == "pipedream" else args.noam)
    if not plan.staleness:
        from fxpipe.runtime.pricing.plansim import with_trainer_window, with_window

        plan = (with_window(plan, noam)  # pipedream's window is the one just found
                if args.noam == "auto" and args.schedule == "pipedream"
                else with_trainer_window(plan, profile))
    duplex = not args.half_duplex
    base = plan.noam
    sim = simulate_plan(plan, profile, schedule=args.schedule, minibatches=args.minibatches,
                        latency_s=args.latency, duplex=duplex, microbatches=args.microbatches,
                        chunks=args.chunks, noam=noam)
    # the baseline runs long enough for whole rounds of all its replicas (200 minibatches are 3
    # rounds of 64, where start-up would still dominate)
    bsp = simulate_plan(data_parallel_plan(profile, cluster, sync=plan.sync), profile,
                        minibatches=minibatches_for([cluster.workers], floor=args.minibatches),
                        latency_s=args.latency, duplex=duplex)
    print(plan.summary(detail=True))
    print()
    if noam is not None and noam != base:
        print(f"in flight at the input stage: {noam} minibatches (PipeDream's NOAM: {base}"
              + ("; what the trainer admits: the fewest that hide the plan's round trips)"
                 if args.noam == "auto" else ")"))
    print(sim.summary())
    stale = plan.staleness.get(args.schedule)
    if stale:
        print(f"weight staleness of {args.schedule}: worst stage {max(o for o, _ in stale)} own "
              f"updates, {max(g for _, g in stale)} global block updates (table above)")
    print(f"BSP data parallelism on {cluster.workers} workers: "
          f"{format_seconds(bsp.steady_state_period)} per minibatch, "
          f"{format_bytes(bsp.bytes_per_minibatch)} on the wire per minibatch; simulated speedup "
          f"of the plan over BSP {bsp.steady_state_period / sim.steady_state_period:.2f}x")
    if args.trace:
        print(f"wrote the predicted timeline to {sim.write_trace(args.trace)} "
              "(open in ui.perfetto.dev or chrome://tracing)")
    return 0
