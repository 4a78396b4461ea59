"""The distributed executor: one process per (stage, replica) rank, walking its own action list.

Actions, minibatch owners and message shapes are known ahead; compute is the reference executor's
:class:`StageReplica`, messages follow commplan's global order, and ``U`` is in ``rank_update``.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from fxpipe.codegen.split import MODEL, StageSpec

from ..replica.clipping import GROUP, counted, stage_clipper
from ..replica.device import to_device
from ..replica.global_step import step_hook
from ..replica.live_bytes import PeakMemory
from ..replica.mitigation import make_replica
from ..replica.stage import (LossFn, detached_values, model_env, sync_components, tie_sets,
                             tied_parameters)
from ..replica.stash import OptimizerFactory
from ..replica.step_options import DEFAULT, StepOptions
from ..schedules.commplan import (Msg, RankPlan, StretchPlanner, comm_plans, links_of,
                                  require_posted)
from ..schedules.localsgd import LOCALSGD
from ..schedules.program import lower
from ..schedules.proofs import SendProofs
from ..schedules.schedule import Action, Rank, Schedule, execution_order, split_ranks
from ..schedules.spec import Mitigation
from ..schedules.stream import Window
from ..timeline import Recorder, TimelineEvent
from .buckets import DEFAULT_BUCKET_BYTES, GradBuckets, last_backwards
from .comm import Comm, _Pending
from .contract import Batch, planned_reads, prepare_window, tied_delay
from .rank_update import UpdateMixin
from .sharding import sharded_factory
from .wire import WirePlan

log = logging.getLogger(__name__)

ActionHook = Callable[[int, Action], None]
"""Called in a rank before each of its actions, with the action's index and the action (a
run's ``hooks``; tests make a rank die or hang at an action with one)."""


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


