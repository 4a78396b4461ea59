"""Launch a pipeline on local processes: one per rank, or one per process of a placed schedule.

Children are spawned (the start method safe with torch and CUDA) and each writes its result or
error to a file, so the parent never blocks on a dead child; all are joined or terminated.
"""
from __future__ import annotations

import logging
import tempfile
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fxpipe.codegen.split import StageSpec

from ..errors import RuntimeConfigError, WorkerFailedError
from ..replica.stage import LossFn
from ..replica.stash import OptimizerFactory
from ..replica.step_options import DEFAULT, StepOptions
from ..schedules.placement import PlacedSchedule, validate_placed
from ..schedules.schedule import Schedule
from .comm import make_groups, synchronized_start
from .contract import Batch, RunResult, check_schedule
from .cores import warn_if_oversubscribed
from .executor import ActionHook
from .hosted import ProcessExecutor, check_hostable
from .ports import free_port
from .wire import WirePlan, make_wire_plan
from .worker import WorkerConfig, fail_child, warm_imports, worker_main

log = logging.getLogger(__name__)


def run_distributed(stages: Sequence[StageSpec], replicas: Sequence[int],
                    schedule: Schedule | PlacedSchedule,
                    loss_fn: LossFn, optimizer_factory: OptimizerFactory,
                    batches: Sequence[Batch], *, stashing: bool = True,
                    vertical_sync: bool = False, timeout_s: float = 60.0, device: str = "cpu",
                    master_addr: str = "127.0.0.1", port: int | None = None,
                    join_timeout_s: float | None = None,
                    hooks: dict[int, ActionHook] | None = None,
                    log_level: int = logging.WARNING, record_comm: bool = False) -> RunResult:
    """Train ``stages`` on ``batches`` with one process per rank; same result type (and, to
    rounding, same numbers) as :class:`ReferenceExecutor`.

    ``loss_fn`` and ``optimizer_factory`` must be picklable (module-level functions,
    ``functools.partial``). ``timeout_s`` bounds every wait of every rank. ``join_timeout_s``
    bounds the whole run (None: no bound, except that once a rank failed the others get
    ``timeout_s`` + 2 s to notice before they are terminated). ``hooks``: rank index -> a
    picklable callable, run in that rank before each of its actions as ``hook(index, action)``
    (what the tests inject faults with: a rank that dies or hangs at an action). Raises
    :class:`WorkerFailedError` if any rank failed.
    ``device``: "cpu" (gloo), or "cuda" (NCCL; rank i on GPU i, see fxpipe.runtime.replica.device).
    ``record_comm``: return every rank's communication log in ``RunResult.comm_logs`` (for
    :func:`fxpipe.runtime.schedules.ncclcheck.check_logs`).

    A :class:`~fxpipe.runtime.schedules.placement.PlacedSchedule` (``interleaved-1f1b``, ``zb-v``:
    several stages per process) runs on its processes instead (:func:`run_placed`: gloo only; no
    vertical sync; ``comm_logs`` by process).
    """
    if isinstance(schedule, PlacedSchedule):
        if vertical_sync or tuple(replicas) != schedule.schedule.replicas:
            raise RuntimeConfigError(f"{schedule.kind} with vertical_sync={vertical_sync}, "
                                     f"replicas {list(replicas)}", "a placed schedule runs "
                                     "synchronously, with its own replicas "
                                     f"{list(schedule.schedule.replicas)}")
        return run_placed(stages, schedule, loss_fn, optimizer_factory, batches,
                          timeout_s=timeout_s, join_timeout_s=join_timeout_s, device=device,
                          hooks=hooks, record_comm=record_comm, log_level=log_level)
    sched = schedule.with_vertical_sync() if vertical_sync else schedule
    job = RankJob(list(stages), list(replicas), sched, loss_fn, optimizer_factory, list(batches),
                  stashing=stashing, hooks=dict(hooks or {}), record_comm=record_comm)
    return run_rank_jobs([job], timeout_s=timeout_s, device=device, master_addr=master_addr,
                         port=port, join_timeout_s=join_timeout_s, log_level=log_level)[0]


@dataclass
class RankJob:
    """One run of a rank schedule (one process per rank) for :func:`run_rank_jobs`."""

    stages: list[StageSpec]
    replicas: list[int]
    schedule: Schedule  # with vertical sync applied where wanted
    loss_fn: LossFn
    optimizer_factory: OptimizerFactory
    batches: list[Batch]
    stashing: bool = True
    hooks: dict[int, ActionHook] = field(default_factory=dict)
    """Rank index -> a callable run before each of its actions (see :func:`run_distributed`)."""
    record_comm: bool = False
    options: StepOptions = DEFAULT


