"""The ``fxpipe`` command, for people who never open Python.

    fxpipe plan vgg16 --workers 8 --bandwidth 10Gbps
    fxpipe plan vgg16 --workers 8 --bandwidth 10Gbps --device V100 --export out/ --svg plan.svg
    fxpipe plan path/to/file.py:factory --workers 4
    fxpipe plan data/pipedream-profiles/vgg16/graph.txt --workers 8 --sync parameter-server

MODEL is a zoo name (``fxpipe.models.names()``), ``file.py:factory`` (factory() returns an
``fxpipe.models.ModelSpec``, a ``(model, example_inputs)`` pair, or a module plus
``--input-shape``), or a profile: PipeDream's ``graph.txt`` or fxpipe's ``profile.json``.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import Sequence

from fxpipe.cli_args import add_model_arguments, add_recompute_argument, resolve_model
from fxpipe.errors import ConfigError, FxpipeError

log = logging.getLogger("fxpipe")


def cmd_plan(args: argparse.Namespace) -> int:
    from fxpipe.api import choose_fitted_plan
    from fxpipe.costmodel import Cluster, Profile
    from fxpipe.units import format_seconds

    cluster = Cluster(workers=args.workers, bandwidth=args.bandwidth, device=args.device,
                      memory=args.memory, workers_per_machine=args.workers_per_machine,
                      intra_bandwidth=args.intra_bandwidth)
    suffix = Path(args.model).suffix
    compiled = None
    if suffix in (".txt", ".json"):
        if args.export or args.svg:
            raise ConfigError("--export and --svg need a model, not a profile",
                              "pass a zoo name or file.py:factory")
        profile = Profile.from_pipedream(args.model) if suffix == ".txt" else Profile.load(args.model)
        plan = choose_fitted_plan(  # no optimizer is known: no step temporaries
            profile, cluster, sync=args.sync, stages=args.stages, straight=args.straight,
            choose=args.choose, recompute=args.recompute, schedule=args.schedule,
            microbatches=args.microbatches)
    else:
        from fxpipe.api import compile as fx_compile

        spec = resolve_model(args)
        compiled = fx_compile(spec.model, cluster, example_inputs=spec.example_inputs,
                              loss_fn=spec.loss_fn, stages=args.stages, straight=args.straight,
                              sync=args.sync, choose=args.choose, tracer=args.tracer,
                              recompute=args.recompute, schedule=args.schedule,
                              microbatches=args.microbatches, overheads=args.overheads)
        print(f"traced {spec.name} with {compiled.tracer} ({len(compiled.traced.gm.graph.nodes)} "
              "graph nodes)")
        plan, profile = compiled.plan, compiled.profile
        if args.export:
            compiled.export(args.export)
            print(f"exported stages and plan.json to {args.export}")
        if args.svg:
            compiled.visualize(args.svg)
            print(f"drew the partitioned graph to {args.svg}")
    if args.save_plan:
        plan.save(args.save_plan)
    print(plan.summary() if compiled is None else compiled.summary())
    if "spread" in profile.meta:
        print(f"costs measured on this machine ({profile.meta.get('threads', 1)} thread); spread "
              f"of the measurements (IQR / median): {100 * profile.meta['spread']:.1f}%")
    if plan.time_source != "planner":
        print(f"chosen by simulation among the planner's candidates (-v lists them): "
              f"{plan.time_source}, {format_seconds(plan.time_per_minibatch)} per minibatch in "
              "steady state; data parallelism simulated the same way")
    dp = plan.data_parallel_time
    print(f"data-parallel training on the same cluster: {format_seconds(dp)} per minibatch; "
          f"fxpipe's plan: {format_seconds(plan.time_per_minibatch)} "
          f"(predicted speedup {plan.speedup_over_data_parallel:.2f}x)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fxpipe", description="Automatic pipeline-parallel training.")
    p.add_argument("-v", "--verbose", action="store_true", help="log what each phase does")
    sub = p.add_subparsers(dest="command", required=True)
    pl = sub.add_parser("plan", help="plan a model (or a profile) for a cluster and print the plan")
    pl.add_argument("model", help="zoo name, hf:Class[:key=value,...] (a Hugging Face "
                    "architecture from its config), file.py:factory, PipeDream graph.txt or "
                    "profile.json")
    pl.add_argument("--workers", type=int, required=True)
    pl.add_argument("--bandwidth", default="10Gbps", help="e.g. 10Gbps, 25Gbit/s, 1.25GB/s")
    pl.add_argument("--device", default=None, help="plan for this device (V100, A100, H100, ...) "
                    "instead of measuring this machine")
    pl.add_argument("--memory", default=None, help="memory per worker, e.g. 16GB")
    pl.add_argument("--workers-per-machine", type=int, default=1)
    pl.add_argument("--intra-bandwidth", default=None, help="link inside a machine (two-level)")
    pl.add_argument("--sync", default="allreduce", choices=["allreduce", "parameter-server"])
    pl.add_argument("--stages", type=int, default=None, help="force the number of stages")
    pl.add_argument("--straight", action="store_true", help="one worker per stage")
    add_recompute_argument(pl)
    pl.add_argument("--schedule", default="pipedream",
                    choices=["pipedream", "2bw", "1f1b-flush", "gpipe", "zb-h1", "zb-h2"],
                    help="the schedule whose memory the plan is fitted with (default PipeDream's "
                    "rule: a stashed weight version per minibatch in flight; the flushing kinds "
                    "stash none)")
    pl.add_argument("--microbatches", type=int, default=None,
                    help="microbatches per update of the flushing kinds (default: the workers)")
    pl.add_argument("--choose", default="auto", choices=["auto", "planner", "simulation"],
                    help="planner: the analytic optimum (PipeDream's schedule); simulation: "
                    "simulate the planner's best plan per stage count under --schedule and keep "
                    "the fastest (slower; sees 1F1B start-up, a flush's bubble and replicas "
                    "waiting for each other); auto (default): planner for pipedream (simulation "
                    "when its plan puts tied parameters on two stages), simulation for the "
                    "other schedules")
    pl.add_argument("--size", default="mini", help="zoo model size: mini or full")
    pl.add_argument("--batch-size", type=int, default=None)
    pl.add_argument("--input-shape", default=None, help="for factories that return a bare module")
    add_model_arguments(pl)
    pl.add_argument("--export", default=None, metavar="DIR", help="write stage_k.py + plan.json")
    pl.add_argument("--svg", default=None, metavar="FILE", help="draw the partitioned graph")
    pl.add_argument("--save-plan", default=None, metavar="FILE", help="write plan.json")
    pl.set_defaults(func=cmd_plan)
    from fxpipe.cli_train import add_train_parser

    add_train_parser(sub)
    from fxpipe.cli_simulate import add_simulate_parser

    add_simulate_parser(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args))
    except FxpipeError as e:  # user errors: the message and hint, no traceback
        print(f"fxpipe: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `fxpipe plan ... | head`: the reader left, which is fine
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
