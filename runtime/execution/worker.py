"""What a spawned rank runs: join the process group, carry out one or more runs, report back.

``launch`` hands each child one :class:`WorkerConfig` per run for :func:`worker_main`, which
joins the world once and carries the runs out one after another (:func:`run_rank` each).
"""
from __future__ import annotations

import logging
import os
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from fxpipe.codegen.split import StageSpec
from fxpipe.errors import FxpipeError
from fxpipe.host_memory import keep_freed_memory

from ..replica.clipping import GROUP
from ..replica.device import rank_device
from ..replica.stage import LossFn, tie_sets, tied_parameters
from ..replica.stash import OptimizerFactory
from ..replica.step_options import DEFAULT, StepOptions
from ..schedules.localsgd import DEFAULT_AVERAGE_EVERY, LOCALSGD, LocalSGDSchedule
from ..schedules.schedule import Action, Rank, Schedule
from ..timeline import Recorder
from .buckets import DEFAULT_BUCKET_BYTES
from .comm import Comm, make_groups, rank_name, synchronized_start
from .contract import Batch
from .executor import ActionHook, RankExecutor, RankResult
from .wire import WirePlan

log = logging.getLogger(__name__)


@dataclass
class WorkerConfig:
    """Everything a rank needs, pickled once to each spawned process."""

    stages: list[StageSpec]
    schedule_kind: str
    replicas: tuple[int, ...]
    num_minibatches: int
    actions: dict[Rank, tuple[Action, ...]]
    loss_fn: LossFn
    optimizer_factory: OptimizerFactory
    batches: list[Batch]
    wire: WirePlan
    outdir: str
    port: int
    master_addr: str = "127.0.0.1"
    timeout_s: float = 60.0
    stashing: bool = True
    device: str = "cpu"
    hooks: dict[int, ActionHook] = field(default_factory=dict)
    log_level: int = logging.WARNING
    overlap_allreduce: bool = True
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    record_comm: bool = False  # keep every host call of the Comm (for the NCCL checker)
    windows: tuple[int, ...] = ()  # the schedule's in-flight windows (tied delay needs them)
    options: StepOptions = DEFAULT  # clipping, precision, recomputation
    average_every: int | None = None  # LocalSGD's H (its schedule only)

    def schedule(self) -> Schedule:
        if self.schedule_kind == LOCALSGD:
            return LocalSGDSchedule(self.schedule_kind, self.replicas, self.num_minibatches,
                                    self.actions, windows=self.windows,
                                    average_every=self.average_every or DEFAULT_AVERAGE_EVERY)
        return Schedule(self.schedule_kind, self.replicas, self.num_minibatches, self.actions,
                        windows=self.windows)


def worker_device(index: int, cfg: WorkerConfig) -> torch.device:
    """Spawned ranks all run on this machine: rank ``index`` is local rank ``index`` (so
    ``device="cuda"`` puts rank i on GPU i, as torchrun's LOCAL_RANK does)."""
    return rank_device(cfg.device, env={"LOCAL_RANK": str(index)})


def init_rank(index: int, cfg: WorkerConfig, world_size: int | None = None) -> float:
    """Join the world's process group (of ``world_size`` ranks, default: the schedule's);
    returns the timeline's common start (taken after a barrier)."""
    keep_freed_memory()
    device = worker_device(index, cfg)
    extra: dict[str, Any] = {}
    if device.type == "cuda":
        torch.cuda.set_device(device)  # before NCCL's first call (batch and barrier need it)
        extra["device_id"] = device
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = timedelta(seconds=max(cfg.timeout_s, 60.0))  # rendezvous waits for slow spawns
    dist.init_process_group(backend, init_method=f"tcp://{cfg.master_addr}:{cfg.port}",
                            rank=index, world_size=world_size or len(cfg.schedule().ranks),
                            timeout=timeout, **extra)
    warm_imports()
    return synchronized_start(max(cfg.timeout_s, 60.0))