def run_rank_jobs(jobs: Sequence[RankJob], *, timeout_s: float = 60.0, device: str = "cpu",
                  master_addr: str = "127.0.0.1", port: int | None = None,
                  join_timeout_s: float | None = None,
                  log_level: int = logging.WARNING) -> list[RunResult]:
    """Run ``jobs`` one after another in one world of spawned processes, as many as the widest
    job has ranks (a smaller job's spare ranks sit it out); each job's :class:`RunResult` as
    :func:`run_distributed` returns it. Why one world: starting a process and importing torch
    costs seconds, a small run a fraction of one. Raises :class:`WorkerFailedError` naming
    every failed rank."""
    jobs = list(jobs)
    if not jobs:
        raise RuntimeConfigError("no jobs to run", "pass at least one RankJob")
    for j in jobs:
        check_schedule(j.stages, j.replicas, j.schedule, len(j.batches))
    world = max(len(j.schedule.ranks) for j in jobs)
    warn_if_oversubscribed(world, device, threads=1)  # a spawned rank computes on one thread
    with tempfile.TemporaryDirectory(prefix="fxpipe-run-") as outdir:
        port = port or free_port(master_addr)
        cfgs = [WorkerConfig(j.stages, j.schedule.kind, tuple(j.schedule.replicas),
                             j.schedule.num_minibatches, dict(j.schedule.actions), j.loss_fn,
                             j.optimizer_factory, j.batches,
                             make_wire_plan(j.stages, [b[0] for b in j.batches],
                                            precision=j.options.precision),
                             outdir, port, master_addr, timeout_s, j.stashing, device,
                             j.hooks, log_level, record_comm=j.record_comm,
                             windows=tuple(j.schedule.windows), options=j.options,
                             average_every=getattr(j.schedule, "average_every", None))
                for j in jobs]
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=worker_main, args=(i, cfgs), name=f"fxpipe-rank{i}",
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
        return [_rank_result(j, [torch.load(out / f"job{n}-rank{i}.pt", weights_only=False)
                                 for i in range(len(j.schedule.ranks))])
                for n, j in enumerate(jobs)]


def _rank_result(job: RankJob, results: list[dict[str, Any]]) -> RunResult:
    sched = job.schedule
    losses: dict[int, float] = {}
    for r in results:
        losses.update(r["losses"])
    rp = {rank: results[i]["params"] for i, rank in enumerate(sched.ranks)}
    return RunResult([losses[k] for k in range(sched.num_minibatches)],
                     [rp[(s, 0)] for s in range(len(job.stages))], rp,
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


@dataclass
class PlacedJob:
    """One run of a placed schedule (pickled to every spawned process)."""

    stages: list[StageSpec]
    placed: PlacedSchedule
    loss_fn: LossFn
    optimizer_factory: OptimizerFactory
    batches: list[Batch]
    options: StepOptions = DEFAULT
    wire: WirePlan | None = field(default=None)
    hooks: dict[int, ActionHook] = field(default_factory=dict)
    """Process index -> a callable run before each step of its merged list."""
    record_comm: bool = False  # keep every process's host calls (ncclcheck.check_logs)


def _worker(index: int, jobs: list[PlacedJob], outdir: str, port: int, timeout_s: float,
            log_level: int) -> None:
    """Process ``index``: join the world, run every job (its part of it), save the results."""
    torch.set_num_threads(1)
    logging.basicConfig(level=log_level,
                        format=f"%(asctime)s [process {index}] %(name)s %(levelname)s: "
                               "%(message)s")
    out = Path(outdir)
    world = max(j.placed.num_processes for j in jobs)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=index,
                                world_size=world,
                                timeout=timedelta(seconds=max(timeout_s, 60.0)))
        warm_imports()  # the first optimizer's lazy import, before the timeline's zero
        t0 = synchronized_start(max(timeout_s, 60.0))
        for n, job in enumerate(jobs):
            rank_of = {r: p for p, h in enumerate(job.placed.hosts) for r in h}
            # every process of the world creates every job's groups (new_group is collective)
            groups = make_groups(job.placed.schedule.replicas, rank_of, [], timeout_s)
            if index >= job.placed.num_processes:
                dist.barrier(async_op=True).wait(timeout=timedelta(seconds=timeout_s))
                continue
            assert job.wire is not None
            ex = ProcessExecutor(job.stages, job.placed, index, job.loss_fn,
                                 job.optimizer_factory, job.wire, rank_of, timeout_s, t0,
                                 groups=groups, options=job.options,
                                 before_action=job.hooks.get(index), record_comm=job.record_comm)
            res = ex.run(job.batches)
            torch.save({r: v.__dict__ for r, v in res.items()}, out / f"job{n}-p{index}.pt")
        dist.destroy_process_group()
    except BaseException as err:  # noqa: BLE001 - every failure must end the process non-zero
        fail_child(out / f"p{index}.err", f"process {index}", err)


