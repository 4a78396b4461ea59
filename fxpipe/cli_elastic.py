"""``fxpipe.cli_train --elastic``: a worker that torchrun's elastic agent may restart.

Membership is torchrun's (c10d rendezvous); each (re)start plans for the ``WORLD_SIZE`` it was
given and resumes from the newest complete checkpoint in the shared ``--checkpoint-dir``, whatever
plan wrote it (:mod:`fxpipe.runtime.training.repartition`), or starts from scratch.
"""
from __future__ import annotations

import argparse
import os

from fxpipe.errors import ConfigError


def check_elastic(args: argparse.Namespace) -> None:
    """Refuse options an elastic job cannot have (before anything is compiled)."""
    if not args.checkpoint_dir:
        raise ConfigError("--elastic without --checkpoint-dir",
                          "give a --checkpoint-dir every host can read and write")
    if args.plan:
        raise ConfigError("--elastic with a fixed --plan",
                          "leave --plan out: an elastic job re-plans for every world size")


def elastic_resume(args: argparse.Namespace, replicas: list[int]) -> bool:
    """Whether this (re)start resumes: True when ``--checkpoint-dir`` holds a complete
    checkpoint. Prints one line on rank 0 saying what the restart does."""
    from fxpipe.runtime.training.checkpoint import CheckpointError, find_latest

    check_elastic(args)
    try:
        found = find_latest(args.checkpoint_dir, None)
    except CheckpointError:
        found = None
    if int(os.environ.get("RANK", "0")) == 0:
        what = (f"resuming from {found.folder.name} ({found.manifest.get('num_stages')} stages, "
                f"replicas {found.manifest.get('replicas')})" if found else "starting fresh")
        print(f"elastic: restart {os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}, world "
              f"{os.environ.get('WORLD_SIZE', '1')}, plan replicas {replicas}: {what}",
              flush=True)
    return found is not None
