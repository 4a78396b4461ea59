"""How a :class:`~fxpipe.runtime.trainer.Trainer` carries out one segment of training.

Two backends with one interface, so the training loop (data, checkpoints, history) is written
once and the reference executor stays the oracle of the distributed one:

* :class:`ReferenceBackend`: every rank's :class:`StageReplica` in this process, driven by the
  :class:`ReferenceExecutor`; collectives are identities.
* :class:`DistributedBackend`: this process is one rank of a torchrun job (``RANK``,
  ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``); its stage replica is driven by the
  :class:`RankExecutor`. Small control messages (segment sizes, the wire plan, checkpoint
  decisions) are broadcast from rank 0 as objects; tensors never are.

A *segment* is one complete schedule over ``n`` minibatches: it ends with every backward done
and a barrier, so the weights and optimizer states at its end are a consistent cut (what a
checkpoint saves).
"""
from __future__ import annotations

import hashlib
import logging
import os
from datetime import timedelta
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch.func import functional_call

from fxpipe.codegen.split import MODEL, StageSpec

from .allocator import keep_freed_memory
from .comm import FORWARD, Comm, make_groups, rank_name
from .errors import PeerError, RuntimeConfigError
from .mitigation import MitigatedReplica, Mitigation
from .reference import ReferenceExecutor, planned_reads
from .schedule import Rank, Schedule
from .stage import LossFn, StageReplica, model_env, tie_sets, tied_parameters
from .stash import OptimizerFactory
from .timeline import Recorder, TimelineEvent
from .wire import WirePlan, crossing_values

log = logging.getLogger(__name__)

Part = tuple[Any, Any]
Metrics = list[float]  # [loss sum, minibatches, correct predictions, samples with a label]


def _to(x: Any, device: torch.device) -> Any:
    return x.to(device) if isinstance(x, torch.Tensor) else x


def eval_metrics(loss_fn: LossFn, out: Any, target: Any) -> Metrics:
    """Loss and, when it looks like classification (logits [..., C], integer labels [...]),
    the number of correct top-1 predictions."""
    loss = float(loss_fn(out, target))
    correct, labelled = 0.0, 0.0
    if (isinstance(out, torch.Tensor) and isinstance(target, torch.Tensor)
            and not target.is_floating_point() and out.dim() == target.dim() + 1
            and out.shape[:-1] == target.shape):
        correct = float((out.argmax(-1) == target).sum())
        labelled = float(target.numel())
    return [loss, 1.0, correct, labelled]


def stage_forward(replica: StageReplica, inputs: Sequence[Any]) -> tuple:
    """Evaluation forward of a stage with its latest weights (no graph, eval mode)."""
    gm = replica.spec.gm
    mode = gm.training
    gm.eval()
    try:
        with torch.no_grad():
            return functional_call(gm, {**replica.stash.latest, **replica.buffers}, tuple(inputs))
    finally:
        gm.train(mode)


def prepare_segment(replica: StageReplica, sched: Schedule, rank: Rank) -> None:
    """A new schedule counts weight versions from 0 and declares its forwards to the stash."""
    replica.stash.rebase()
    replica.stash.set_planned_reads(planned_reads(sched, rank))
    if isinstance(replica, MitigatedReplica):  # weight prediction needs the schedule's horizons
        replica.prepare(sched, rank)


