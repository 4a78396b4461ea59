"""Run several distributed jobs in ONE spawned world (tests only), each recording its host
calls, which must pass the NCCL checker.

Why: spawning and importing torch costs several seconds per process on the test machine, while a
tiny run takes a fraction of a second. The world is the runtime's own
(:func:`fxpipe.runtime.execution.launch.run_rank_jobs`): every job goes through the real path
(process groups, Comm, RankExecutor, barrier); only the process start is shared.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from fxpipe.codegen.split import StageSpec
from fxpipe.runtime.execution.contract import RunResult
from fxpipe.runtime.execution.launch import RankJob, run_rank_jobs
from fxpipe.runtime.replica.step_options import DEFAULT, StepOptions
from fxpipe.runtime.schedules.ncclcheck import check_logs
from fxpipe.runtime.schedules.schedule import Schedule


@dataclass
class Job:
    stages: list[StageSpec]
    replicas: list[int]
    schedule: Schedule  # already with vertical sync applied where wanted
    loss_fn: Any
    optimizer_factory: Any
    batches: list[tuple[Any, Any]]
    options: StepOptions = DEFAULT  # clipping, precision, recomputation


def run_jobs(jobs: Sequence[Job], timeout_s: float = 30.0,
             join_timeout_s: float = 240.0) -> list[RunResult]:
    """Every job's RunResult, as run_distributed would return it. Every rank records its
    communication, and each job's logs must pass the NCCL checker (ncclcheck.check_logs): so
    every schedule and pipeline shape run here is also proven NCCL-safe."""
    results = run_rank_jobs([RankJob(list(j.stages), list(j.replicas), j.schedule, j.loss_fn,
                                     j.optimizer_factory, list(j.batches), record_comm=True,
                                     options=j.options) for j in jobs],
                            timeout_s=timeout_s, join_timeout_s=join_timeout_s)
    for res in results:
        check_logs(res.comm_logs)
    return results
