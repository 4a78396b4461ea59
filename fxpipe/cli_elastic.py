"""``fxpipe.cli_train --elastic``: a worker that torchrun's elastic agent may restart on another
number of workers.

    # on each host (2 to 3 of them), the same command; host0 runs the c10d rendezvous store:
    torchrun --nnodes 2:3 --nproc-per-node 1 --max-restarts 3 --rdzv-backend c10d \\
        --rdzv-endpoint host0:29400 --rdzv-id job1 \\
        -m fxpipe.cli_train mlp --data synthetic --schedule 1f1b-flush --microbatches 4 \\
        --checkpoint-dir /shared/ckpt --checkpoint-every 4 --elastic

Membership is torchrun's (c10d rendezvous); fxpipe only has to start right after each
(re)start: the worker plans for the ``WORLD_SIZE`` the rendezvous gave it (as every start of
``cli_train`` does: ``Cluster.from_env()``, an estimated plan every rank derives identically) and
resumes from the newest COMPLETE checkpoint in the shared ``--checkpoint-dir`` whatever plan
wrote it (:mod:`fxpipe.runtime.training.repartition`), or starts from scratch when there is none. A
restart loses the minibatches trained since that checkpoint (they are trained again) and
nothing else.

Why every rank decides on its own: after a restart no worker of the old group is alive (the
agents stop them all before the new rendezvous), so every rank sees the same folder; which
checkpoint to load is then chosen by rank 0 and broadcast (``Trainer._resume``).
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