class ReferenceBackend:
    """All ranks in this process (see the module doc)."""

    index = 0
    world = 1

    def __init__(self, stages: Sequence[StageSpec], replicas: Sequence[int], loss_fn: LossFn,
                 optimizer_factory: OptimizerFactory, empty: Schedule, *,
                 stashing: bool = True, mitigation: Mitigation | None = None,
                 delays: Sequence[int] | None = None) -> None:
        self.stages, self.replicas, self.loss_fn = list(stages), list(replicas), loss_fn
        self.empty = empty
        self.rebuild(optimizer_factory, stashing=stashing, mitigation=mitigation, delays=delays)

    def rebuild(self, optimizer_factory: OptimizerFactory, *, stashing: bool,
                mitigation: Mitigation | None, delays: Sequence[int] | None) -> None:
        """(Re)make every stage replica, from the stages' weights (``Trainer.adopt``)."""
        kind = "pipedream" if mitigation is not None else self.empty.kind
        empty = Schedule(kind, self.empty.replicas, 0, self.empty.actions)
        self.ex = ReferenceExecutor(self.stages, self.replicas, empty, self.loss_fn,
                                    optimizer_factory, stashing=stashing, mitigation=mitigation,
                                    delays=delays)
        self.local: dict[Rank, StageReplica] = dict(self.ex.workers)

    def run_segment(self, sched: Schedule, parts: list[Part], wire: WirePlan | None
                    ) -> dict[int, float]:
        for rank, w in self.local.items():
            prepare_segment(w, sched, rank)
        self.ex.schedule = sched
        self.ex._runs = 0  # our prepare_segment did what run() would redo
        return dict(enumerate(self.ex.run(parts).losses))

    def evaluate(self, parts: list[Part], wire: WirePlan | None) -> Metrics:
        total = [0.0] * 4
        for k, (x, y) in enumerate(parts):
            env = model_env(self.stages, x)
            for st in self.stages:
                w = self.local[(st.index, k % self.replicas[st.index])]
                env.update(zip(st.outputs, stage_forward(w, [env[n] for n in st.inputs])))
            last = self.stages[-1]
            io = last.io
            assert io is not None
            out = io.build_output({n: env[n] for n in last.outputs})
            total = [a + b for a, b in zip(total, eval_metrics(self.loss_fn, out, y))]
        return total

    def all_sum(self, values: list[float], what: str) -> list[float]:
        return list(values)

    def broadcast(self, obj: Any, what: str) -> Any:
        return obj

    def gather(self, obj: Any, what: str) -> list[Any] | None:
        return [obj]

    def close(self) -> None:
        pass


