"""Run several distributed jobs in ONE spawned world (tests only).

Why: spawning and importing torch costs several seconds per process on the test machine, while a
tiny run takes a fraction of a second. Every job here goes through the real runtime path
(``init_rank`` once, then ``run_rank`` per job: process groups, Comm, RankExecutor, barrier), only
the process start is shared. The world has as many ranks as the largest job; the spare ranks of
a smaller job sit it out (``run_rank`` returns None for them).
"""
from __future__ import annotations

import logging
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fxpipe.codegen.split import StageSpec
from fxpipe.runtime.schedules.ncclcheck import check_logs
from fxpipe.runtime.errors import WorkerFailedError
from fxpipe.runtime.execution.worker import WorkerConfig, fail, init_rank, run_rank
from fxpipe.runtime.execution.launch import free_port
from fxpipe.runtime.execution.contract import RunResult, check_schedule
from fxpipe.runtime.schedules.schedule import Schedule
from fxpipe.runtime.replica.step_options import DEFAULT, StepOptions
from fxpipe.runtime.execution.wire import make_wire_plan


@dataclass
class Job:
    stages: list[StageSpec]
    replicas: list[int]
    schedule: Schedule  # already with vertical sync applied where wanted
    loss_fn: Any
    optimizer_factory: Any
    batches: list[tuple[Any, Any]]
    options: StepOptions = DEFAULT  # clipping, precision, recomputation


def _worker(index: int, cfgs: list[WorkerConfig], outdir: str) -> None:
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING)
    out = Path(outdir)
    world = max(len(c.schedule().ranks) for c in cfgs)
    me = max((c.schedule() for c in cfgs), key=lambda s: len(s.ranks)).ranks[index]
    try:
        t0 = init_rank(index, cfgs[0], world)
        for j, cfg in enumerate(cfgs):
            res = run_rank(index, cfg, t0)
            if res is not None:
                torch.save(res.__dict__, out / f"job{j}-rank{index}.pt")
        dist.destroy_process_group()
    except BaseException as err:  # noqa: BLE001
        fail(out, index, me, err)


def run_jobs(jobs: Sequence[Job], timeout_s: float = 30.0,
             join_timeout_s: float = 240.0) -> list[RunResult]:
    """Every job's RunResult, as run_distributed would return it. Every rank records its
    communication, and each job's logs must pass the NCCL checker (ncclcheck.check_logs): so
    every schedule and pipeline shape run here is also proven NCCL-safe."""
    world = max(len(j.schedule.ranks) for j in jobs)
    with tempfile.TemporaryDirectory(prefix="fxpipe-jobs-") as outdir:
        port = free_port()
        cfgs = []
        for j in jobs:
            check_schedule(j.stages, j.replicas, j.schedule, len(j.batches))
            s = j.schedule
            cfgs.append(WorkerConfig(
                stages=list(j.stages), schedule_kind=s.kind, replicas=tuple(s.replicas),
                num_minibatches=s.num_minibatches, actions=dict(s.actions), loss_fn=j.loss_fn,
                optimizer_factory=j.optimizer_factory, batches=list(j.batches),
                wire=make_wire_plan(j.stages, [b[0] for b in j.batches],
                                    precision=j.options.precision), outdir=outdir,
                port=port, timeout_s=timeout_s, record_comm=True, windows=tuple(s.windows),
                options=j.options))
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=_worker, args=(i, cfgs, outdir), daemon=True)
                 for i in range(world)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + join_timeout_s
        try:
            for p in procs:
                p.join(max(0.1, deadline - time.monotonic()))
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join(5)
        out = Path(outdir)
        codes = {i: p.exitcode for i, p in enumerate(procs)}
        if any(c != 0 for c in codes.values()):
            errors = {i: (out / f"rank{i}.err").read_text() for i in range(world)
                      if (out / f"rank{i}.err").exists()}
            raise WorkerFailedError(f"jobs failed: {codes} {errors}", None, codes, errors)
        results = []
        for j, job in enumerate(jobs):
            ranks = job.schedule.ranks
            rs = [torch.load(out / f"job{j}-rank{i}.pt", weights_only=False)
                  for i in range(len(ranks))]
            losses: dict[int, float] = {}
            for r in rs:
                losses.update(r["losses"])
            rp = {rank: rs[i]["params"] for i, rank in enumerate(ranks)}
            results.append(RunResult(
                [losses[k] for k in range(job.schedule.num_minibatches)],
                [rp[(s, 0)] for s in range(len(job.stages))], rp,
                {rank: rs[i]["peak_bytes"] for i, rank in enumerate(ranks)},
                {i: r["timeline"] for i, r in enumerate(rs)},
                comm_logs={i: r["comm_log"] for i, r in enumerate(rs)}))
            check_logs(results[-1].comm_logs)
    return results
