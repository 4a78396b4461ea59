"""Launch a pipeline on local processes: one spawned process per (stage, replica) rank.

Why spawn and files: ``spawn`` is the only start method that is safe with torch and CUDA, and
each rank writes its result (or its error message) to a file in a temporary folder, so the parent
never blocks on a queue a dead child would not drain. Children are always joined, and terminated
if they outlive the deadline, in a ``finally``.
"""
from __future__ import annotations

import logging
import socket
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.multiprocessing as mp

from fxpipe.codegen.split import StageSpec

from .errors import RuntimeConfigError, WorkerFailedError
from .placement import PlacedSchedule
from .worker import WorkerConfig, worker_main
from .reference import Batch, RunResult, check_schedule
from .schedule import Schedule
from .stage import LossFn
from .stash import OptimizerFactory
from .wire import make_wire_plan

log = logging.getLogger(__name__)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free right now on ``host`` (for the rendezvous)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def run_distributed(stages: Sequence[StageSpec], replicas: Sequence[int],
                    schedule: Schedule | PlacedSchedule,
                    loss_fn: LossFn, optimizer_factory: OptimizerFactory,
                    batches: Sequence[Batch], *, stashing: bool = True,
                    vertical_sync: bool = False, timeout_s: float = 60.0, device: str = "cpu",
                    master_addr: str = "127.0.0.1", port: int | None = None,
                    join_timeout_s: float | None = None,
                    faults: dict[int, tuple[str, int]] | None = None,
                    log_level: int = logging.WARNING, record_comm: bool = False) -> RunResult:
    """Train ``stages`` on ``batches`` with one process per rank; same result type (and, to
    rounding, same numbers) as :class:`ReferenceExecutor`.

    ``loss_fn`` and ``optimizer_factory`` must be picklable (module-level functions,
    ``functools.partial``). ``timeout_s`` bounds every wait of every rank. ``join_timeout_s``
    bounds the whole run (None: no bound, except that once a rank failed the others get
    ``timeout_s`` + 2 s to notice before they are terminated). ``faults`` (tests): rank index ->
    ("die" | "hang", action index). Raises :class:`WorkerFailedError` if any rank failed.
    ``device``: "cpu" (gloo), or "cuda" (NCCL; rank i on GPU i, see fxpipe.runtime.device).
    ``record_comm``: return every rank's communication log in ``RunResult.comm_logs`` (for
    :func:`fxpipe.runtime.commplan.check_logs`).

    A :class:`~fxpipe.runtime.placement.PlacedSchedule` (``interleaved-1f1b``, ``zb-v``: several
    stages per process) runs on its processes instead (:func:`~fxpipe.runtime.hosted_launch.
    run_placed`: gloo only; no vertical sync; ``comm_logs`` by process).
    """
    if isinstance(schedule, PlacedSchedule):
        if vertical_sync or tuple(replicas) != schedule.schedule.replicas:
            raise RuntimeConfigError(f"{schedule.kind} with vertical_sync={vertical_sync}, "
                                     f"replicas {list(replicas)}", "a placed schedule runs "
                                     "synchronously, with its own replicas "
                                     f"{list(schedule.schedule.replicas)}")
        from .hosted_launch import run_placed

        return run_placed(stages, schedule, loss_fn, optimizer_factory, batches,
                          timeout_s=timeout_s, join_timeout_s=join_timeout_s, device=device,
                          faults=faults, record_comm=record_comm, log_level=log_level)
    sched = schedule.with_vertical_sync() if vertical_sync else schedule
    check_schedule(stages, replicas, sched, len(batches))
    world = len(sched.ranks)
    wire = make_wire_plan(stages, [b[0] for b in batches])
    with tempfile.TemporaryDirectory(prefix="fxpipe-run-") as outdir:
        cfg = WorkerConfig(list(stages), sched.kind, tuple(sched.replicas), sched.num_minibatches,
                           dict(sched.actions), loss_fn, optimizer_factory, list(batches), wire,
                           outdir, port or free_port(master_addr), master_addr, timeout_s,
                           stashing, device, dict(faults or {}), log_level,
                           record_comm=record_comm, windows=tuple(sched.windows))
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=worker_main, args=(i, cfg), name=f"fxpipe-rank{i}",
                             daemon=True) for i in range(world)]
        run_children(procs, timeout_s, join_timeout_s)
        codes = {i: p.exitcode for i, p in enumerate(procs)}
        out = Path(outdir)
        errors = {i: (out / f"rank{i}.err").read_text() for i in range(world)
                  if (out / f"rank{i}.err").exists()}
        if any(c != 0 for c in codes.values()):
            lines = [f"rank {i}: exit code {c}" + (f": {errors[i]}" if i in errors else "")
                     for i, c in codes.items() if c != 0]
            raise WorkerFailedError("distributed run failed:\n" + "\n".join(lines),
                                    "the first failing rank's message names the peer that died "
                                    "or hung", codes, errors)
        results: list[dict[str, Any]] = [torch.load(out / f"rank{i}.pt", weights_only=False)
                                         for i in range(world)]
    losses: dict[int, float] = {}
    for r in results:
        losses.update(r["losses"])
    rp = {rank: results[i]["params"] for i, rank in enumerate(sched.ranks)}
    return RunResult([losses[k] for k in range(sched.num_minibatches)],
                     [rp[(s, 0)] for s in range(len(stages))], rp,
                     {rank: results[i]["peak_bytes"] for i, rank in enumerate(sched.ranks)},
                     {i: r.get("timeline", []) for i, r in enumerate(results)},
                     {i: r.get("background", []) for i, r in enumerate(results)},
                     {i: r["comm_log"] for i, r in enumerate(results)
                      if r.get("comm_log") is not None})


def run_children(procs: list[Any], timeout_s: float, join_timeout_s: float | None) -> None:
    """Start the child processes, wait for them (:func:`_join`), and terminate, then kill, any
    still alive, so no child outlives the call (run_distributed's and run_placed's launch)."""
    try:
        for p in procs:
            p.start()
        _join(procs, timeout_s, join_timeout_s)
    finally:
        for p in procs:
            if p.is_alive():
                log.error("terminating %s (pid %s)", p.name, p.pid)
                p.terminate()
                p.join(5)
                if p.is_alive():
                    p.kill()
                    p.join(5)


def _join(procs: list[Any], timeout_s: float, join_timeout_s: float | None) -> None:
    """Wait for every child; after the first failure give the rest a grace period."""
    start = time.monotonic()
    failed_at: float | None = None
    while any(p.is_alive() for p in procs):
        now = time.monotonic()
        if failed_at is None and any(p.exitcode not in (None, 0) for p in procs):
            failed_at = now
        if failed_at is not None and now - failed_at > timeout_s + 2:
            return
        if join_timeout_s is not None and now - start > join_timeout_s:
            return
        for p in procs:
            p.join(0.05)
