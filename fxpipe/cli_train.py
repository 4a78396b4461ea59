"""``fxpipe train MODEL --data DATASET --nproc N``: pipeline-parallel training from the shell.

The launcher starts torchrun on this machine (across machines, run ``torchrun ... -m
fxpipe.cli_train`` on each); every rank compiles the model with ``--plan`` or a plan estimated
for ``--device`` and trains it on ``synthetic``, ``digits`` or ``file.py:factory`` data.
"""
from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
import time
from typing import Any, Sequence

from fxpipe.errors import ConfigError, FxpipeError
from fxpipe.cli_args import add_overheads_argument, parse_noam

log = logging.getLogger("fxpipe")


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="zoo model name (fxpipe.models.names()), hf:Class[:key=value,...] "
                   "(a Hugging Face architecture from its config; synthetic token batches with "
                   "labels) or file.py:factory returning an fxpipe.models.ModelSpec")
    p.add_argument("--data", required=True, help="synthetic | digits | file.py:factory "
                   "(returns (train_loader, val_loader))")
    p.add_argument("--plan", default=None, metavar="FILE",
                   help="plan.json (fxpipe plan --save-plan)")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--num-batches", type=int, default=16, help="synthetic minibatches per epoch")
    p.add_argument("--eval-batches", type=int, default=2, help="synthetic evaluation minibatches")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--schedule", default="auto",
                   help="auto (default: chosen by a pilot and the simulated throughput), "
                   "pipedream, 1f1b-flush, gpipe, 2bw, localsgd (workers // stages copies of "
                   "the plan's pipeline, averaged every --average-every updates), or "
                   "pipedream+MITIGATIONS (lr_scale, predict, dc, momentum, nesterov, joined "
                   "with +)")
    p.add_argument("--average-every", type=int, default=None, metavar="H",
                   help="localsgd: local updates between two averages of the copies (default 4)")
    p.add_argument("--shard", choices=("never", "optimizer", "auto"), default=None,
                   help="split each replicated stage's optimizer state over its replicas "
                        "(ZeRO-1, torch's ZeroRedundancyOptimizer): optimizer plans and trains "
                        "sharded, never neither, auto plans sharded where that makes the plan "
                        "fit or faster; default: as the plan (--plan) was priced")
    p.add_argument("--pilot", type=int, default=None,
                   help="auto: minibatches of 1f1b-flush's pilot, the others the same seconds "
                   "(0: none, pick 1f1b-flush)")
    p.add_argument("--look-again", type=float, default=None, metavar="K",
                   help="auto on the pipeline: race an asynchronous pick against 1f1b-flush "
                   "again after K times its pilot (default 2; 0: never)")
    p.add_argument("--pilot-on", choices=("copies", "pipeline"), default=None,
                   help="auto: pilot the candidates on copies of the model in each process "
                   "(default) or in turn on this job's own pipeline, the winner continuing")
    p.add_argument("--vertical-sync", action="store_true")
    p.add_argument("--checkpoint-dir", default=None)
    p.add_argument("--checkpoint-every", type=int, default=None, help="minibatches")
    p.add_argument("--resume", action="store_true", help="continue from --checkpoint-dir")
    p.add_argument("--overwrite-checkpoints", action="store_true",
                   help="delete the checkpoints --checkpoint-dir holds and start afresh (without "
                   "it, or --resume, a folder holding another run's checkpoints is refused)")
    p.add_argument("--elastic", action="store_true", help="under torchrun's elastic agent: "
                   "re-plan for this start's WORLD_SIZE and resume from the newest complete "
                   "checkpoint of any plan, if there is one (fxpipe/cli_elastic.py)")
    p.add_argument("--size", default="mini", help="zoo model size: mini or full")
    p.add_argument("--device", default="cpu", help="device the plan is estimated for")
    p.add_argument("--bandwidth", default="10Gbps",
                   help="the link between workers the plan is priced for, e.g. 10Gbps")
    p.add_argument("--input-shape", default=None,
                   help="for a file.py:factory that returns a bare module: its input's shape")
    p.add_argument("--stages", type=int, default=None, help="force the number of stages")
    p.add_argument("--straight", action="store_true", help="one worker per stage")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds any wait may take")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save", default=None, metavar="FILE", help="rank 0 saves the trained weights")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per sample (hf: models)")
    p.add_argument("--tracer", default="auto", choices=["auto", "symbolic_trace", "export"])
    add_overheads_argument(p)
    p.add_argument("--optimizer", default="sgd", choices=["sgd", "adamw", "muon"],
                   help="muon: torch.optim.Muon on the hidden matrices, AdamW on embeddings, "
                   "the head, norms and biases (one --lr and --weight-decay for both)")
    p.add_argument("--weight-decay", type=float, default=0.0,
                   help="on tensors of 2+ dimensions only (named groups)")
    p.add_argument("--warmup", type=int, default=0, help="updates of linear LR warm-up")
    p.add_argument("--schedule-lr", default="constant", choices=["constant", "cosine"])
    p.add_argument("--total-steps", type=int, default=None, help="updates the cosine spans")
    p.add_argument("--min-lr-ratio", type=float, default=0.1, help="cosine floor / lr")
    p.add_argument("--clip", type=float, default=None, help="clip gradients to this global norm")
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16"],
                   help="bf16/fp16 autocast; fp16 adds dynamic loss scaling (flushing "
                        "schedules only, e.g. --schedule 1f1b-flush)")
    p.add_argument("--recompute", action="store_true",
                   help="recompute activations in every stage (default: the stages the plan "
                        "recomputes, e.g. a --plan saved by `fxpipe plan --recompute auto`)")
    p.add_argument("--microbatches", type=int, default=None,
                   help="minibatches per update (flushing schedules)")
    p.add_argument("--segment", type=int, default=None, help="minibatches per segment")
    p.add_argument("--noam", default=None, type=parse_noam,
                   help="minibatches in flight at the input stage of pipedream and 2bw: auto "
                        "(the default: the fewest that hide the plan's communication round "
                        "trips within its memory), pipedream (PipeDream's NOAM), or a number")
    p.add_argument("--prefetch", type=int, default=0, help="minibatches read ahead by a thread")
    p.add_argument("--metrics", default=None, metavar="FILE.jsonl", help="JSON-lines metrics log")
    p.add_argument("--metrics-every", type=int, default=1, help="updates between records")
    p.add_argument("--measure-memory", action="store_true",
                   help="count each rank's peak of live tensor bytes and print it per stage "
                        "beside the plan's prediction at the end")


