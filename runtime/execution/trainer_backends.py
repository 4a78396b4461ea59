"""How a ``Trainer`` carries out one segment of training: two backends with one interface.

:class:`ReferenceBackend` runs every rank in this process; :class:`DistributedBackend` is one rank
of a torchrun job; a rank the plan does not need gets an :class:`IdleBackend` and leaves.
"""
from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import logging
import os
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from fxpipe.codegen.split import StageSpec
from fxpipe.host_memory import keep_freed_memory, release_freed_memory

from ..errors import PeerError, RuntimeConfigError
from ..replica.clipping import GROUP
from ..replica.device import CudaClock, pinned, rank_device
from ..replica.live_bytes import PeakMemory, reachable_storages
from ..replica.precision import autocast
from ..replica.stage import LossFn, StageReplica, model_env, tie_sets, tied_parameters
from ..replica.stash import OptimizerFactory
from ..replica.step_options import DEFAULT, StepOptions
from ..replica.weighted import Weighted
from ..schedules.localsgd import LOCALSGD, LocalSGDSchedule
from ..schedules.schedule import Rank, Schedule
from ..schedules.spec import Mitigation
from ..timeline import Recorder, TimelineEvent
from .comm import Comm, make_groups, rank_name
from .contract import Batch
from .cores import warn_if_oversubscribed
from .leave import close_at_exit
from .localsgd_executor import LocalSGDExecutor
from .reference import ReferenceExecutor
from .wire import StretchWire, WirePlan, crossing_values

log = logging.getLogger(__name__)

COMM_LOG_ENV = "FXPIPE_COMM_LOG_DIR"
"""Debugging and tests: when set to a folder, every rank records its host calls (posts, waits,
collectives) and writes one JSON file per stretch and per evaluation
(``<port>-b<backend>-rank<i>-<n>.json``) for :func:`fxpipe.runtime.schedules.ncclcheck.check_logs`
to replay under NCCL's rules (``tests/runtime/conftest.py`` does, after every test)."""
_BACKENDS = 0

Metrics = list[float]  # [loss sum, minibatches, correct predictions, samples with a label]


def eval_metrics(loss_fn: LossFn, out: Any, target: Any) -> torch.Tensor:
    """[loss, what it counts for, correct top-1 predictions, labelled samples] as one float64
    tensor on the output's device (summed over minibatches, read once): a :class:`Weighted`
    target's loss is scaled by its weight and counts for its ``count`` (samples or labels:
    the sums then give the mean over them), a plain one counts once. Correct predictions count
    when it looks like classification (logits [..., C], integer labels [...])."""
    count = float(target.count) if isinstance(target, Weighted) else 1.0
    loss = loss_fn(out, target).detach()
    target = target.value if isinstance(target, Weighted) else target
    correct = labelled = torch.zeros((), dtype=torch.float64, device=loss.device)
    if (isinstance(out, torch.Tensor) and isinstance(target, torch.Tensor)
            and not target.is_floating_point() and out.dim() == target.dim() + 1
            and out.shape[:-1] == target.shape):
        correct = (out.argmax(-1) == target).sum().to(torch.float64)
        labelled = labelled + target.numel()
    return torch.stack([loss.to(torch.float64).reshape(()), torch.full_like(correct, count),
                        correct, labelled])


def _total(metrics: Sequence[torch.Tensor]) -> Metrics:
    return [float(v) for v in torch.stack(list(metrics)).sum(0).tolist()] if metrics else [0.0] * 4


