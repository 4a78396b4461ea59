"""The ``fxpipe`` command: ``fxpipe plan`` here; ``train`` and ``simulate`` in their own modules.

MODEL is a zoo name, ``hf:Class[:key=value,...]``, ``file.py:factory`` (a ModelSpec, a
``(model, example_inputs)`` pair or a module plus ``--input-shape``), or a profile:
``pipedream:<name>``, a PipeDream ``graph.txt`` or fxpipe's ``profile.json``.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Sequence

from fxpipe.cli_args import (add_model_arguments, add_recompute_argument, add_shard_argument,
                             costs_line, load_profile, profile_of, resolve_model)
from fxpipe.errors import ConfigError, FxpipeError

log = logging.getLogger("fxpipe")


def cmd_plan(args: argparse.Namespace) -> int:
    from fxpipe.api import choose_fitted_plan
    from fxpipe.codegen import draw_overview
    from fxpipe.costmodel import Cluster

    cluster = Cluster(workers=args.workers, bandwidth=args.bandwidth, device=args.device,
                      memory=args.memory, workers_per_machine=args.workers_per_machine,
                      intra_bandwidth=args.intra_bandwidth)
    path = profile_of(args.model)
    compiled = None
    if path is not None:
        if args.export or args.nodes:
            raise ConfigError(f"--{'export' if args.export else 'nodes'} needs a model, not a "
                              "profile (a profile has costs, no graph)",
                              "pass a zoo name, hf:... or file.py:factory")
        profile = load_profile(path)
        plan = choose_fitted_plan(  # no optimizer is known: no step temporaries
            profile, cluster, sync=args.sync, stages=args.stages, straight=args.straight,
            choose=args.choose, recompute=args.recompute, schedule=args.schedule,
            microbatches=args.microbatches, shard=args.shard)
        if args.svg:
            draw_overview(plan, args.svg)
            print(f"drew the plan to {args.svg}")
    else:
        from fxpipe.api import compile as fx_compile

        spec = resolve_model(args)
        compiled = fx_compile(spec.model, cluster, example_inputs=spec.example_inputs,
                              loss_fn=spec.loss_fn, stages=args.stages, straight=args.straight,
                              sync=args.sync, choose=args.choose, tracer=args.tracer,
                              recompute=args.recompute, schedule=args.schedule,
                              microbatches=args.microbatches, overheads=args.overheads,
                              shard=args.shard)
        print(f"traced {spec.name} with {compiled.tracer}: {len(compiled.profile.nodes)} nodes "
              "(its inputs and operations, the stages' node counts below)")
        plan, profile = compiled.plan, compiled.profile
        if args.export:
            compiled.export(args.export)
            print(f"exported stages and plan.json to {args.export}")
        if args.svg:
            compiled.visualize(args.svg, nodes=args.nodes)
            print(f"drew the plan{' node by node' if args.nodes else ''} to {args.svg}")
    if args.save_plan:
        plan.save(args.save_plan)
    print(plan.summary(detail=args.detail) if compiled is None
          else compiled.summary(detail=args.detail))
    print(costs_line(profile, cluster))
    claim = paper_claim(args.model)
    if claim:
        print(f"{claim}; fxpipe's plan here: {plan.speedup_over_data_parallel:.2f}x the "
              "throughput of data parallelism, from PipeDream's own profile")
    return 0


def paper_claim(model: str) -> str | None:
    """What PipeDream's paper reports for a ``pipedream:`` model, if it reports something."""
    from fxpipe.models import pipedream

    if not model.startswith(pipedream.PREFIX):
        return None
    return pipedream.PAPER.get(model.removeprefix(pipedream.PREFIX))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fxpipe", description="Automatic pipeline-parallel training.")
    p.add_argument("-v", "--verbose", action="store_true", help="log what each phase does")
    sub = p.add_subparsers(dest="command", required=True)
    pl = sub.add_parser("plan", help="plan a model (or a profile) for a cluster and print the plan")
    pl.add_argument("model", help="zoo name, hf:Class[:key=value,...] (a Hugging Face "
                    "architecture from its config), file.py:factory, pipedream:<name> "
                    "(PipeDream's published GPU profiles: vgg16, resnet50, ...), a PipeDream "
                    "graph.txt or a profile.json")
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
    add_shard_argument(pl)
    pl.add_argument("--schedule", default="auto",
                    choices=["auto", "pipedream", "2bw", "1f1b-flush", "gpipe", "zb-h1", "zb-h2"],
                    help="the schedule the plan is priced for, time and memory (auto, the "
                    "default: what the default trainer trains, 1f1b-flush with each minibatch "
                    "cut into one microbatch per worker; pipedream: PipeDream's asynchronous "
                    "1F1B, a stashed weight version per minibatch in flight)")
    pl.add_argument("--microbatches", type=int, default=None,
                    help="microbatches per update of the flushing kinds (default: the workers)")
    pl.add_argument("--choose", default="auto", choices=["auto", "planner", "simulation"],
                    help="planner: the analytic optimum (PipeDream's schedule); simulation: "
                    "simulate the planner's best plan per stage count, copies of a straight "
                    "pipeline and local moves from the fastest under --schedule and keep the "
                    "fastest (slower; sees 1F1B start-up, a flush's bubble and replicas "
                    "waiting for each other); auto (default): planner for pipedream (simulation "
                    "when its plan puts tied parameters on two stages), simulation for the "
                    "other schedules and for auto")
    pl.add_argument("--size", default="mini", help="zoo model size: mini or full")
    pl.add_argument("--batch-size", type=int, default=None)
    pl.add_argument("--input-shape", default=None, help="for factories that return a bare module")
    add_model_arguments(pl)
    pl.add_argument("--export", default=None, metavar="DIR", help="write stage_k.py + plan.json")
    pl.add_argument("--svg", default=None, metavar="FILE",
                    help="draw the plan: its stages left to right with their replicas, time, "
                    "memory and the bytes crossing each cut (.svg, .png or .dot)")
    pl.add_argument("--nodes", action="store_true",
                    help="with --svg: draw the partitioned graph node by node instead")
    pl.add_argument("--detail", action="store_true",
                    help="print each stage's optimizer step and overheads, what its memory is "
                    "made of, the minibatches in flight and the weight staleness of each schedule")
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