def add_train_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``fxpipe train`` on the ``fxpipe`` command's subparsers."""
    p = subparsers.add_parser("train", help="train a model with pipeline parallelism (torchrun)")
    _add_arguments(p)
    p.add_argument("--nproc", type=int, default=None,
                   help="processes on this machine (default: the plan's total replicas)")
    p.set_defaults(func=cmd_train)
    return p


def _is_file_spec(name: str) -> bool:
    path, sep, _ = name.rpartition(":")
    return bool(sep) and path.endswith(".py")


def _check_data(name: str) -> None:
    if _is_file_spec(name):
        path = name.rpartition(":")[0]
        if not os.path.isfile(path):
            raise ConfigError(f"data file {path!r} does not exist",
                              "--data file.py:factory, factory() returning (train, val) loaders")
        return
    if name not in ("synthetic", "digits"):
        raise ConfigError(f"unknown dataset {name!r}", "use --data synthetic, digits or "
                          "file.py:factory")
    if name == "digits":
        try:
            import sklearn  # noqa: F401
        except ImportError as err:
            raise ConfigError("--data digits needs the package scikit-learn, which is not "
                              "installed", "pip install scikit-learn, or use --data synthetic"
                              ) from err


def plan_schedule(schedule: str) -> str:
    """The schedule the plan is made and priced for: the one named (its memory rule and, for
    the synchronous kinds, its simulated time), ``auto`` itself (priced as the default trainer
    trains: ``fxpipe.compile``), and PipeDream's for the placed kinds (several stages per
    process: no rule of their own)."""
    from fxpipe.runtime.pricing.memory import SHAPES
    from fxpipe.runtime.schedules.spec import AUTO, parse_schedule

    kind = parse_schedule(schedule).kind
    return kind if kind in SHAPES or kind == AUTO else "pipedream"