class ReferenceBackend:
    """All ranks in this process (docs/design-notes.md)."""

    index = 0
    world = 1

    def __init__(self, stages: Sequence[StageSpec], replicas: Sequence[int], loss_fn: LossFn,
                 optimizer_factory: OptimizerFactory, empty: Schedule, *,
                 stashing: bool = True, mitigation: Mitigation | None = None,
                 delays: Sequence[int] | None = None, options: StepOptions = DEFAULT) -> None:
        self.stages, self.replicas, self.loss_fn = list(stages), list(replicas), loss_fn
        self.empty, self.options = empty, options
        self.rebuild(optimizer_factory, stashing=stashing, mitigation=mitigation, delays=delays)

    def rebuild(self, optimizer_factory: OptimizerFactory, *, stashing: bool,
                mitigation: Mitigation | None, delays: Sequence[int] | None) -> None:
        """(Re)make every stage replica, from the stages' weights (``Trainer.adopt``)."""
        kind = "pipedream" if mitigation is not None else self.empty.kind
        empty = Schedule(kind, self.empty.replicas, 0, self.empty.actions)
        self.ex, self.local = None, {}  # the old replicas go before the new ones are made
        gc.collect()
        if kind == LOCALSGD:  # each replica's U steps alone; every H-th averages them
            self.ex = LocalSGDExecutor(self.stages, LocalSGDSchedule(
                kind, self.empty.replicas, 0, self.empty.actions), self.loss_fn,
                optimizer_factory, stashing=stashing, options=self.options)
        else:
            self.ex = ReferenceExecutor(self.stages, self.replicas, empty, self.loss_fn,
                                        optimizer_factory, stashing=stashing,
                                        mitigation=mitigation, delays=delays,
                                        options=self.options)
        self.local: dict[Rank, StageReplica] = dict(self.ex.workers)

    def run_segment(self, sched: Schedule, parts: list[Batch], wire: WirePlan | None
                    ) -> dict[int, float]:
        """Run ``sched`` (a complete schedule, or a window of a stretch) on ``parts`` (its new
        minibatches); the losses of the minibatches that reached the last stage, by their
        number in the schedule (a stretch counts from its start)."""
        self.ex.run_window(sched, parts, collect_params=False)  # the weights stay in place
        return dict(self.ex.last_losses)

    def evaluate(self, parts: list[Batch], wire: WirePlan | None) -> Metrics:
        found = []
        for k, (x, y) in enumerate(parts):
            env = model_env(self.stages, x)
            for st in self.stages:
                w = self.local[(st.index, k % self.replicas[st.index])]
                env.update(zip(st.outputs, w.evaluate([env[n] for n in st.inputs])))
            io = self.stages[-1].io
            assert io is not None
            out = io.build_output({n: env[n] for n in self.stages[-1].outputs})
            with autocast(self.options.precision, "cpu"):  # the loss as in training
                found.append(eval_metrics(self.loss_fn, out, y))
        return _total(found)

    def all_sum(self, values: list[float], what: str) -> list[float]:
        return list(values)

    def exchange(self, obj: Any, what: str) -> list[Any]:
        return [obj]

    def broadcast(self, obj: Any, what: str) -> Any:
        return obj

    def gather(self, obj: Any, what: str) -> list[Any] | None:
        return [obj]

    def close(self) -> None:
        pass


class IdleBackend:
    """A rank the plan does not need (docs/design-notes.md): it trains nothing and returns."""

    def __init__(self, index: int, world: int, needed: int) -> None:
        self.index, self.world, self.needed = index, world, needed
        self.local: dict[Rank, StageReplica] = {}
        log.warning("rank %d is idle: the plan uses %d of the job's %d processes; it leaves the "
                    "training to %s and exits", index, needed, world, ranks_text(0, needed - 1))

    def close(self) -> None:
        pass


def ranks_text(first: int, last: int) -> str:
    """``rank 0`` or ``ranks 0..3``."""
    return f"rank {first}" if first == last else f"ranks {first}..{last}"