class RankExecutor(UpdateMixin):
    """Carry out ``schedule.actions[me]`` (docs/design-notes.md)."""

    def __init__(self, stages: Sequence[StageSpec], schedule: Schedule, me: Rank,
                 loss_fn: LossFn, optimizer_factory: OptimizerFactory, wire: WirePlan,
                 comm: Comm, *, stashing: bool = True, device: torch.device | None = None,
                 before_action: ActionHook | None = None, recorder: Recorder | None = None,
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
        self._pair_inbox: dict[tuple[int, ...], tuple[int, _Pending]] = {}
        self._pair_sent: dict[tuple[int, ...], _Pending] = {}
        self._delay = 0
        self.rec = recorder or comm.recorder
        self.schedule = schedule
        self.me = me
        self.spec = self.stages[me[0]]
        self.wire = wire
        self.comm = comm
        self.device = device or torch.device("cpu")
        self.before_action = before_action
        self._inbox: dict[Msg, _Pending] = {}  # receives posted, not yet waited for
        self._data: dict[int, Batch] = {}  # minibatches this rank forwards, not yet forwarded
        self._planner: StretchPlanner | None = None  # set while a stretch runs
        self._proofs: SendProofs | None = None  # ... and which receive proves which send done
        self._sent: list[tuple[int, int]] = []  # (dst, tag) of the messages an action posted
        self._out: dict[str, torch.Tensor] = {}
        last = len(self.stages) - 1
        # values no gradient flows back along: no message planned, none computed or sent
        self._detached = detached_values(self.stages)
        self._split = False  # this run's B computes input gradients only, W the rest (see run)
        self.meter: PeakMemory | None = None  # measure_memory: told which action runs
        if (options.shard == "optimizer" and schedule.replicas[me[0]] > 1
                and schedule.kind != LOCALSGD):  # ZeRO-1 over the stage's replica group
            optimizer_factory = sharded_factory(optimizer_factory, comm.groups[me[0]])
        self.replica = make_replica(self.spec, optimizer_factory, delay=delay,  # mitigation.py
                                    mitigation=mitigation, depth=len(self.stages),
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
        """This rank's messages for the complete schedule ``sched``, in the global order (see
        :mod:`~fxpipe.runtime.schedules.commplan`)."""
        index = {n: i for i, n in enumerate(self.wire.values)}
        return comm_plans(self.links, sched, index, self._grad_ok, self._sync, self._delay,
                          ranks=[self.me])[self.me]

    def _post_recv(self, m: Msg) -> None:
        spec = self.wire.spec(m.name, m.minibatch)
        self._inbox[m] = self.comm.post_recv(
            spec, m.peer, self.comm.tag(m.minibatch, m.value, m.direction), m.describe())

    def _post(self, msgs: Sequence[Msg]) -> None:
        """Post ``msgs`` in order (a program's posts: sends and receives)."""
        for m in msgs:
            if m.send:
                self._post_send(m)
            else:
                self._post_recv(m)

    def _post_send(self, m: Msg) -> None:
        t = self._out.get(m.name)
        if t is None:
            raise RuntimeError(f"{self.comm.who}: no {m.describe()} to send (a bug)")
        self._sent.append(self.comm.send(t, m.peer,
                                         self.comm.tag(m.minibatch, m.value, m.direction),
                                         m.describe(), self.wire.spec(m.name, m.minibatch)))

    def _received(self, msgs: Sequence[Msg]) -> dict[Msg, torch.Tensor]:
        require_posted(msgs, self._inbox)
        got = {m: self.comm.wait(self._inbox.pop(m)) for m in msgs}
        if self._proofs is not None:  # the sends these prove received go now (schedules/proofs)
            for m in msgs:
                for s in self._proofs.proven_by(m):
                    self.comm.complete(s.peer, self.comm.tag(s.minibatch, s.value, s.direction))
        return got

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

    # ------------------------------------------------------------------ runs
    def run(self, batches: Sequence[Batch], *, collect_params: bool = True) -> RankResult:
        """Carry out :attr:`schedule`, a complete schedule (a stretch of one window)."""
        return self.run_window(self.schedule, batches, collect_params=collect_params)

    def run_window(self, sched: Schedule, batches: Sequence[Batch], *,
                   collect_params: bool = True) -> RankResult:
        """Walk this rank's actions of ``sched``: a complete schedule, or a window of a stretch
        (:class:`~fxpipe.runtime.schedules.stream.Window`, ``batches`` its new minibatches
        ``[start, stop)``). Messages, stashed versions and tied rounds in flight carry over
        to the stretch's next window; a stretch's final window ends with every send received
        and a barrier of all ranks. ``collect_params``: copy the latest weights to the host
        into the result (the trainer does not: its weights stay on the device)."""
        start, final = getattr(sched, "start", 0), getattr(sched, "final", True)
        actions = sched.actions[self.me]
        if start == 0:
            self._begin(sched)
        elif self._planner is None:
            raise RuntimeError(f"{self.comm.who}: a window at minibatch {start} of a stretch "
                               "that did not start (a bug)")
        self.schedule = sched
        self._data.update((start + k, b) for k, b in enumerate(batches)
                          if self._forwards(start + k))
        prepare_window(self.replica, sched, self.me)
        order = (sched.order if isinstance(sched, Window)
                 else execution_order(sched, self._sync, self._delay))
        plan = self._planner.window(sched, order)[self.me]
        if self._proofs is not None:
            self._proofs.window(sched.actions, (m for ms in plan.sends for m in ms))
        self._final_b = last_backwards([b.kind for b in actions])
        losses: dict[int, torch.Tensor] = {}
        program = lower(plan, actions)  # the posts and waits around each action (program.py)
        if plan.ops:
            with self.rec.span("recv", "post receives"):
                self._post(program.start)
        updates = iter([i for i, b in enumerate(actions) if b.kind == "U"])
        u_next = next(updates, None)
        if u_next is not None and self.tied:  # ties of two ranks: their parts' receives
            self.prepost_tied(actions[u_next])
        meter = self.meter
        for step in program.steps:
            i, a = step.index, step.action
            if self.before_action is not None:
                self.before_action(i, a)
            if meter is not None:
                meter.at("comm")
            self._post(step.before)  # the receives due by now
            if meter is not None:
                meter.at(a.kind)  # F, B, W or U: what each storage is charged to
            if a.kind == "F":  # each computing action waits for step.waits as it needs them
                loss = self.forward(a, self._data.pop(a.minibatch), step.waits)
                if loss is not None:
                    losses[a.minibatch] = loss
            elif a.kind == "B":
                u = self._final_b.get(i)
                self.backward(a, step.waits, update=None if u is None else actions[u])
            elif a.kind == "W":
                u = self._final_b.get(i)
                self.weight(a, update=None if u is None else actions[u])
            else:
                self.update(a)
                u_next = next(updates, None)
                if u_next is not None and self.tied:
                    self.prepost_tied(actions[u_next])
            if step.after:
                if meter is not None:
                    meter.at("comm")
                self._sent = []
                with self.rec.span("send", f"post {a}", minibatch=a.minibatch) as span:
                    self._post(step.after)
                    span.args["msgs"] = tuple(self._sent)  # (dst, tag): see wait_breakdown
        self._post(program.end)  # receives of this window waited for in the next one
        log_ = None
        if final:
            assert not self._inbox and not self._data, "every message and minibatch was used"
            self._finish_tied_rounds()
            self._finish_tied_pairs()
            self.comm.flush()
            self.comm.barrier()
            self._planner = self._proofs = None
            if self.comm.log is not None:  # the whole stretch's host calls (the NCCL checker)
                log_ = list(self.comm.log)
                self.comm.log.clear()
        background = sorted(self.comm.background, key=lambda e: e.start)
        self.comm.background.clear()
        keys = sorted(losses)  # one device-to-host read for the whole window
        values = torch.stack([losses[k] for k in keys]).tolist() if keys else []
        params = ({n: t.detach().cpu() for n, t in self.replica.parameters().items()}
                  if collect_params else {})
        return RankResult(dict(zip(keys, map(float, values))), params,
                          self.replica.stash.peak_bytes, self._take_timeline(), background, log_)

    def _begin(self, sched: Schedule) -> None:
        """A new stretch: nothing may be in flight; its plan, clipping and tied delay."""
        if self._inbox or self._data or self._pair_inbox or self._pair_sent:
            raise RuntimeError(f"{self.comm.who}: a new schedule while the last stretch has "
                               "messages or minibatches in flight (its final window did not "
                               "run: a bug)")
        self._delay = tied_delay(sched, self._tied_all)
        self._configure(sched.kind)
        index = {n: i for i, n in enumerate(self.wire.values)}
        self._planner = StretchPlanner(self.links, sched.replicas, index, self._grad_ok,
                                       ranks=[self.me], split=split_ranks(sched),
                                       sync=self._sync, delay=self._delay)
        self._split = self.me in split_ranks(sched)
        self._proofs = SendProofs(self.links, self._planner.owner, self.me, index, self._grad_ok)

    def _forwards(self, k: int) -> bool:
        """Whether this rank forwards minibatch k (and so keeps its inputs until then)."""
        return self.schedule.owner(self.me[0], k) == self.me

    def forward_only(self, parts: Sequence[Batch], metric: Any) -> list[Any]:
        """Evaluation: every owned minibatch's forward in increasing order with the latest
        weights, messages in the same global order as training (F-only schedule); on the last
        stage ``metric(outputs_env, target)`` per minibatch, returned in order."""
        reps = self.schedule.replicas
        n = len(parts)
        ranks = [(s, j) for s, r in enumerate(reps) for j in range(r)]
        sched = Schedule("eval", reps, n, {
            (s, j): tuple(Action("F", k) for k in range(j, n, reps[s])) for s, j in ranks})
        if self._planner is not None:
            raise RuntimeError(f"{self.comm.who}: evaluation inside a stretch (a bug: the "
                               "trainer drains before it evaluates)")
        index = {n: i for i, n in enumerate(self.wire.values)}
        plan = comm_plans(self.links, sched, index, self._grad_ok, ranks=[self.me])[self.me]
        st, out = self.spec, []
        self._inbox.clear()
        program = lower(plan, sched.actions[self.me])
        self._post(program.start)
        for step in program.steps:
            self._post(step.before)
            x, y = parts[step.action.minibatch]
            env = model_env(self.stages, x) if MODEL in st.sources else {}
            got = {m.name: t for m, t in self._received(step.waits).items()}
            ins = [to_device(env[n], self.device) if src == MODEL else got[n]
                   for n, src in zip(st.inputs, st.sources)]
            outs = self.replica.evaluate(ins)
            self._out = dict(zip(st.outputs, outs))
            self._post(step.after)
            if self.me[0] == len(self.stages) - 1:
                out.append(metric(self._out, to_device(y, self.device)))
        self._post(program.end)
        assert not self._inbox
        self.comm.flush()
        self.comm.barrier()
        return out

    def _take_timeline(self) -> list[TimelineEvent]:
        """This run's events (with idle gaps); the recorder starts empty for the next run."""
        events = self.rec.finish()
        self.rec.events.clear()
        return events

