"""The command-line arguments that several ``fxpipe`` subcommands share, and what they name.

Kept apart from :mod:`fxpipe.cli` so each subcommand module (``cli_simulate``, ``cli_train``)
imports them without importing the command's entry point (which imports the subcommands).
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


def resolve_model(args: argparse.Namespace) -> Any:
    """The ModelSpec for MODEL (a zoo name, hf:Class[:k=v,...] or file.py:factory)."""
    from fxpipe import models

    shape = (tuple(int(s) for s in args.input_shape.split(","))
             if getattr(args, "input_shape", None) else None)
    return models.resolve(args.model, size=args.size, batch_size=args.batch_size,
                          seq_len=getattr(args, "seq_len", 128), meta=getattr(args, "meta", False),
                          input_shape=shape)


def profile_of(model: str) -> Path | None:
    """The profile file MODEL names (``pipedream:<name>``, a ``graph.txt`` or a
    ``profile.json``), or None when MODEL names a model to trace."""
    from fxpipe.models import pipedream

    if model.startswith(pipedream.PREFIX):
        return pipedream.profile_path(model)
    return Path(model) if Path(model).suffix in (".txt", ".json") else None


def load_profile(path: Path) -> Any:
    """The profile in ``path``: PipeDream's ``graph.txt`` format, else fxpipe's JSON."""
    from fxpipe.costmodel import Profile

    return Profile.from_pipedream(path) if path.suffix == ".txt" else Profile.load(path)


def costs_line(profile: Any, cluster: Any) -> str:
    """Where the plan's costs come from, in one line."""
    if "spread" in profile.meta:
        return (f"costs: measured on this machine ({profile.meta.get('threads', 1)} thread per "
                f"worker; spread of the measurements, IQR / median: "
                f"{100 * profile.meta['spread']:.1f}%)")
    if cluster.device is not None:
        return f"costs: estimated for {cluster.device} from each operation's FLOPs and bytes"
    if profile.source.startswith("pipedream:"):
        return (f"costs: measured on GPUs by PipeDream's authors, per minibatch of "
                f"{profile.batch_size} (their published profile {Path(profile.source).parent.name})")
    return f"costs: from the profile {profile.source!r}"


def add_recompute_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--recompute", default="never", choices=["never", "always", "auto"],
                   help="activation recomputation per stage (auto: where it makes the plan fit "
                   "in --memory or faster)")


def add_shard_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shard", default="never", choices=["never", "optimizer", "auto"],
                   help="split a replicated stage's optimizer state over its replicas (ZeRO-1: "
                   "less memory per worker, a broadcast of the new weights after each step; "
                   "auto: where it makes the plan fit in --memory or faster)")


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """Options of hf: models and of the tracer, shared by plan, simulate and train."""
    p.add_argument("--seq-len", type=int, default=128, help="tokens per sample (hf: models)")
    p.add_argument("--meta", action="store_true", help="build the hf: model on the meta device "
                   "(shapes only: plans a model larger than memory; needs --device)")
    p.add_argument("--tracer", default="auto", choices=["auto", "symbolic_trace", "export"])
    add_overheads_argument(p)


def add_overheads_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--overheads", default=None, choices=["auto", "measure", "off"],
                   help="the runtime's overheads per stage (calls, messages, stash copies) in the "
                   "plan: auto (default, or $FXPIPE_OVERHEADS): measured once on this machine's "
                   "CPU and cached; measure: again; off: the nodes' times alone")


def parse_noam(text: str) -> int | str:
    """``--noam``: auto, pipedream or a number of minibatches in flight at the input stage."""
    if text in ("auto", "pipedream"):
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--noam {text!r}: auto, pipedream or a number of "
                                         "minibatches") from None
