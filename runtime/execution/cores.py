"""Whether the CPU ranks on this host ask for more cores than it has, and a warning if so.

A plan gives every worker a core; ranks sharing cores time-slice and run slower than the plan,
and nothing else would say why.
"""
from __future__ import annotations

import logging
import os

import torch

log = logging.getLogger(__name__)


def usable_cores() -> int:
    """The cores this process may run on (its affinity where the OS reports one)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def oversubscription(ranks: int, threads: int | None = None, cores: int | None = None
                     ) -> str | None:
    """A message when ``ranks`` CPU ranks of ``threads`` compute threads each (default: this
    process's ``torch.get_num_threads()``) need more than ``cores`` (default: usable here);
    None when they fit."""
    threads = torch.get_num_threads() if threads is None else threads
    cores = usable_cores() if cores is None else cores
    if ranks * threads <= cores:
        return None
    return (f"{ranks} CPU ranks x {threads} thread(s) share {cores} core(s) on this host: the "
            f"ranks time-slice, so the run is slower than its plan (which gives every worker a "
            f"core of its own) and may be slower than one process; run at most {cores} ranks "
            f"per host, or fewer threads per rank (torch.set_num_threads / OMP_NUM_THREADS)")


def warn_if_oversubscribed(ranks: int, device: str, threads: int | None = None) -> str | None:
    """Log :func:`oversubscription`'s message (CPU ranks only); returns it."""
    if device != "cpu":
        return None
    msg = oversubscription(ranks, threads)
    if msg is not None:
        log.warning("%s", msg)
    return msg
