"""The distributed executor: one process per (stage, replica) rank carrying out its action list.

A rank knows everything ahead: its actions (the schedule), who owns each minibatch on every stage
(round robin), the shape of every message (the wire plan). So it only walks its list: ``F k``
waits for the stage's inputs (model inputs are read locally: every rank has the batches), runs
the forward and sends each output straight to every consuming stage's owner of k; ``B k`` waits
for the gradients of its outputs, runs the backward and sends its inputs' gradients to their
producers; ``U i`` all-reduces the stage's gradient sums among its replicas (their own process
group) and steps the optimizer; tied parameters also sum their gradients over every rank holding
them (under pipedream ``d`` rounds later, see :func:`fxpipe.runtime.execution.contract.tied_delay`).
With ``overlap_allreduce`` (default) the replicas' sum is bucketed and launched from hooks during
the last backward before the update, as DDP does (:mod:`fxpipe.runtime.execution.buckets`); ``U``
then only waits for it. Either way the summed buffer carries one presence flag per parameter, so
every replica (and every holder of a tied parameter) agrees which parameters got no gradient at
all in the round: those take no step, as torch.optim skips ``grad=None``
(:mod:`fxpipe.runtime.replica.stage_update`).

WHEN each message is posted follows :mod:`fxpipe.runtime.schedules.commplan`: one global order that
every rank follows, receives posted as early as that order allows (so data arrives while the rank
computes), which is what makes the same code safe on NCCL (order-matched, one stream) and gloo
(tag-matched). All transport goes through :class:`~fxpipe.runtime.execution.comm.Comm`; all compute
through the same :class:`StageReplica` the reference executor uses; every part is stamped on the
rank's timeline.

Device: the rank's weights, buffers and gradients live on its device (once: the stage's
GraphModule stays where it is, see :class:`StageReplica`); model inputs and targets are copied
there without blocking the host (:func:`fxpipe.runtime.replica.device.to_device`); losses stay on
the device and are read once per run.

:func:`run_distributed` (in :mod:`fxpipe.runtime.execution.launch`) spawns the ranks;
:func:`fxpipe.runtime.execution.worker.worker_main` is what each of them runs.
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from fxpipe.codegen.split import MODEL, StageSpec

from ..replica.clipping import GROUP, counted, stage_clipper
from ..replica.device import to_device
from ..replica.global_step import step_hook
from ..replica.mitigation import make_replica
from ..replica.stage import (LossFn, detached_values, model_env, sync_components, tie_sets,
                             tied_parameters)
from ..replica.stash import OptimizerFactory
from ..replica.step_options import DEFAULT, StepOptions
from ..schedules.commplan import Issuer, Msg, RankPlan, comm_plans, links_of
from ..schedules.schedule import Action, Rank, Schedule, split_ranks
from ..schedules.spec import Mitigation
from ..timeline import Recorder, TimelineEvent
from .buckets import DEFAULT_BUCKET_BYTES, BucketLayout, GradBuckets, last_backwards
from .comm import Comm, _Pending
from .contract import Batch, planned_reads, tied_delay
from .wire import WirePlan

log = logging.getLogger(__name__)


@dataclass
class RankResult:
    """What one rank reports back: losses of the minibatches it finished (last stage only), its
    latest weights (when asked for), the peak bytes of weights its stash held and its timeline.
    ``background``: the asynchronous bucket all-reduces (launch -> completion), which overlap
    the timeline's events and so are kept apart (``sorted(timeline + background)`` for a trace
    showing them). ``comm_log``: every host call of the run when the Comm records (tests)."""

    losses: dict[int, float]
    params: dict[str, torch.Tensor]
    peak_bytes: int
    timeline: list[TimelineEvent] = field(default_factory=list)
    background: list[TimelineEvent] = field(default_factory=list)
    comm_log: list[tuple] | None = None


class RankExecutor:
    """Carry out ``schedule.actions[me]`` (see the module doc)."""

    def __init__(self, stages: Sequence[StageSpec], schedule: Schedule, me: Rank,
                 loss_fn: LossFn, optimizer_factory: OptimizerFactory, wire: WirePlan,
                 comm: Comm, *, stashing: bool = True, device: torch.device | None = None,
                 fault: tuple[str, int] | None = None, recorder: Recorder | None = None,
                 overlap_allreduce: bool = True,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, mitigation: Mitigation | None = None,
                 delay: int = 0, options: StepOptions = DEFAULT) -> None:
        self.stages = list(stages)
        self.options = options
        self.links = links_of(self.stages)
        self.overlap_allreduce = overlap_allreduce
        self.bucket_bytes = bucket_bytes
        self._buckets: GradBuckets | None = None  # built on first use (replicated stages only)
        self._final_b: dict[int, int] = {}  # action index of a round's last B -> its U's index
        self._round = ""  # the U whose buckets are in flight (for messages)
        # tied parameters are found by identity: do it before anything copies them
        all_tied = tied_parameters(self.stages)
        self._tied_all = all_tied
        self._sync = sync_components(all_tied)
        self.tied = [(stages_, [t.names[me[0]] for t in ts]) for stages_, ts
                     in tie_sets(all_tied).items() if me[0] in stages_]
        self._rounds: dict[tuple[tuple[int, ...], int], tuple[_Pending, float]] = {}
        self._delay = 0
        self.rec = recorder or comm.recorder
        self.schedule = schedule
        self.me = me
        self.spec = self.stages[me[0]]
        self.wire = wire
        self.comm = comm
        self.device = device or torch.device("cpu")
        self.fault = fault
        self._inbox: dict[Msg, _Pending] = {}
        self._out: dict[str, torch.Tensor] = {}
        last = len(self.stages) - 1
        # values no gradient flows back along: no message planned, none computed or sent
        self._detached = detached_values(self.stages)
        self._split = False  # this run's B computes input gradients only, W the rest (see run)
        self.replica = make_replica(self.spec, optimizer_factory, delay=delay,  # mitigation.py
                                    mitigation=mitigation,
                                    loss_fn=loss_fn if me[0] == last else None,
                                    stashing=stashing, planned_reads=planned_reads(schedule, me),
                                    model_input_grads=False,  # sent nowhere: not computed
                                    detached=self._detached,
                                    device=self.device, **options.replica_kwargs(me[0]))

    def _configure(self, kind: str) -> None:
        """Updates that happen together and the replica's clipping, for schedule ``kind``
        (see :mod:`fxpipe.runtime.replica.clipping`): the global norm is one all-reduce of this
        rank's squared norm over every rank (group ``clip``) inside each update."""
        self._sync = self.options.sync(kind, len(self.stages), sync_components(self._tied_all))
        w, scope = self.replica, self.options.scope(kind)
        max_norm = self.options.clip_grad_norm
        w.clip, w.clip_local = None, True
        if scope == "stage":
            w.clip = stage_clipper(max_norm, w.stash.trainable,  # type: ignore[arg-type]
                                   [t.names[self.me[0]] for t in self._tied_all
                                    if self.me[0] in t.names])
        elif scope == "global" or w.scaler is not None:  # one all-reduce over every rank
            peers = list(self.comm.rank_of)

            def reduce(t: torch.Tensor, what: str) -> None:
                if len(peers) > 1:
                    self.comm.all_reduce(t, GROUP, peers, what)

            w.clip = step_hook(w, counted(self.me, w.stash.trainable, self._tied_all),
                               max_norm if scope == "global" else None, reduce)
            w.clip_local = False

    # ------------------------------------------------------------------ messages
    def _grad_ok(self, name: str, k: int) -> bool:
        """Whether value ``name`` of minibatch k has a gradient message: floating point on the
        wire, and not only detached by its consumers (:func:`detached_values`). Every rank
        answers alike (the same stages), so both ends plan the same messages."""
        if name in self._detached:
            return False
        dt = self.wire.spec(name, k).dtype
        return dt.is_floating_point or dt.is_complex

    def plan(self, sched: Schedule) -> RankPlan:
        """This rank's messages for ``sched`` in the global order (see commplan)."""
        index = {n: i for i, n in enumerate(self.wire.values)}
        return comm_plans(self.links, sched, index, self._grad_ok, self._sync, self._delay,
                          ranks=[self.me])[self.me]

    def _post_recv(self, m: Msg) -> None:
        spec = self.wire.spec(m.name, m.minibatch)
        self._inbox[m] = self.comm.post_recv(
            spec, m.peer, self.comm.tag(m.minibatch, m.value, m.direction), m.describe())

    def _post_send(self, m: Msg) -> None:
        t = self._out.get(m.name)
        if t is None:
            raise RuntimeError(f"{self.comm.who}: no {m.describe()} to send (a bug)")
        self.comm.send(t, m.peer, self.comm.tag(m.minibatch, m.value, m.direction),
                       m.describe(), self.wire.spec(m.name, m.minibatch))

    def _received(self, msgs: Sequence[Msg]) -> dict[Msg, torch.Tensor]:
        self._issuer.require(msgs, self._inbox)
        return {m: self.comm.wait(self._inbox.pop(m)) for m in msgs}

    # ------------------------------------------------------------------ actions
    def forward(self, a: Action, batch: Batch, recvs: Sequence[Msg] = ()
                ) -> torch.Tensor | None:
        """Wait for ``a``'s inputs, run it; its outputs wait in ``_out`` to be sent."""
        k, st = a.minibatch, self.spec
        env = model_env(self.stages, batch[0]) if MODEL in st.sources else {}
        got = {m.name: t for m, t in self._received(recvs).items()}
        ins = [to_device(env[n], self.device) if src == MODEL else got[n]
               for n, src in zip(st.inputs, st.sources)]
        target = to_device(batch[1], self.device)
        with self.rec.span("forward", str(a), minibatch=k, version=a.version):
            outs, loss = self.replica.forward(k, a.version, ins, target)
        self._out = dict(zip(st.outputs, outs))
        log.debug("%s: F%d done (stage %d)", self.comm.who, k, self.me[0])
        return loss

    def buckets(self) -> GradBuckets | None:
        """The stage's gradient buckets, or None when its replicas' sum is not overlapped (one
        replica, or ``overlap_allreduce=False``: one flat all-reduce at ``U``)."""
        s, reps = self.me[0], self.schedule.replicas
        if not self.overlap_allreduce or reps[s] < 2:
            return None
        if self._buckets is None:
            stash = self.replica.stash
            # shaped like the weights, in the gradients' dtype (float32 for master weights)
            like = {n: t if n not in stash.grad_dtypes or stash.grad_dtypes[n] == t.dtype else
                    torch.empty(t.shape, dtype=stash.grad_dtypes[n], device="meta")
                    for n, t in stash.latest.items()}
            ref = next(iter(like.values()), torch.zeros(()))
            layout = BucketLayout.build(like, stash.trainable, self.bucket_bytes, ref.dtype,
                                        flags=True)  # presence flags: see stage_update
            peers = [(s, j) for j in range(reps[s])]
            self._buckets = GradBuckets(
                layout, self.device,
                lambda i, buf: self.comm.all_reduce_async(buf, s, peers,
                                                          f"bucket {i} of {self._round}"))
            log.debug("%s: %d gradient buckets of sizes %s", self.comm.who, len(layout),
                      layout.sizes)
        return self._buckets

    def backward(self, a: Action, recvs: Sequence[Msg] = (), *,
                 update: Action | None = None) -> None:
        """``update``: the U this backward is the last one before; its hooks then launch the
        stage's gradient buckets (when they are overlapped, see :meth:`buckets`). The inputs'
        gradients wait in ``_out`` to be sent."""
        k, st = a.minibatch, self.spec
        bk = self.buckets() if update is not None else None
        if bk is not None:
            self._round = str(update)
            bk.start()
        sums: dict[str, torch.Tensor] = {}
        for m, g in self._received(recvs).items():  # sorted: ascending consumer per value,
            sums[m.name] = g if m.name not in sums else sums[m.name] + g  # as the reference
        out_grads: list[torch.Tensor | None] = [sums.get(n) for n in st.outputs]
        with self.rec.span("backward", str(a), minibatch=k, version=a.version):
            in_grads = self.replica.backward(
                k, out_grads, on_grad=None if bk is None or not bk.early else bk.ready,
                hooked=None if bk is None else bk.early, split=self._split)
        self._out = {n: g for n, src, g in zip(st.inputs, st.sources, in_grads)
                     if src != MODEL and g is not None}
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
        gradients over every rank holding them (their own group), as the reference does: at
        this update, or (delay d > 0) asynchronously, applying round ``i - d`` now."""
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
            buf = self.replica.local_gradient(flags=True) if bk is None or self.tied else None
            segs = [(key, names, self.replica.segment(buf, names, flags=True))
                    for key, names in self.tied]
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
        late: dict[str, torch.Tensor | None] | None = None
        if self._delay == 0:
            for key, names, seg in segs:
                self.comm.all_reduce(seg, key, self._holders(key), f"tied {names} U{a.minibatch}")
                self.replica.put_segment(buf, names, seg, flags=True)
        else:
            late = self._tied_round(a.minibatch, segs, float(buf[-1]))
        with self.rec.span("optimizer", str(a), update=a.minibatch):
            self.replica.apply_update(buf, late, flags=True)

    def _holders(self, key: tuple[int, ...]) -> list[Rank]:
        return [(t, j) for t in key for j in range(self.schedule.replicas[t])]

    def _tied_round(self, i: int, segs: list[tuple[tuple[int, ...], list[str], torch.Tensor]],
                    count: float) -> dict[str, torch.Tensor | None]:
        """Delayed tied rounds: post round i's sums (asynchronous), return round i-d's means."""
        out: dict[str, torch.Tensor | None] = {}
        for key, names, seg in segs:
            pend = self.comm.all_reduce_async(seg, key, self._holders(key),
                                              f"tied {names} round {i}")
            self._rounds[(key, i)] = (pend, count)
            out.update(self._round_means(key, names, i - self._delay))
        return out

    def _round_means(self, key: tuple[int, ...], names: list[str], j: int
                     ) -> dict[str, torch.Tensor | None]:
        if j < 0:
            return {n: None for n in names}
        pend, count = self._rounds.pop((key, j))
        self.comm.wait_all_reduces([pend], f"tied round {j}", group=str(key))
        total = pend.tensor
        mean = total / count if count > 0 and count != 1 else total  # flags stay > 0 or 0
        return self.replica.split_segment(mean, names, flags=True)

    def _finish_tied_rounds(self) -> None:
        """Run end: apply the last ``d`` tied rounds (tied-only steps, as the reference)."""
        if self._delay == 0 or not self.tied:
            return
        done = self.replica.stash.version
        for j in range(max(0, done - self._delay), done):
            grads: dict[str, torch.Tensor | None] = {}
            for key, names in self.tied:
                grads.update(self._round_means(key, names, j))
            with self.rec.span("optimizer", f"tied round {j}", update=j):
                self.replica.apply_tied_only({n: g for n, g in grads.items() if g is not None})
        assert not self._rounds, self._rounds

    # ------------------------------------------------------------------ runs
    def run(self, batches: Sequence[Batch], *, collect_params: bool = True) -> RankResult:
        """Walk the action list; then wait for every send and for all ranks to finish.
        ``collect_params``: copy the latest weights to the host into the result (the trainer
        does not: its weights stay on the device between segments)."""
        sched = self.schedule
        actions = sched.actions[self.me]
        self._delay = tied_delay(sched, self._tied_all)
        self._configure(sched.kind)
        plan = self.plan(sched)
        self._final_b = last_backwards([b.kind for b in actions])
        self._inbox.clear()
        losses: dict[int, torch.Tensor] = {}
        issuer = self._issuer = Issuer(plan, self._post_recv, self._post_send)
        if plan.ops:
            with self.rec.span("recv", "post receives"):
                issuer.start()
        self._split = self.me in split_ranks(sched)
        for i, a in enumerate(actions):
            if self.fault is not None and i == self.fault[1]:
                _inject(self.fault[0], self.comm.who, a)
            if a.kind == "F":
                loss = self.forward(a, batches[a.minibatch], plan.recvs[i])
                if loss is not None:
                    losses[a.minibatch] = loss
            elif a.kind == "B":
                u = self._final_b.get(i)
                self.backward(a, plan.recvs[i], update=None if u is None else actions[u])
            elif a.kind == "W":
                u = self._final_b.get(i)
                self.weight(a, update=None if u is None else actions[u])
            else:
                self.update(a)
            if plan.sends[i]:
                with self.rec.span("send", f"post {a}", minibatch=a.minibatch):
                    for m in plan.sends[i]:
                        issuer.send(m)
        assert issuer.done and not self._inbox, "every planned message was posted and used"
        self._finish_tied_rounds()
        self.comm.flush()
        self.comm.barrier()
        background = sorted(self.comm.background, key=lambda e: e.start)
        self.comm.background.clear()
        keys = sorted(losses)  # one device-to-host read for the whole run
        values = torch.stack([losses[k] for k in keys]).tolist() if keys else []
        params = ({n: t.detach().cpu() for n, t in self.replica.parameters().items()}
                  if collect_params else {})
        log_ = None if self.comm.log is None else list(self.comm.log)
        if self.comm.log is not None:
            self.comm.log.clear()
        return RankResult(dict(zip(keys, map(float, values))), params,
                          self.replica.stash.peak_bytes, self._take_timeline(), background, log_)

    def forward_only(self, parts: Sequence[Batch], metric: Any) -> list[Any]:
        """Evaluation: every owned minibatch's forward in increasing order with the latest
        weights, messages in the same global order as training (F-only schedule); on the last
        stage ``metric(outputs_env, target)`` per minibatch, returned in order."""
        reps = self.schedule.replicas
        n = len(parts)
        ranks = [(s, j) for s, r in enumerate(reps) for j in range(r)]
        sched = Schedule("eval", reps, n, {
            (s, j): tuple(Action("F", k) for k in range(j, n, reps[s])) for s, j in ranks})
        delay, self._delay = self._delay, 0
        try:
            plan = self.plan(sched)
        finally:
            self._delay = delay
        st, out = self.spec, []
        self._inbox.clear()
        issuer = self._issuer = Issuer(plan, self._post_recv, self._post_send)
        issuer.start()
        for i, a in enumerate(sched.actions[self.me]):
            x, y = parts[a.minibatch]
            env = model_env(self.stages, x) if MODEL in st.sources else {}
            got = {m.name: t for m, t in self._received(plan.recvs[i]).items()}
            ins = [to_device(env[n], self.device) if src == MODEL else got[n]
                   for n, src in zip(st.inputs, st.sources)]
            outs = self.replica.evaluate(ins)
            self._out = dict(zip(st.outputs, outs))
            for m in plan.sends[i]:
                issuer.send(m)
            if self.me[0] == len(self.stages) - 1:
                out.append(metric(self._out, to_device(y, self.device)))
        assert issuer.done and not self._inbox
        self.comm.flush()
        self.comm.barrier()
        return out

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