def warm_imports() -> None:
    """Pay the lazy imports of the first optimizer before the timeline's common start.

    Why: ``torch.optim.Optimizer`` imports ``torch._dynamo`` on first use (about 1.3 s on CPU),
    which otherwise lands between the timeline's zero and the first forward of every rank (the
    executor builds its optimizer after the start) and reads as start-up idle time."""
    import torch._dynamo  # noqa: F401


def run_rank(index: int, cfg: WorkerConfig, t0: float) -> RankResult | None:
    """Carry out one run as rank ``index`` of an initialised world (several runs may follow one
    another in the same world: each creates its groups and ends with a barrier). A world larger
    than the pipeline is allowed: a spare rank (``index`` past the schedule's ranks) only joins
    the collective calls (group creation, final barrier) and returns None."""
    sched = cfg.schedule()
    rank_of = {r: i for i, r in enumerate(sched.ranks)}
    ties = list(tie_sets(tied_parameters(cfg.stages)))
    groups = make_groups(sched.replicas, rank_of, ties, cfg.timeout_s,
                         extra=(GROUP,) if cfg.options.global_group else ())
    if index >= len(sched.ranks):
        dist.barrier(async_op=True).wait(timeout=timedelta(seconds=cfg.timeout_s))
        return None
    me = sched.ranks[index]
    device = worker_device(index, cfg)
    rec = Recorder(t0, args={"stage": me[0], "replica": me[1], "rank": index})
    comm = Comm(me, rank_of, len(cfg.wire.values), cfg.timeout_s, device, groups, recorder=rec,
                record=cfg.record_comm)
    ex = RankExecutor(cfg.stages, sched, me, cfg.loss_fn, cfg.optimizer_factory, cfg.wire,
                      comm, stashing=cfg.stashing, device=device, before_action=cfg.hooks.get(index),
                      recorder=rec, overlap_allreduce=cfg.overlap_allreduce,
                      bucket_bytes=cfg.bucket_bytes, options=cfg.options)
    return ex.run(cfg.batches)


def worker_main(index: int, cfgs: list[WorkerConfig]) -> None:
    """Entry point of process ``index``: join a world as large as the largest run, carry out
    every run of ``cfgs`` in turn (``job<n>-rank<index>.pt`` each, none where the run has no
    rank ``index``), or log the error and exit non-zero.

    Exits with ``os._exit`` on failure so that a broken process group cannot hang the exit.
    """
    torch.set_num_threads(1)
    first = cfgs[0]
    logging.basicConfig(level=first.log_level,
                        format=f"%(asctime)s [rank {index}] %(name)s %(levelname)s: %(message)s")
    widest = max((c.schedule() for c in cfgs), key=lambda sc: len(sc.ranks))
    me = widest.ranks[index]
    out = Path(first.outdir)
    try:
        t0 = init_rank(index, first, world_size=len(widest.ranks))
        for n, cfg in enumerate(cfgs):
            result = run_rank(index, cfg, t0)
            if result is not None:
                torch.save(result.__dict__, out / f"job{n}-rank{index}.pt")
        dist.destroy_process_group()
    except BaseException as err:  # noqa: BLE001 - every failure must end the process non-zero
        fail(out, index, me, err)


def fail(out: Path, index: int, me: Rank, err: BaseException) -> None:
    """Log ``err``, write it to ``rank<i>.err`` for the launcher, and exit non-zero at once."""
    fail_child(out / f"rank{index}.err", rank_name(me, index), err)


def fail_child(err_file: Path, name: str, err: BaseException) -> None:
    """Log ``err`` as ``name``'s, write it to ``err_file`` for the launcher (an fxpipe error
    as its message, anything else with its traceback), and exit non-zero at once."""
    text = (f"{name}: {err}" if isinstance(err, FxpipeError)
            else f"{name}: {type(err).__name__}: {err}\n{traceback.format_exc()}")
    log.error("%s", text)
    err_file.write_text(text)
    logging.shutdown()
    os._exit(1)