def auto_options(args: argparse.Namespace) -> dict[str, Any]:
    """``schedule="auto"``'s options from ``--pilot``, ``--pilot-on`` and ``--look-again``
    (only those given)."""
    return {k: v for k, v in (("pilot", args.pilot), ("where", args.pilot_on),
                              ("look_again", args.look_again)) if v is not None}


def cmd_train(args: argparse.Namespace) -> int:
    """The launcher: validate what can be validated here, then run torchrun with N workers."""
    _check_data(args.data)
    from fxpipe.runtime.schedules.spec import parse_schedule

    kind = parse_schedule(args.schedule).kind  # a misspelt schedule fails here, not in N workers
    if args.precision == "fp16":  # loss scaling needs a flushing schedule (replica/loss_scale.py)
        from fxpipe.runtime.schedules.schedule import SYNCHRONOUS_KINDS

        if kind not in SYNCHRONOUS_KINDS:
            raise ConfigError(f"--precision fp16 with --schedule {args.schedule}: dynamic loss "
                              "scaling needs one skip decision per batch on every stage",
                              f"use --schedule one of {', '.join(SYNCHRONOUS_KINDS)}, or "
                              "--precision bf16")
    if args.data == "digits":  # fail here, before torchrun starts N processes to say the same
        spec = _spec(args)
        digits_for(_input_shape(spec), args.model)
    elif args.data == "synthetic" and ".py:" in args.model:  # a user's model: can it train?
        _synthetic_ready(_spec(args), args.model)
    nproc = args.nproc
    if args.plan:
        from fxpipe.passes import Plan

        workers = sum(Plan.load(args.plan).replicas)
        if nproc is not None and nproc != workers:
            raise ConfigError(f"--nproc {nproc} but the plan {args.plan} needs {workers} "
                              "processes (one per stage replica)",
                              f"use --nproc {workers}, or re-plan for {nproc} workers")
        nproc = workers
    if nproc is None or nproc < 1:
        raise ConfigError(f"--nproc {nproc}", "give the number of processes, e.g. --nproc 4")
    from fxpipe.runtime.execution.ports import free_port  # torch-free: the launcher stays light

    worker = _worker_argv(args)
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
           "--master-addr=127.0.0.1", f"--master-port={free_port()}",
           "-m", "fxpipe.cli_train", *worker]
    log.info("launching: %s", " ".join(cmd))
    proc = subprocess.Popen(cmd)
    try:
        return proc.wait()
    except KeyboardInterrupt:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        return 130


def _worker_argv(args: argparse.Namespace) -> list[str]:
    """The parsed options back as command-line flags for the workers (minus --nproc)."""
    probe = argparse.ArgumentParser(add_help=False)
    _add_arguments(probe)
    out = [args.model]
    for action in probe._actions:
        if not action.option_strings or action.dest == "model":
            continue
        value = getattr(args, action.dest, action.default)
        flag = action.option_strings[0]
        if isinstance(action, argparse._StoreTrueAction):
            out += [flag] if value else []
        elif value is not None:
            out += [flag, str(value)]
    if getattr(args, "verbose", False):
        out.append("--verbose")
    return out


