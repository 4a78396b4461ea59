"""The distributed executor: one process per (stage, replica) rank carrying out its action list.

A rank knows everything ahead: its actions (the schedule), who owns each minibatch on every stage
(round robin), the shape of every message (the wire plan). So it only walks its list: ``F k``
receives the stage's inputs (model inputs are read locally: every rank has the batches), runs the
forward and sends each output straight to every consuming stage's owner of k; ``B k`` receives the
gradients of its outputs, runs the backward and sends its inputs' gradients to their producers;
``U i`` all-reduces the stage's gradient sums among its replicas (their own process group) and
steps the optimizer; tied parameters also sum their gradients over every rank holding them. With
``overlap_allreduce`` (default) the replicas' sum is bucketed and launched from hooks during the
last backward before the update, as DDP does (:mod:`fxpipe.runtime.buckets`); ``U`` then only
waits for it. The
receives of the next actions are posted ahead (``prepost``), so messages arrive during compute.
All transport goes through :class:`~fxpipe.runtime.comm.Comm`; all compute through the same
:class:`StageReplica` the reference executor uses; every part is stamped on the rank's timeline.

:func:`run_distributed` (in :mod:`fxpipe.runtime.launch`) spawns the ranks; :func:`worker_main` is
what each of them runs.
"""
from __future__ import annotations

import bisect
import logging
import os
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.distributed as dist

from fxpipe.codegen.split import MODEL, StageSpec
from fxpipe.errors import FxpipeError

from .allocator import keep_freed_memory
from .buckets import DEFAULT_BUCKET_BYTES, BucketLayout, GradBuckets, last_backwards
from .comm import BACKWARD, FORWARD, Comm, make_groups, rank_name, synchronized_start
from .reference import Batch, planned_reads
from .schedule import Action, Rank, Schedule, split_ranks
from .stage import LossFn, StageReplica, model_env, tie_sets, tied_parameters
from .stash import OptimizerFactory
from .timeline import Recorder, TimelineEvent
from .wire import WirePlan

log = logging.getLogger(__name__)


@dataclass
class RankResult:
    """What one rank reports back: losses of the minibatches it finished (last stage only), its
    latest weights, the peak bytes of weights its stash held and its timeline. ``background``:
    the asynchronous bucket all-reduces (launch -> completion), which overlap the timeline's
    events and so are kept apart (``sorted(timeline + background)`` for a trace showing them)."""

    losses: dict[int, float]
    params: dict[str, torch.Tensor]
    peak_bytes: int
    timeline: list[TimelineEvent] = field(default_factory=list)
    background: list[TimelineEvent] = field(default_factory=list)