def surplus_rank() -> tuple[int, int] | None:
    """(this rank, world size) from torchrun's environment, or None outside of one."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


class DistributedBackend:
    """This process is one rank of a torchrun job (docs/design-notes.md)."""

    def __init__(self, stages: Sequence[StageSpec], replicas: Sequence[int], loss_fn: LossFn,
                 optimizer_factory: OptimizerFactory, empty: Schedule, *, stashing: bool = True,
                 timeout_s: float = 60.0, data_timeout_s: float = 600.0,
                 device: str | None = None, timeline: bool = False,
                 mitigation: Mitigation | None = None,
                 delays: Sequence[int] | None = None, options: StepOptions = DEFAULT,
                 measure_memory: bool = False) -> None:
        self.options = options

        missing = [v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
                   if v not in os.environ]
        if missing:
            raise RuntimeConfigError(f"executor='distributed' but {', '.join(missing)} is not set",
                                     "launch with torchrun (or `fxpipe train --nproc N`), or "
                                     "use executor='reference' to train in one process")
        world, self.index = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
        ranks = list(empty.ranks)
        if world < len(ranks):
            raise RuntimeConfigError(
                f"the job has {world} process{'es' if world != 1 else ''} but the plan needs "
                f"{len(ranks)} "
                f"(replicas {list(replicas)}: one process per stage replica)",
                f"launch with --nproc-per-node {len(ranks)} (in total), or re-plan with "
                f"fxpipe.Cluster(workers={world})")
        self.world = len(ranks)  # ranks past it are idle (see IdleBackend)
        self.stages, self.replicas, self.loss_fn = list(stages), list(replicas), loss_fn
        self.me = ranks[self.index]
        self.rank_of = {r: i for i, r in enumerate(ranks)}
        self.timeout = timedelta(seconds=timeout_s)
        self.data_timeout = timedelta(seconds=max(data_timeout_s, timeout_s))
        dev = rank_device(device)
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        self.device = dev
        if int(os.environ.get("LOCAL_RANK", "0")) == 0:  # once per host
            warn_if_oversubscribed(int(os.environ.get("LOCAL_WORLD_SIZE", str(self.world))),
                                   dev.type)
        keep_freed_memory()
        self._owns_group = not dist.is_initialized()
        if self._owns_group:
            extra: dict[str, Any] = {"device_id": dev} if dev.type == "cuda" else {}
            dist.init_process_group("nccl" if dev.type == "cuda" else "gloo",
                                    init_method="env://", rank=self.index, world_size=self.world,
                                    timeout=self.timeout, **extra)
            close_at_exit(self)  # a script that never calls Trainer.close (see leave.py)
        elif dist.get_world_size() != self.world:
            raise RuntimeConfigError(f"the process group has {dist.get_world_size()} ranks, the "
                                     f"plan {self.world}", "initialise it with the plan's size, "
                                     "or let the trainer do it")
        self.control = dist.new_group(backend="gloo", timeout=self.data_timeout)
        self._agree_on_pipeline()
        ties = list(tie_sets(tied_parameters(self.stages)))  # by identity, before any copy
        groups = make_groups(list(replicas), self.rank_of, ties, timeout_s,
                             extra=(GROUP,) if options.global_group else ())
        clock = CudaClock(dev) if timeline and dev.type == "cuda" else None
        self._log_dir = os.environ.get(COMM_LOG_ENV) or None
        self._stretches = 0
        global _BACKENDS
        _BACKENDS += 1  # every rank builds its backends in the same order: a job-wide name
        self._log_name = f"{os.environ.get('MASTER_PORT', '0')}-b{_BACKENDS}-rank{self.index}"
        self.comm = Comm(self.me, self.rank_of, len(crossing_values(self.stages)), timeout_s, dev,
                         groups, recorder=Recorder(enabled=timeline, device_clock=clock),
                         record=self._log_dir is not None)
        # per segment: this rank's (events, background all-reduces); see Trainer(timeline=)
        self.timelines: list[tuple[list[TimelineEvent], list[TimelineEvent]]] = []
        self.empty = empty
        self._wire = StretchWire()  # the running stretch's (see run_segment)
        # the peak bytes of live tensors while this rank trains (Trainer(measure_memory=True))
        self.memory = (PeakMemory(dev, lambda: reachable_storages(self.ex, skip=(StageSpec,)))
                       if measure_memory else None)
        self.rebuild(optimizer_factory, stashing=stashing, mitigation=mitigation, delays=delays)
        log.info("%s ready on %s", self.comm.who, dev)

    def rebuild(self, optimizer_factory: OptimizerFactory, *, stashing: bool,
                mitigation: Mitigation | None, delays: Sequence[int] | None) -> None:
        """(Re)make this rank's stage replica, from the stage's weights (``Trainer.adopt``)."""
        from .executor import RankExecutor

        self.ex, self.local = None, {}  # the old replica goes before the new one is made
        gc.collect()
        if self.memory is not None:
            self.memory.restart()  # the new replica's state is found at the next segment
        self.ex = RankExecutor(self.stages, self.empty, self.me, self.loss_fn, optimizer_factory,
                               WirePlan((), (), ()), self.comm, stashing=stashing,
                               device=self.device, mitigation=mitigation,
                               delay=(delays or [0] * len(self.stages))[self.me[0]],
                               options=self.options)
        self.ex.meter = self.memory
        self.local: dict[Rank, StageReplica] = {self.me: self.ex.replica}

    def _agree_on_pipeline(self) -> None:
        """Every rank must run the same plan. Ranks that each profiled the model on their own
        machine can plan differently (measured times differ), and then the job would deadlock:
        compare before any group or message depends on the plan, and fail on every rank."""
        mine = pipeline_key(self.stages, self.replicas)
        keys = self.exchange(mine, "plan agreement")
        differ = [i for i, k in enumerate(keys) if k != keys[0]]
        if differ:
            raise RuntimeConfigError(
                f"ranks {differ} planned a different pipeline than rank 0 (this rank: replicas "
                f"{self.replicas}, plan key {mine})",
                "costs measured on each rank differ: make the plan once (compiled.plan.save("
                "'plan.json') or `fxpipe plan --save-plan`) and pass plan=fxpipe.Plan.load("
                "'plan.json') to fxpipe.compile on every rank, or plan with estimated costs "
                "(fxpipe.Cluster.from_env(device='V100'))")

    # ------------------------------------------------------------------ collectives
    def _collective(self, what: str, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except RuntimeError as err:
            raise PeerError(f"{rank_name(self.me, self.index)}: {what} failed (timeout "
                            f"{self.data_timeout.total_seconds():g} s): {err}",
                            "another rank crashed or hung (or its loader is slower than "
                            "data_timeout_s): look at its log (torchrun prints each rank's "
                            "error)") from err

    def all_sum(self, values: list[float], what: str) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64)
        self._collective(what, lambda: dist.all_reduce(t, group=self.control, async_op=True
                                                       ).wait(self.data_timeout))
        return [float(v) for v in t]

    def exchange(self, obj: Any, what: str) -> list[Any]:
        """Every rank's ``obj``, in rank order, on every rank."""
        out: list[Any] = [None] * self.world
        self._collective(what, lambda: dist.all_gather_object(out, obj, group=self.control))
        return out

    def broadcast(self, obj: Any, what: str) -> Any:
        box = [obj]
        self._collective(what, lambda: dist.broadcast_object_list(box, src=0,
                                                                  group=self.control))
        return box[0]

    def gather(self, obj: Any, what: str) -> list[Any] | None:
        out: list[Any] | None = [None] * self.world if self.index == 0 else None
        self._collective(what, lambda: dist.gather_object(obj, out, dst=0, group=self.control))
        return out

    # ------------------------------------------------------------------ work
    def run_segment(self, sched: Schedule, parts: list[Batch], wire: WirePlan | None
                    ) -> dict[int, float]:
        assert wire is not None or not parts
        if self.device.type == "cuda":  # page-locked: the executor's copies do not block
            parts = [(pinned(x), pinned(y)) for x, y in parts]
        start = getattr(sched, "start", 0)
        if start == 0:
            self._wire = StretchWire()
        if wire is not None:  # None: a window with no new minibatch (a stretch's drain)
            self._wire.add(start, wire)
        self.ex.wire = self._wire
        with self.memory if self.memory is not None else contextlib.nullcontext():
            res = self.ex.run_window(sched, parts, collect_params=False)
        release_freed_memory()  # the segment's freed blocks go back (allocator: fragmentation)
        ahead = getattr(sched, "ahead", {})  # what a later window may still send about
        self._wire.forget_before(min((a.minibatch for acts in ahead.values() for a in acts
                                      if a.kind != "U"), default=sched.num_minibatches))
        if self.comm.recorder.enabled:
            self.timelines.append((res.timeline, res.background))
        if res.comm_log is not None and self._log_dir is not None:  # a stretch ended
            self._write_log(res.comm_log)
        return res.losses

    def evaluate(self, parts: list[Batch], wire: WirePlan | None) -> Metrics:
        """Forward-only pipeline: each rank runs its minibatches in increasing order, receiving
        inputs from and sending outputs to the owners of the same minibatch (round robin)."""
        assert wire is not None
        self.ex.wire = wire
        io = self.stages[-1].io
        assert io is not None
        found = self.ex.forward_only(
            parts, lambda outs, y: self._metric(io.build_output(outs), y))
        if self.comm.log is not None and self._log_dir is not None:  # its own message order
            self._write_log(list(self.comm.log))
            self.comm.log.clear()
        return _total(found)

    def _write_log(self, events: list[tuple]) -> None:
        """One stretch's host calls (see COMM_LOG_ENV), named by job, backend and rank."""
        assert self._log_dir is not None
        path = Path(self._log_dir) / f"{self._log_name}-{self._stretches:05d}.json"
        path.write_text(json.dumps(events))
        self._stretches += 1

    def _metric(self, out: Any, y: Any) -> torch.Tensor:
        with autocast(self.options.precision, self.device):  # the loss as in training
            return eval_metrics(self.loss_fn, out, y)

    def close(self, barrier: bool = True) -> None:
        """Leave the job. First a barrier (bounded by the pipeline timeout; skipped at exit after
        an uncaught exception, see leave.py): a rank that tears down its sockets while a peer
        still reads its part of the last gather can abort that peer. Then the groups are destroyed and this object's references to them dropped, so
        their C++ worker threads end here and not during the interpreter's finalisation, where
        a gloo thread releasing a tensor needs the GIL and the process dies with SIGABRT
        ("terminate called without an active exception", seen once in CI at exit)."""
        if not (self._owns_group and dist.is_initialized()):
            return
        try:
            if barrier:
                dist.barrier(group=self.control, async_op=True).wait(self.timeout)
        except RuntimeError as err:  # a peer already gone: still leave cleanly
            log.warning("%s: the closing barrier failed (%s); leaving anyway", self.comm.who, err)
        self.comm.groups.clear()
        self.control = None
        dist.destroy_process_group()
        self._owns_group = False
        gc.collect()  # the dropped groups' last references (cycles) go now, GIL held

    def describe(self) -> str:
        return rank_name(self.me, self.index)


def pipeline_key(stages: Sequence[StageSpec], replicas: Sequence[int]) -> str:
    """A short hash of what every rank must agree on: replicas and each stage's nodes and I/O."""
    h = hashlib.sha256(repr(list(replicas)).encode())
    for st in stages:
        h.update(repr((st.inputs, st.sources, st.outputs, st.consumers,
                       [n.name for n in st.gm.graph.nodes])).encode())
    return h.hexdigest()[:16]
