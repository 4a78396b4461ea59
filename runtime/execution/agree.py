"""One plan per distributed job: rank 0 measures and plans, every other rank takes its result.

Ranks profiling on their own busy cores would get different costs and cuts, so only rank 0 does;
plan and profile travel through the job's store, every wait bounded, rank 0's errors passed on.
"""
from __future__ import annotations

import itertools
import json
import logging
import os
from datetime import timedelta
from typing import Any, Callable

import torch.distributed as dist

from ..errors import PeerError, RuntimeConfigError

log = logging.getLogger(__name__)

_calls = itertools.count()  # the n-th compile of every rank's script shares key n


def distributed_job() -> tuple[int, int] | None:
    """``(rank, world_size)`` when this process is a rank of a multi-process job (torchrun's
    environment variables), else None."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1 or "RANK" not in os.environ:
        return None
    return int(os.environ["RANK"]), world


def _store(timeout_s: float) -> Any:
    if dist.is_initialized():
        return dist.distributed_c10d._get_default_store()
    missing = [v for v in ("MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
    if missing:
        raise RuntimeConfigError(f"WORLD_SIZE > 1 but {', '.join(missing)} is not set",
                                 "launch the job with torchrun (or `fxpipe train --nproc N`)")
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                             is_master=False, timeout=timedelta(seconds=timeout_s))
    dist.init_process_group(init_method="env://", timeout=timedelta(seconds=timeout_s))
    return dist.distributed_c10d._get_default_store()


def shared(make: Callable[[], dict[str, Any]], what: str, timeout_s: float = 600.0
           ) -> dict[str, Any]:
    """Rank 0 runs ``make()`` (a JSON-able dict) and every rank returns what it made; outside a
    distributed job ``make()`` runs here. Other ranks wait at most ``timeout_s`` seconds, then
    raise :class:`PeerError` naming rank 0."""
    job = distributed_job()
    if job is None:
        return make()
    rank, world = job
    key = f"fxpipe/{what}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{next(_calls)}"
    store = _store(timeout_s)
    if rank == 0:
        try:
            made = make()
        except BaseException as err:
            store.set(key, json.dumps({"error": f"{type(err).__name__}: {err}"}))
            raise
        store.set(key, json.dumps({"value": made}))
        log.info("rank 0 shared the %s with %d other ranks", what, world - 1)
        return made
    store.set_timeout(timedelta(seconds=timeout_s))
    try:
        got = json.loads(store.get(key))
    except (RuntimeError, dist.DistStoreError) as err:
        raise PeerError(f"rank {rank}: waited {timeout_s:g} s for rank 0's {what}: {err}",
                        "look at rank 0's log: it crashed, or its profiling took longer (raise "
                        "plan_timeout_s)") from err
    if "error" in got:
        raise PeerError(f"rank {rank}: rank 0 failed to make the {what}: {got['error']}",
                        "fix the error rank 0 reports")
    return got["value"]