class RankExecutor:
    """Carry out ``schedule.actions[me]`` (see the module doc)."""

    def __init__(self, stages: Sequence[StageSpec], schedule: Schedule, me: Rank,
                 loss_fn: LossFn, optimizer_factory: OptimizerFactory, wire: WirePlan,
                 comm: Comm, *, stashing: bool = True, device: torch.device | None = None,
                 fault: tuple[str, int] | None = None, recorder: Recorder | None = None,
                 prepost: int = 2, overlap_allreduce: bool = True,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
        self.stages = list(stages)
        self.prepost = prepost
        self.overlap_allreduce = overlap_allreduce
        self.bucket_bytes = bucket_bytes
        self._buckets: GradBuckets | None = None  # built on first use (replicated stages only)
        self._final_b: dict[int, int] = {}  # action index of a round's last B -> its U's index
        self._round = ""  # the U whose buckets are in flight (for messages)
        self._posted: dict[tuple[str, int], list[Any]] = {}
        self._fb: tuple[Sequence[Action], list[int]] | None = None  # see prepost_ahead
        # tied parameters are found by identity: do it before .to(device) and anything else
        self.tied = [(stages_, [t.names[me[0]] for t in ts]) for stages_, ts
                     in tie_sets(tied_parameters(self.stages)).items() if me[0] in stages_]
        self.rec = recorder or comm.recorder
        self.schedule = schedule
        self.me = me
        self.spec = self.stages[me[0]]
        self.wire = wire
        self.comm = comm
        self.device = device or torch.device("cpu")
        self.fault = fault
        self.spec.gm.to(self.device)
        # whether any F or B of this rank receives a message (a lone stage receives nothing)
        self._receives_any = (any(src != MODEL for src in self.spec.sources)
                              or any(c != MODEL for cons in self.spec.consumers for c in cons))
        last = len(self.stages) - 1
        self._split = False  # this run's B computes input gradients only, W the rest (see run)
        self.replica = StageReplica(self.spec, optimizer_factory,
                                    loss_fn=loss_fn if me[0] == last else None,
                                    stashing=stashing, planned_reads=planned_reads(schedule, me),
                                    model_input_grads=False)  # sent nowhere: not computed

    def _what(self, kind: str, name: str, k: int) -> str:
        return f"{kind} {name!r} of minibatch {k}"

    def _post(self, a: Action) -> list[Any]:
        """Post the receives ``a`` needs: for F one per input (None for a model input), for B
        one list per output (a gradient from each consuming stage's owner; empty when none)."""
        k, st = a.minibatch, self.spec
        if a.kind == "F":
            return [None if src == MODEL else
                    self.comm.post_recv(self.wire.spec(n, k), self.schedule.owner(src, k),
                                        self.comm.tag(k, self.wire.index(n), FORWARD),
                                        self._what("activation", n, k))
                    for n, src in zip(st.inputs, st.sources)]
        posted: list[Any] = []
        for n, cons in zip(st.outputs, st.consumers):
            spec = self.wire.spec(n, k) if any(c != MODEL for c in cons) else None
            posted.append([self.comm.post_recv(spec, self.schedule.owner(c, k),
                                               self.comm.tag(k, self.wire.index(n), BACKWARD),
                                               self._what("gradient", n, k))
                           for c in cons if c != MODEL and spec is not None
                           and (spec.dtype.is_floating_point or spec.dtype.is_complex)])
        return posted

    def _receives(self, a: Action) -> list[Any]:
        """The receives of ``a``: pre-posted ones if :meth:`prepost_ahead` posted them."""
        got = self._posted.pop((a.kind, a.minibatch), None)
        return self._post(a) if got is None else got

    def prepost_ahead(self, actions: Sequence[Action], i: int) -> None:
        """Post now the receives of action ``i`` and of the next ``prepost`` F/B actions, in list
        order, so their data arrives while this rank computes (communication overlapped with
        compute). Buffers come from the wire plan: posting early costs only their memory."""
        if self._fb is None or self._fb[0] is not actions:  # (list, its F/B action positions)
            self._fb = (actions, [j for j, b in enumerate(actions) if b.kind in ("F", "B")])
        fb = self._fb[1]
        lo = bisect.bisect_left(fb, i)
        ahead = [actions[j] for j in fb[lo:lo + self.prepost + 1]]
        new = [b for b in ahead if (b.kind, b.minibatch) not in self._posted]
        if new and not self._receives_any:  # nothing ever arrives: no posting, no event
            for b in new:
                self._posted[(b.kind, b.minibatch)] = self._post(b)
        elif new:
            with self.rec.span("recv", "post " + " ".join(map(str, new))):
                for b in new:
                    self._posted[(b.kind, b.minibatch)] = self._post(b)

    def forward(self, a: Action, batch: Batch) -> float | None:
        s, k, st = self.me[0], a.minibatch, self.spec
        env = model_env(self.stages, batch[0]) if MODEL in st.sources else {}
        posted = self._receives(a)
        ins = [env[n].to(self.device) if p is None else self.comm.wait(p)
               for n, p in zip(st.inputs, posted)]
        target = batch[1].to(self.device) if isinstance(batch[1], torch.Tensor) else batch[1]
        with self.rec.span("forward", str(a), minibatch=k, version=a.version):
            outs, loss = self.replica.forward(k, a.version, ins, target)
        for n, o, cons in zip(st.outputs, outs, st.consumers):
            for c in cons:
                if c != MODEL:
                    self.comm.send(o, self.schedule.owner(c, k),
                                   self.comm.tag(k, self.wire.index(n), FORWARD),
                                   self._what("activation", n, k), self.wire.spec(n, k))
        log.debug("%s: F%d done (stage %d)", self.comm.who, k, s)
        return loss

    def buckets(self) -> GradBuckets | None:
        """The stage's gradient buckets, or None when its replicas' sum is not overlapped (one
        replica, or ``overlap_allreduce=False``: one flat all-reduce at ``U``)."""
        s, reps = self.me[0], self.schedule.replicas
        if not self.overlap_allreduce or reps[s] < 2:
            return None
        if self._buckets is None:
            latest = self.replica.stash.latest
            ref = next(iter(latest.values()), torch.zeros(()))
            layout = BucketLayout.build(latest, self.replica.stash.trainable, self.bucket_bytes,
                                        ref.dtype)
            peers = [(s, j) for j in range(reps[s])]
            self._buckets = GradBuckets(
                layout, self.device,
                lambda i, buf: self.comm.all_reduce_async(buf, s, peers,
                                                          f"bucket {i} of {self._round}"))
            log.debug("%s: %d gradient buckets of sizes %s", self.comm.who, len(layout),
                      layout.sizes)
        return self._buckets

    def backward(self, a: Action, *, update: Action | None = None) -> None:
        """``update``: the U this backward is the last one before; its hooks then launch the
        stage's gradient buckets (when they are overlapped, see :meth:`buckets`)."""
        k, st = a.minibatch, self.spec
        bk = self.buckets() if update is not None else None
        if bk is not None:
            self._round = str(update)
            bk.start()
        posted: list[list[Any]] = self._receives(a)
        out_grads: list[torch.Tensor | None] = []
        for group in posted:
            total: torch.Tensor | None = None
            for p in group:  # ascending consumer order, as the reference sums
                g = self.comm.wait(p)
                total = g if total is None else total + g
            out_grads.append(total)
        with self.rec.span("backward", str(a), minibatch=k, version=a.version):
            in_grads = self.replica.backward(
                k, out_grads, on_grad=None if bk is None or not bk.early else bk.ready,
                hooked=None if bk is None else bk.early, split=self._split)
        for n, src, g in zip(st.inputs, st.sources, in_grads):
            if src != MODEL and g is not None:
                self.comm.send(g, self.schedule.owner(src, k),
                               self.comm.tag(k, self.wire.index(n), BACKWARD),
                               self._what("gradient", n, k), self.wire.spec(n, k))
        self._finish_buckets(bk, update)

    def weight(self, a: Action, *, update: Action | None = None) -> None:
        """W: the weight gradients of a split backward (nothing to receive or send); ``update``
        as for :meth:`backward`: the last W before a U launches the gradient buckets."""
        bk = self.buckets() if update is not None else None
        if bk is not None:
            self._round = str(update)
            bk.start()
        with self.rec.span("backward", str(a), minibatch=a.minibatch, version=a.version):
            self.replica.backward_weight(
                a.minibatch, on_grad=None if bk is None or not bk.early else bk.ready,
                hooked=None if bk is None else bk.early)
        self._finish_buckets(bk, update)

    def _finish_buckets(self, bk: GradBuckets | None, update: Action | None) -> None:
        if bk is not None:  # parameters without a gradient this time, the count: last buckets
            with self.rec.span("allreduce", f"post buckets {update}", group=str(self.me[0])):
                bk.finish(self.replica.grad_sums, self.replica.count)

    def update(self, a: Action) -> None:
        """Replicas sum their gradients (the stage's group); tied parameters sum their LOCAL
        gradients over every rank holding them (their own group), as the reference does."""
        s = self.me[0]
        reps = self.schedule.replicas
        bk = self.buckets()
        if bk is not None and not bk.active:  # no backward this round: post everything now
            self._round = str(a)
            bk.start()
            bk.finish(self.replica.grad_sums, self.replica.count)
        if reps[s] == 1 and not self.tied:  # nobody to sum with: no flat buffer at all
            with self.rec.span("optimizer", str(a), update=a.minibatch):
                self.replica.apply_local_update()
            return
        with self.rec.span("optimizer", f"{a} gradients", update=a.minibatch):
            buf = self.replica.local_gradient() if bk is None or self.tied else None
            segs = [(key, names, self.replica.segment(buf, names)) for key, names in self.tied]
        if bk is not None:
            self.comm.wait_all_reduces(bk.pending, f"allreduce {a}", group=str(s))
            if not self.tied:  # the buckets' views go to the optimizer (no flat copy)
                grads, count = bk.grads(self.replica.stash.latest)  # already the mean
                with self.rec.span("optimizer", str(a), update=a.minibatch):
                    self.replica.apply_grads(grads, min(count, 1.0), writable=grads)
                return
            buf = bk.flat()
        elif reps[s] > 1:
            self.comm.all_reduce(buf, s, [(s, j) for j in range(reps[s])], f"U{a.minibatch}")
        assert buf is not None
        for key, names, seg in segs:
            peers = [(t, j) for t in key for j in range(reps[t])]
            self.comm.all_reduce(seg, key, peers, f"tied {names} U{a.minibatch}")
            self.replica.put_segment(buf, names, seg)
        with self.rec.span("optimizer", str(a), update=a.minibatch):
            self.replica.apply_update(buf)

    def run(self, batches: Sequence[Batch]) -> RankResult:
        """Walk the action list; then wait for every send and for all ranks to finish."""
        losses: dict[int, float] = {}
        actions = self.schedule.actions[self.me]
        self._final_b = last_backwards([b.kind for b in actions])
        self._split = self.me in split_ranks(self.schedule)
        for i, a in enumerate(actions):
            if self.fault is not None and i == self.fault[1]:
                _inject(self.fault[0], self.comm.who, a)
            if self.prepost > 0:
                self.prepost_ahead(actions, i)
            if a.kind == "F":
                loss = self.forward(a, batches[a.minibatch])
                if loss is not None:
                    losses[a.minibatch] = loss
            elif a.kind == "B":
                u = self._final_b.get(i)
                self.backward(a, update=None if u is None else actions[u])
            elif a.kind == "W":
                u = self._final_b.get(i)
                self.weight(a, update=None if u is None else actions[u])
            else:
                self.update(a)
        self.comm.flush()
        self.comm.barrier()
        background = sorted(self.comm.background, key=lambda e: e.start)
        self.comm.background.clear()
        return RankResult(losses, {n: t.detach().cpu() for n, t in
                                   self.replica.parameters().items()},
                          self.replica.stash.peak_bytes, self._take_timeline(), background)

    def _take_timeline(self) -> list[TimelineEvent]:
        """This run's events (with idle gaps); the recorder starts empty for the next run."""
        events = self.rec.finish()
        self.rec.events.clear()
        return events


def _inject(kind: str, who: str, a: Action) -> None:
    """Fault injection for tests: die hard (no cleanup, like a crash) or hang at action ``a``."""
    log.warning("%s: injected fault %r before %s", who, kind, a)
    if kind == "die":
        os._exit(17)
    time.sleep(3600)


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
    faults: dict[int, tuple[str, int]] = field(default_factory=dict)
    log_level: int = logging.WARNING
    overlap_allreduce: bool = True
    bucket_bytes: int = DEFAULT_BUCKET_BYTES

    def schedule(self) -> Schedule:
        return Schedule(self.schedule_kind, self.replicas, self.num_minibatches, self.actions)


def init_rank(index: int, cfg: WorkerConfig, world_size: int | None = None) -> float:
    """Join the world's process group (of ``world_size`` ranks, default: the schedule's);
    returns the timeline's common start (taken after a barrier)."""
    keep_freed_memory()
    device = torch.device(cfg.device)
    if device.type == "cuda":
        torch.cuda.set_device(device.index or 0)
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = timedelta(seconds=max(cfg.timeout_s, 60.0))  # rendezvous waits for slow spawns
    dist.init_process_group(backend, init_method=f"tcp://{cfg.master_addr}:{cfg.port}",
                            rank=index, world_size=world_size or len(cfg.schedule().ranks),
                            timeout=timeout)
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
    device = torch.device(cfg.device)
    ties = list(tie_sets(tied_parameters(cfg.stages)))
    groups = make_groups(sched.replicas, rank_of, ties, cfg.timeout_s)
    if index >= len(sched.ranks):
        dist.barrier(async_op=True).wait(timeout=timedelta(seconds=cfg.timeout_s))
        return None
    me = sched.ranks[index]
    rec = Recorder(t0, args={"stage": me[0], "replica": me[1], "rank": index})
    comm = Comm(me, rank_of, len(cfg.wire.values), cfg.timeout_s, device, groups, recorder=rec)
    ex = RankExecutor(cfg.stages, sched, me, cfg.loss_fn, cfg.optimizer_factory, cfg.wire,
                      comm, stashing=cfg.stashing, device=device, fault=cfg.faults.get(index),
                      recorder=rec, overlap_allreduce=cfg.overlap_allreduce,
                      bucket_bytes=cfg.bucket_bytes)
    return ex.run(cfg.batches)


def worker_main(index: int, cfg: WorkerConfig) -> None:
    """Entry point of rank ``index``: run, save the result, or log the error and exit non-zero.

    Exits with ``os._exit`` on failure so that a broken process group cannot hang the exit.
    """
    torch.set_num_threads(1)
    logging.basicConfig(level=cfg.log_level,
                        format=f"%(asctime)s [rank {index}] %(name)s %(levelname)s: %(message)s")
    me = cfg.schedule().ranks[index]
    out = Path(cfg.outdir)
    try:
        t0 = init_rank(index, cfg)
        result = run_rank(index, cfg, t0)
        assert result is not None  # the world is exactly the schedule's ranks
        torch.save(result.__dict__, out / f"rank{index}.pt")
        dist.destroy_process_group()
    except BaseException as err:  # noqa: BLE001 - every failure must end the process non-zero
        fail(out, index, me, err)


def fail(out: Path, index: int, me: Rank, err: BaseException) -> None:
    """Log ``err``, write it to ``rank<i>.err`` for the launcher, and exit non-zero at once."""
    name = rank_name(me, index)
    text = (f"{name}: {err}" if isinstance(err, FxpipeError)
            else f"{name}: {type(err).__name__}: {err}\n{traceback.format_exc()}")
    log.error("%s", text)
    (out / f"rank{index}.err").write_text(text)
    logging.shutdown()
    os._exit(1)
