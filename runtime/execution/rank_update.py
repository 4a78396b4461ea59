"""The update ``U`` of a distributed rank: the replicas' gradient sum, tied parameters, the step.

A mixin of :class:`~fxpipe.runtime.execution.executor.RankExecutor`, kept apart so the executor
reads as the walk over its actions.
"""
from __future__ import annotations

import logging

import torch

from ..replica.stage import StageReplica
from ..schedules.localsgd import LOCALSGD, averages_after
from ..schedules.schedule import Action, Rank, Schedule, tie_by_messages
from ..timeline import Recorder
from .buckets import BucketLayout, GradBuckets
from .comm import Comm, TensorSpec, _Pending, tied_channel

log = logging.getLogger(__name__)


class UpdateMixin:
    """Update methods of the RankExecutor (it provides the attributes declared here)."""

    me: Rank
    schedule: Schedule
    replica: StageReplica
    comm: Comm
    rec: Recorder
    device: torch.device
    overlap_allreduce: bool
    bucket_bytes: int
    tied: list[tuple[tuple[int, ...], list[str]]]
    _buckets: GradBuckets | None
    _round: str
    _delay: int
    _rounds: dict[tuple[tuple[int, ...], int], tuple[_Pending, float]]
    _pair_inbox: dict[tuple[int, ...], tuple[int, _Pending]]  # tie -> (update, receive posted)
    _pair_sent: dict[tuple[int, ...], _Pending]  # tie -> this rank's last part sent

    def buckets(self) -> GradBuckets | None:
        """The stage's gradient buckets, or None when its replicas' sum is not overlapped (one
        replica, or ``overlap_allreduce=False``: one flat all-reduce at ``U``)."""
        s, reps = self.me[0], self.schedule.replicas
        if not self.overlap_allreduce or reps[s] < 2 or self.schedule.kind == LOCALSGD:
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
        if self.schedule.kind == LOCALSGD:
            self._local_sgd_update(a)
            return
        bk = self.buckets()
        if bk is not None and not bk.active:  # no backward this round: post everything now
            self._round = str(a)
            bk.start()
            bk.finish(self.replica.grad_sums, self.replica.count)
        if reps[s] == 1:  # no replica to sum with: no flat buffer (a copy of every gradient)
            tied = self._lone_tied(a) if self.tied else None
            with self.rec.span("optimizer", str(a), update=a.minibatch):
                self.replica.apply_local_update(tied, tied_means=self._delay > 0)
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

    def _local_sgd_update(self, a: Action) -> None:
        """LocalSGD's ``U``: the replica steps alone on its own gradient (a trailing ``U``
        without a minibatch steps nothing), then, every H-th update and at the schedule's
        last, the stage's replicas average their weights (:meth:`average_replicas`)."""
        with self.rec.span("optimizer", str(a), update=a.minibatch):
            if self.replica.count:
                self.replica.apply_local_update()
            else:
                self.replica.stash.version += 1
        update = self.replica.stash.version - 1
        if averages_after(self.schedule, update):  # type: ignore[arg-type]
            self.average_replicas(f"average after U{a.minibatch}")

    @torch.no_grad()
    def average_replicas(self, what: str) -> None:
        """Replace this replica's weights and floating buffers by their mean over the stage's
        replica group, as the reference's LocalSGD average: one all-reduce per dtype of the
        float32 masters (rounded down into the weights afterwards) or the weights themselves,
        and the floating buffers. The optimizer's state stays with its replica."""
        s = self.me[0]
        peers = [(s, j) for j in range(self.schedule.replicas[s])]
        if len(peers) < 2:
            return
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in self.replica.averaged():
            by_dtype.setdefault(t.dtype, []).append(t)
        with self.rec.span("allreduce", what, group=str(s)):
            for ts in by_dtype.values():
                flat = torch.cat([t.reshape(-1) for t in ts])
                self.comm.all_reduce(flat, s, peers, what)
                flat /= len(peers)
                at = 0
                for t in ts:
                    t.copy_(flat[at:at + t.numel()].view_as(t))
                    at += t.numel()
        self.replica.stash.masters.copy_down(self.replica.stash.latest)

    def _lone_tied(self, a: Action) -> dict[str, torch.Tensor | None]:
        """A lone replica's tied parameters: their segments alone summed over the tie's holders
        (the rest of its gradients never leave it): this round's sums (delay 0), or round
        ``i - d``'s means; the same values as the flat path's."""
        with self.rec.span("optimizer", f"{a} gradients", update=a.minibatch):
            segs = [(key, names, self.replica.local_segment(names)) for key, names in self.tied]
        if self._delay:
            return self._tied_round(a.minibatch, segs, float(self.replica.count))
        out: dict[str, torch.Tensor | None] = {}
        for key, names, seg in segs:
            other = self._pair(key)
            if other is None:
                self.comm.all_reduce(seg, key, self._holders(key),
                                     f"tied {names} U{a.minibatch}")
            else:
                seg = self._pair_sum(key, names, seg, other, a.minibatch)
            out.update(self.replica.split_segment(seg, names, flags=True))
        return out

    # A tie held by exactly two lone replicas, summed at the update (delay 0), travels as two
    # messages (Comm.tied_send): the receive of the other's part is posted when the round
    # begins (prepost_tied), so the part ready first crosses while the other rank computes.
    def _pair(self, key: tuple[int, ...]) -> Rank | None:
        """The other holder of tie ``key`` when its sum travels as two messages, else None."""
        if not tie_by_messages(key, self.schedule.replicas, self._delay):
            return None
        holders = self._holders(key)
        other = holders[0] if holders[1] == self.me else holders[1]
        mine, theirs = self.comm.rank_of[self.me], self.comm.rank_of[other]
        if {tied_channel(mine, theirs), tied_channel(theirs, mine)} - set(self.comm.groups):
            return None  # groups made without the pair's channels: the all-reduce
        return other

    def prepost_tied(self, u: Action) -> None:
        """Post the receives of the other holders' parts for update ``u`` (ties summed as two
        messages), before the backwards whose gradients they complete."""
        for key, names in self.tied:
            other = self._pair(key)
            if other is None or key in self._pair_inbox:
                continue
            shape, dtype = self.replica.segment_spec(names)
            self._pair_inbox[key] = (u.minibatch, self.comm.tied_recv(
                TensorSpec(shape, dtype), other, u.minibatch, f"tied {names} U{u.minibatch}"))

    def _pair_sum(self, key: tuple[int, ...], names: list[str], seg: torch.Tensor,
                  other: Rank, k: int) -> torch.Tensor:
        """This rank's part plus the other holder's: the all-reduce's value on both ranks
        (one addition, and a + b == b + a in IEEE arithmetic)."""
        k_posted, recv = self._pair_inbox.pop(key, (k, None))
        if k_posted != k:
            raise RuntimeError(f"{self.comm.who}: the receive of tie {list(key)} was posted "
                               f"for update {k_posted}, not {k} (a bug)")
        if recv is None:
            recv = self.comm.tied_recv(TensorSpec(tuple(seg.shape), seg.dtype), other, k,
                                       f"tied {names} U{k}")
        send = self.comm.tied_send(seg, other, k, f"tied {names} U{k}")
        theirs = self.comm.tied_wait(recv)
        last = self._pair_sent.pop(key, None)
        if last is not None:  # received: the other part k was sent after its update k - 1,
            self.comm.tied_wait(last, span=False)  # which waited for this rank's part k - 1
        self._pair_sent[key] = send
        return seg + theirs

    def _finish_tied_pairs(self) -> None:
        """Stretch end: this rank's last parts received (each wait bounded by the timeout)."""
        assert not self._pair_inbox, self._pair_inbox
        for key in list(self._pair_sent):
            self.comm.tied_wait(self._pair_sent.pop(key), span=False)

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