def _spec(args: argparse.Namespace) -> Any:
    """The ModelSpec MODEL names (zoo, hf:Class or file.py:factory)."""
    from fxpipe import models

    shape = (tuple(int(s) for s in args.input_shape.split(","))
             if getattr(args, "input_shape", None) else None)
    return models.resolve(args.model, size=args.size, batch_size=args.batch_size, seed=args.seed,
                          seq_len=args.seq_len, input_shape=shape)


SPEC_HINT = ("return fxpipe.models.ModelSpec(name=..., size='custom', model=model, "
             "example_inputs=(x,), loss_fn=F.cross_entropy, make_batch=lambda batch_size, seed: "
             "(inputs, target), batch_size=32) from the factory (docs/training.md), or give "
             "your own data with --data file.py:loaders")


def _synthetic_ready(spec: Any, model: str) -> None:
    """A user's model trains on ``--data synthetic`` only with a batch maker and a loss: said
    before torchrun starts, not after every rank has traced and planned it."""
    if spec.make_batch is None:
        raise ConfigError(f"{model} comes with no batch maker for --data synthetic (its factory "
                          "returned a model, not a ModelSpec)", SPEC_HINT)


def _input_shape(spec: Any) -> tuple[int, ...]:
    """Shape of the one positional input --data digits feeds."""
    inputs = spec.example_inputs
    if not isinstance(inputs, tuple) or len(inputs) != 1:
        raise ConfigError(f"--data digits feeds one image or vector input; {spec.name} takes "
                          f"{list(inputs) if isinstance(inputs, dict) else len(inputs)} inputs",
                          "use --data synthetic for this model")
    return tuple(inputs[0].shape)


def _loaders(args: argparse.Namespace, spec: Any) -> tuple[Any, Any]:
    from fxpipe.runtime.training.data import ShardedDataset, synthetic_loader

    bs = spec.batch_size
    if _is_file_spec(args.data):
        return _user_loaders(args.data)
    if args.data == "synthetic":
        _synthetic_ready(spec, args.model)
        return (synthetic_loader(spec.make_batch, bs, args.num_batches, args.seed),
                synthetic_loader(spec.make_batch, bs, args.eval_batches, args.seed + 1)
                if args.eval_batches > 0 else None)
    x, y = digits_for(_input_shape(spec), args.model)
    split = len(x) * 4 // 5
    return (ShardedDataset((x[:split],), y[:split], batch_size=bs, seed=args.seed, drop_last=True),
            ShardedDataset((x[split:],), y[split:], batch_size=bs, shuffle=False, drop_last=True))


def _user_loaders(text: str) -> tuple[Any, Any]:
    """``file.py:factory`` -> factory()'s (train, val) loaders (val may be None)."""
    from fxpipe.models import load_factory

    path, _, name = text.rpartition(":")
    usage = "--data file.py:factory, factory() returning (train, val) loaders"
    made = load_factory(path, name, kind="data", file_hint=usage, callable_hint=usage)()
    if isinstance(made, tuple) and len(made) == 2:
        return made[0], made[1]
    raise ConfigError(f"{text} returned {type(made).__name__}",
                      "return (train_loader, val_loader); val_loader may be None")