class DistributedBackend:
    """This process is one rank of a torchrun job (see the module doc)."""

    def __init__(self, stages: Sequence[StageSpec], replicas: Sequence[int], loss_fn: LossFn,
                 optimizer_factory: OptimizerFactory, empty: Schedule, *, stashing: bool = True,
                 timeout_s: float = 60.0, device: str | None = None,
                 timeline: bool = False, mitigation: Mitigation | None = None,
                 delays: Sequence[int] | None = None) -> None:
        from .executor import RankExecutor  # torch.distributed users only

        missing = [v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
                   if v not in os.environ]
        if missing:
            raise RuntimeConfigError(f"executor='distributed' but {', '.join(missing)} is not set",
                                     "launch with torchrun (or `fxpipe train --nproc N`), or "
                                     "use executor='reference' to train in one process")
        self.world, self.index = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
        ranks = list(empty.ranks)
        if self.world != len(ranks):
            raise RuntimeConfigError(
                f"the job has {self.world} processes but the plan needs {len(ranks)} "
                f"(replicas {list(replicas)}: one process per stage replica)",
                f"launch with --nproc-per-node {len(ranks)} (in total), or re-plan with "
                f"fxpipe.Cluster(workers={self.world})")
        self.stages, self.replicas, self.loss_fn = list(stages), list(replicas), loss_fn
        self.me = ranks[self.index]
        self.rank_of = {r: i for i, r in enumerate(ranks)}
        self.timeout = timedelta(seconds=timeout_s)
        dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if dev.type == "cuda":
            dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(dev)
        self.device = dev
        keep_freed_memory()
        self._owns_group = not dist.is_initialized()
        if self._owns_group:
            dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", init_method="env://",
                                    rank=self.index, world_size=self.world, timeout=self.timeout)
        self._agree_on_pipeline()
        ties = list(tie_sets(tied_parameters(self.stages)))  # before .to(device): by identity
        groups = make_groups(list(replicas), self.rank_of, ties, timeout_s)
        self.comm = Comm(self.me, self.rank_of, len(crossing_values(self.stages)), timeout_s, dev,
                         groups, recorder=Recorder(enabled=timeline))
        # per segment: this rank's (events, background all-reduces); see Trainer(timeline=)
        self.timelines: list[tuple[list[TimelineEvent], list[TimelineEvent]]] = []
        self.empty = empty
        self.rebuild(optimizer_factory, stashing=stashing, mitigation=mitigation, delays=delays)
        log.info("%s ready on %s", self.comm.who, dev)

    def rebuild(self, optimizer_factory: OptimizerFactory, *, stashing: bool,
                mitigation: Mitigation | None, delays: Sequence[int] | None) -> None:
        """(Re)make this rank's stage replica, from the stage's weights (``Trainer.adopt``)."""
        from .executor import RankExecutor

        self.ex = RankExecutor(self.stages, self.empty, self.me, self.loss_fn, optimizer_factory,
                               WirePlan((), (), ()), self.comm, stashing=stashing,
                               device=self.device, mitigation=mitigation,
                               delay=(delays or [0] * len(self.stages))[self.me[0]])
        self.local: dict[Rank, StageReplica] = {self.me: self.ex.replica}

    def _agree_on_pipeline(self) -> None:
        """Every rank must run the same plan. Ranks that each profiled the model on their own
        machine can plan differently (measured times differ), and then the job would deadlock:
        compare before any group or message depends on the plan, and fail on every rank."""
        mine = pipeline_key(self.stages, self.replicas)
        keys: list[Any] = [None] * self.world
        self._collective("plan agreement", lambda: dist.all_gather_object(keys, mine))
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
            raise PeerError(f"{self.comm.who}: {what} failed (timeout "
                            f"{self.timeout.total_seconds():g} s): {err}",
                            "another rank crashed or hung: look at its log (torchrun prints "
                            "each rank's error)") from err

    def all_sum(self, values: list[float], what: str) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64,
                         device=self.device if self.device.type == "cuda" else "cpu")
        self._collective(what, lambda: dist.all_reduce(t, async_op=True).wait(self.timeout))
        return [float(v) for v in t.cpu()]

    def broadcast(self, obj: Any, what: str) -> Any:
        box = [obj]
        self._collective(what, lambda: dist.broadcast_object_list(box, src=0))
        return box[0]

    def gather(self, obj: Any, what: str) -> list[Any] | None:
        out: list[Any] | None = [None] * self.world if self.index == 0 else None
        self._collective(what, lambda: dist.gather_object(obj, out, dst=0))
        return out

    # ------------------------------------------------------------------ work
    def run_segment(self, sched: Schedule, parts: list[Part], wire: WirePlan | None
                    ) -> dict[int, float]:
        assert wire is not None
        prepare_segment(self.ex.replica, sched, self.me)
        self.ex.schedule, self.ex.wire = sched, wire
        res = self.ex.run(parts)
        if self.comm.recorder.enabled:
            self.timelines.append((res.timeline, res.background))
        return res.losses

    def evaluate(self, parts: list[Part], wire: WirePlan | None) -> Metrics:
        """Forward-only pipeline: each rank runs its minibatches in increasing order, receiving
        inputs from and sending outputs to the owners of the same minibatch (round robin)."""
        assert wire is not None
        s, st, comm = self.me[0], self.stages[self.me[0]], self.comm
        owner = lambda stage, k: (stage, k % self.replicas[stage])  # noqa: E731
        total = [0.0] * 4
        for k, (x, y) in enumerate(parts):
            if owner(s, k) != self.me:
                continue
            env = model_env(self.stages, x) if MODEL in st.sources else {}
            posted = {n: comm.post_recv(wire.spec(n, k), owner(src, k),
                                        comm.tag(k, wire.index(n), FORWARD), f"eval input {n!r}")
                      for n, src in zip(st.inputs, st.sources) if src != MODEL}
            ins = [comm.wait(posted[n]) if n in posted else _to(env[n], self.device)
                   for n in st.inputs]
            outs = stage_forward(self.ex.replica, ins)
            for n, o, cons in zip(st.outputs, outs, st.consumers):
                for c in cons:
                    if c != MODEL:
                        comm.send(o, owner(c, k), comm.tag(k, wire.index(n), FORWARD),
                                  f"eval output {n!r}", wire.spec(n, k))
            if s == len(self.stages) - 1:
                out = st.io.build_output(dict(zip(st.outputs, outs)))  # type: ignore[union-attr]
                m = eval_metrics(self.loss_fn, out, _to(y, self.device))
                total = [a + b for a, b in zip(total, m)]
        comm.flush()
        comm.barrier()
        return total

    def close(self) -> None:
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()
            self._owns_group = False

    def describe(self) -> str:
        return rank_name(self.me, self.index)


def pipeline_key(stages: Sequence[StageSpec], replicas: Sequence[int]) -> str:
    """A short hash of what every rank must agree on: replicas and each stage's nodes and I/O."""
    h = hashlib.sha256(repr(list(replicas)).encode())
    for st in stages:
        h.update(repr((st.inputs, st.sources, st.outputs, st.consumers,
                       [n.name for n in st.gm.graph.nodes])).encode())
    return h.hexdigest()[:16]