def run_placed_jobs(jobs: Sequence[PlacedJob], *, timeout_s: float = 60.0,
                    join_timeout_s: float | None = None,
                    log_level: int = logging.WARNING) -> list[RunResult]:
    """Run ``jobs`` one after another in one world of spawned gloo processes (as many as the
    largest placement); each job's :class:`RunResult` as :func:`run_placed` returns it. Raises
    :class:`WorkerFailedError` naming every failed process."""
    jobs = list(jobs)
    for j in jobs:
        validate_placed(j.placed)
        check_hostable(j.stages, j.placed, "cpu", j.options)
        check_schedule(j.stages, j.placed.schedule.replicas, j.placed.schedule, len(j.batches))
        if j.wire is None:
            j.wire = make_wire_plan(j.stages, [b[0] for b in j.batches],
                                    precision=j.options.precision)
    world = max(j.placed.num_processes for j in jobs)
    warn_if_oversubscribed(world, "cpu", threads=1)
    with tempfile.TemporaryDirectory(prefix="fxpipe-placed-") as outdir:
        ctx = mp.get_context("spawn")
        args = (jobs, outdir, free_port(), timeout_s, log_level)
        procs = [ctx.Process(target=_worker, args=(i,) + args, name=f"fxpipe-process{i}",
                             daemon=True) for i in range(world)]
        run_children(procs, timeout_s, join_timeout_s)
        out = Path(outdir)
        codes = {i: p.exitcode for i, p in enumerate(procs)}
        if any(c != 0 for c in codes.values()):
            errors = {i: (out / f"p{i}.err").read_text() for i in codes
                      if (out / f"p{i}.err").exists()}
            lines = [f"process {i}: exit code {c}" + (f": {errors[i]}" if i in errors else "")
                     for i, c in codes.items() if c != 0]
            raise WorkerFailedError("distributed run failed:\n" + "\n".join(lines),
                                    "the first failing process's message names the peer that "
                                    "died or hung", codes, errors)
        results = []
        for n, job in enumerate(jobs):
            per: dict[Any, dict[str, Any]] = {}
            for p in range(job.placed.num_processes):
                per.update(torch.load(out / f"job{n}-p{p}.pt", weights_only=False))
            results.append(_result(job.placed, per))
    return results


def _result(placed: PlacedSchedule, per: dict[Any, dict[str, Any]]) -> RunResult:
    sched = placed.schedule
    losses: dict[int, float] = {}
    for r in per.values():
        losses.update(r["losses"])
    ranks = sched.ranks
    logs = {p: per[h[0]]["comm_log"] for p, h in enumerate(placed.hosts)
            if per[h[0]].get("comm_log") is not None}  # comm_logs: by PROCESS
    return RunResult([losses[k] for k in range(sched.num_minibatches)],
                     [per[(s, 0)]["params"] for s in range(sched.num_stages)],
                     {r: per[r]["params"] for r in ranks},
                     {r: per[r]["peak_bytes"] for r in ranks},
                     {i: per[r]["timeline"] for i, r in enumerate(ranks)}, {}, logs)


def run_placed(stages: Sequence[StageSpec], placed: PlacedSchedule, loss_fn: LossFn,
               optimizer_factory: OptimizerFactory, batches: Sequence[Batch], *,
               timeout_s: float = 60.0, join_timeout_s: float | None = None,
               device: str = "cpu", options: StepOptions = DEFAULT,
               hooks: dict[int, ActionHook] | None = None, record_comm: bool = False,
               log_level: int = logging.WARNING) -> RunResult:
    """Train ``stages`` on ``batches`` under ``placed`` with one gloo process per process of the
    placement; same result type (and, to rounding, numbers) as the reference executor running
    ``placed.schedule``. ``timeout_s`` bounds every wait; a process that dies or hangs makes
    the others fail with a :class:`~fxpipe.runtime.errors.PeerError` naming it, and this call
    raise :class:`WorkerFailedError` (``hooks``: process index -> a callable run before each
    step of its merged list, as ``hook(step, action)``).
    ``record_comm``: every process's host calls in ``RunResult.comm_logs`` (by process), for
    :func:`fxpipe.runtime.schedules.ncclcheck.check_logs`."""
    check_hostable(stages, placed, device, options)
    return run_placed_jobs([PlacedJob(list(stages), placed, loss_fn, optimizer_factory,
                                      list(batches), options, hooks=dict(hooks or {}),
                                      record_comm=record_comm)],
                           timeout_s=timeout_s,
                           join_timeout_s=join_timeout_s, log_level=log_level)[0]