def _recipe(args: argparse.Namespace, compiled: Any, train: Any,
            model: Any = None) -> dict[str, Any]:
    """Optimizer (named groups) and per-update LR schedule from the flags; ``model`` names the
    embeddings and the head that Muon leaves to AdamW."""
    import math

    from fxpipe.runtime.training.param_names import embedding_and_head_names
    from fxpipe.runtime.training.recipes import OptimizerRecipe, SchedulerRecipe, WarmupCosine
    from fxpipe.runtime.schedules.spec import parse_schedule

    opt = OptimizerRecipe(args.optimizer, args.lr, weight_decay=args.weight_decay,
                          momentum=args.momentum,
                          not_muon=sorted(embedding_and_head_names(model)) if model is not None
                          else ())
    out: dict[str, Any] = {"optimizer": opt}
    if args.warmup or args.schedule_lr != "constant":
        total = args.total_steps
        if total is None:
            if not hasattr(train, "__len__"):
                raise ConfigError("--schedule-lr cosine over a loader without a length",
                                  "give --total-steps")
            kind = parse_schedule(args.schedule).kind
            # auto and pipedream update once per minibatch (auto cuts minibatches itself)
            group = 1 if kind == "pipedream" or (kind == "auto" and not args.microbatches) else (
                args.microbatches or sum(compiled.plan.replicas))
            total = args.epochs * math.ceil(len(train) / group)
        out["lr_scheduler"] = SchedulerRecipe(WarmupCosine(
            args.warmup, total, args.min_lr_ratio, cosine=args.schedule_lr == "cosine"))
    return out


def digits_for(shape: tuple[int, ...], model: str) -> tuple[Any, Any]:
    """scikit-learn's 8x8 digits shaped for a model's input: 64 features for a vector model,
    or images resized (bilinear) to its H x W and repeated over its channels for an image model,
    so any zoo classifier can train on a real dataset without downloads."""
    import torch
    import torch.nn.functional as F
    from sklearn.datasets import load_digits  # checked by _check_data

    data, target = load_digits(return_X_y=True)
    x = torch.tensor(data, dtype=torch.float32) / 16.0  # (1797, 64) in [0, 1]
    if len(shape) == 2 and shape[1] == 64:
        return x, torch.tensor(target, dtype=torch.long)
    if len(shape) == 4:
        images = F.interpolate(x.view(-1, 1, 8, 8), size=shape[2:], mode="bilinear",
                               align_corners=False)
        return images.expand(-1, shape[1], -1, -1).contiguous(), torch.tensor(target)
    raise ConfigError(f"--data digits gives 8x8 images (64 features); {model} takes inputs of "
                      f"shape {shape}", "use --data synthetic for this model")


def run_worker(args: argparse.Namespace) -> int:
    """One torchrun rank: build, compile, train; rank 0 prints the history."""
    import torch

    from fxpipe.api import compile as fx_compile
    from fxpipe.costmodel import Cluster
    from fxpipe.passes import Plan
    _check_data(args.data)
    if args.elastic:
        from fxpipe.cli_elastic import check_elastic

        check_elastic(args)
    rank = int(os.environ.get("RANK", "0"))
    spec = _spec(args)
    plan = Plan.load(args.plan) if args.plan else None
    cluster = Cluster.from_env(device=args.device, bandwidth=args.bandwidth)
    compiled = fx_compile(spec.model, cluster,
                          example_inputs=spec.example_inputs, loss_fn=spec.loss_fn, plan=plan,
                          stages=args.stages, straight=args.straight, tracer=args.tracer,
                          schedule=plan_schedule(args.schedule),
                          microbatches=args.microbatches, overheads=args.overheads,
                          shard=args.shard or "never")
    if rank == 0:  # the plan before training: its stages, speedups, and why it is what it is
        from fxpipe.cli_args import costs_line

        print(f"plan: replicas {compiled.plan.replicas}, schedule {args.schedule}\n"
              f"{compiled.summary()}\n{costs_line(compiled.profile, cluster)} (--device), "
              f"links of {args.bandwidth} (--bandwidth)", flush=True)
        if args.schedule == "localsgd":  # the table prices one pipeline, not the copies
            S, W = len(compiled.plan.replicas), cluster.workers
            print(f"localsgd trains {W // S} copies of this {S}-stage pipeline on "
                  f"{W // S * S} of the {W} workers: the figures above are for one copy",
                  flush=True)
    train, evaluate = _loaders(args, spec)
    from fxpipe.runtime.training.config import (CheckpointConfig, DataConfig, MetricsConfig,
                                                PrecisionConfig, RunConfig, ScheduleConfig)

    trainer = compiled.trainer(
        **_recipe(args, compiled, train, spec.model),  # the optimizer and its LR schedule
        schedule=ScheduleConfig(kind=args.schedule, vertical_sync=args.vertical_sync,
                                microbatches=args.microbatches, segment=args.segment,
                                noam=args.noam, auto=auto_options(args),
                                average_every=args.average_every),
        checkpoint=CheckpointConfig(dir=args.checkpoint_dir, every=args.checkpoint_every,
                                    overwrite=args.overwrite_checkpoints),
        precision=PrecisionConfig(mode=args.precision, clip_grad_norm=args.clip,  # recompute:
                                  recompute=True if args.recompute else None),  # or the plan's
        metrics=MetricsConfig(path=args.metrics, every=args.metrics_every,
                              progress=not args.no_progress, measure_memory=args.measure_memory),
        data=DataConfig(seed=args.seed, prefetch=args.prefetch),
        run=RunConfig(timeout_s=args.timeout,  # auto, or none given: as the plan was priced
                      shard=None if args.shard in (None, "auto") else args.shard))
    resume = args.resume
    if args.elastic:
        from fxpipe.cli_elastic import elastic_resume

        resume = elastic_resume(args, list(compiled.plan.replicas))
    t0 = time.perf_counter()
    history = trainer.fit(train, epochs=args.epochs, eval_loader=evaluate, resume=resume)
    state = trainer.state_dict() if args.save else None  # collective: rank 0 gets every stage
    if rank == 0 and getattr(compiled, "recipe", None):  # the schedule, why, the cut
        print(f"fxpipe trains:\n{compiled.recipe}", flush=True)
    if rank == 0 and args.verbose and trainer.auto_decision is not None:
        print(trainer.auto_decision.summary(), flush=True)  # auto's pilot table
    if rank == 0 and not trainer.idle:
        for h in history:
            extra = "".join(f", {k} {h[k]:.4f}" for k in ("eval_loss", "eval_accuracy") if k in h)
            print(f"epoch {int(h['epoch'])}: loss {h['loss']:.4f}, "
                  f"{h['samples_per_s']:.1f} samples/s{extra}", flush=True)
        print(f"trained in {time.perf_counter() - t0:.1f} s", flush=True)
        if args.measure_memory:
            from fxpipe.runtime.pricing.memory import memory_table

            print(f"memory per stage, predicted by the plan (priced for "
                  f"{compiled.plan.memory_rule.label()}) and measured (MiB):\n"
                  + memory_table(compiled.memory_check(trainer)), flush=True)
        if state is not None:
            torch.save(state, args.save)
    trainer.close()
    return 0


def launch_main(argv: Sequence[str]) -> int:
    """``python -m fxpipe.cli_train train MODEL ... --nproc N``: the launcher without the
    ``fxpipe`` command (what ``fxpipe train`` runs once the subcommand is registered)."""
    parser = argparse.ArgumentParser(prog="fxpipe")
    parser.add_argument("-v", "--verbose", action="store_true")
    add_train_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args))
    except FxpipeError as e:
        print(f"fxpipe: error: {e}", file=sys.stderr)
        return 2


def main(argv: Sequence[str] | None = None) -> int:
    """Worker entry point (``python -m fxpipe.cli_train``, under torchrun)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["train"]:
        return launch_main(argv)
    p = argparse.ArgumentParser(prog="fxpipe.cli_train", description="one rank of fxpipe train")
    _add_arguments(p)
    p.add_argument("-v", "--verbose", action="store_true")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format=f"%(levelname)s [rank {os.environ.get('RANK', '?')}] "
                               "%(name)s: %(message)s")
    try:
        return run_worker(args)
    except FxpipeError as e:
        print(f"fxpipe: error (rank {os.environ.get('RANK', '?')}): {e}", file=sys.stderr,
              flush=True)
        return 2


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # never hang in a broken process group's teardown
