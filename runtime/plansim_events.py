"""The discrete-event loop behind :func:`fxpipe.runtime.plansim.simulate_plan`, and the costs it
runs on: per-stage :class:`StageCosts`, :class:`TiedSync` groups, :func:`split_backward`.

Kept apart from ``plansim`` (which builds the costs from a plan and reads the results) so each
stays small; the model it implements (ports as first-come-first-served resources, updates as
barriers of a stage's replicas, tied all-reduces with a lag) is described there.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Any, Sequence

from .schedule import Action, Rank, sync_sets
from .timeline import TimelineEvent


@dataclass(frozen=True)
class TiedSync:
    """Parameters shared by ``stages`` (``nbytes`` of them), summed at every update."""

    stages: tuple[int, ...]
    nbytes: float


@dataclass(frozen=True)
class StageCosts:
    """What one replica of a stage costs in the simulation (seconds per minibatch / update)."""

    forward_s: float
    backward_s: float
    update_s: float
    parameter_bytes: float
    input_bytes: float
    sync_bytes: float  # bytes sent on the wire by all replicas together per update
    recompute_s: float = 0.0  # the forward a recomputing stage repeats, inside backward_s


def split_backward(c: StageCosts) -> tuple[float, float]:
    """(B, W) of a split backward: half each, the recomputed forward in B (it needs it first)."""
    half = (c.backward_s - c.recompute_s) / 2
    return half + c.recompute_s, half


class EventLoop:
    """The event loop. Ranks run their action lists in order; a rank whose next action lacks its
    input waits; transfers reserve link ports first come first served (requests are made in
    time order, so reserving at request time is FIFO)."""

    def __init__(self, sched: Any, costs: list[StageCosts], bandwidth: float, latency: float,
                 duplex: bool, tied: Sequence[TiedSync] = (), delay: int = 0) -> None:
        self.sched, self.costs, self.bw, self.lat, self.duplex = sched, costs, bandwidth, latency, duplex
        # tied weights: stage -> its component (stages updating together or with a lag), the
        # bytes it all-reduces per update, and the lag in rounds
        self.comp = {s: c for c in sync_sets([t.stages for t in tied]) for s in c}
        self.tied_bytes = {s: sum(t.nbytes for t in tied if s in t.stages)
                           for s in range(sched.num_stages)}
        self.delay = delay
        self.u_left: dict[tuple[int, int], int] = {}  # (stage, update) -> replicas not done
        self.u_done: set[tuple[int, int]] = set()
        self.S = sched.num_stages
        self.split = {rank for rank, acts in sched.actions.items()
                      if any(a.kind == "W" for a in acts)}  # B and W: half the backward each
        self.gid: dict[Rank, int] = {rank: i for i, rank in enumerate(sched.ranks)}
        self.ptr = {rank: 0 for rank in sched.ranks}
        self.events: dict[int, list[TimelineEvent]] = {g: [] for g in self.gid.values()}
        self.arrived: set[tuple[str, int, int]] = set()
        self.waiting: dict[tuple[str, int, int], list[Rank]] = {}
        self.barrier: dict[tuple[int, int], int] = {}
        self.port_free: dict[tuple[str, int], float] = {}
        self.done = [0.0] * sched.num_minibatches
        self.heap: list[tuple[float, int, str, Any]] = []
        self.seq = 0
        self.makespan = 0.0
        self.cut_bytes = 0.0
        self.sync_bytes = 0.0

    def push(self, t: float, kind: str, data: Any) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, kind, data))

    def run(self) -> None:
        for rank in self.sched.ranks:
            self.advance(rank, 0.0)
        while self.heap:
            t, _, kind, data = heapq.heappop(self.heap)
            self.makespan = max(self.makespan, t)
            if kind == "end":
                rank, a = data
                self.finished(rank, a, t)
                self.advance(rank, t)
            else:  # "arrive"
                self.arrived.add(data)
                for rank in self.waiting.pop(data, []):
                    self.advance(rank, t)
        stuck = {r: p for r, p in self.ptr.items() if p < len(self.sched.actions[r])}
        if stuck:  # make_schedule validated the schedule, so this is a simulator bug
            raise RuntimeError(f"plan simulation stalled at {stuck}")

    def record(self, rank: Rank, cat: str, name: str, start: float, end: float, **args: Any) -> None:
        self.events[self.gid[rank]].append(
            TimelineEvent(cat, name, start, end, {"stage": rank[0], "replica": rank[1], **args}))

    def advance(self, rank: Rank, now: float) -> None:
        """Start ``rank``'s next action if it can run now (the rank is idle when called)."""
        acts = self.sched.actions[rank]
        if self.ptr[rank] >= len(acts):
            return
        a: Action = acts[self.ptr[rank]]
        s, c = rank[0], self.costs[rank[0]]
        if a.kind == "U":
            i, comp = a.minibatch, self.comp.get(s, (s,))
            if self.delay > 0 and i >= self.delay:  # lagged tied sum: wait for round i - d
                for t in comp:
                    need = ("U", t, i - self.delay)
                    if t != s and (t, i - self.delay) not in self.u_done:
                        if rank not in self.waiting.get(need, []):
                            self.waiting.setdefault(need, []).append(rank)
                        return
            group = comp if self.delay == 0 else (s,)
            key = (group[0], i)
            self.barrier[key] = self.barrier.get(key, 0) + 1
            if self.barrier[key] < sum(self.sched.replicas[t] for t in group):
                return  # the last rank to arrive starts the all-reduce for everyone
            holders = sum(self.sched.replicas[t] for t in comp)
            for t in group:
                ct = self.costs[t]
                self.sync_bytes += ct.sync_bytes
                ring = 2.0 * (holders - 1) / holders * self.tied_bytes[t] if holders > 1 else 0.0
                self.sync_bytes += ring * self.sched.replicas[t]
                dur = ct.update_s + (ring / self.bw if self.delay == 0 else 0.0)
                for j in range(self.sched.replicas[t]):
                    peer = (t, j)
                    self.ptr[peer] += 1
                    if dur > 0:
                        self.record(peer, "allreduce", str(a), now, now + dur, update=i)
                    self.push(now + dur, "end", (peer, a))
            return
        k = a.minibatch
        need = (("A", s, k) if a.kind == "F" and s > 0 else
                ("G", s, k) if a.kind == "B" and s < self.S - 1 else None)
        if need is not None and need not in self.arrived:
            self.waiting.setdefault(need, []).append(rank)
            return
        dur = (c.forward_s if a.kind == "F" else c.backward_s if rank not in self.split
               else split_backward(c)[0 if a.kind == "B" else 1])
        self.ptr[rank] += 1
        self.record(rank, "forward" if a.kind == "F" else "backward", str(a), now, now + dur,
                    minibatch=k)
        self.push(now + dur, "end", (rank, a))

    def finished(self, rank: Rank, a: Action, t: float) -> None:
        s, k = rank[0], a.minibatch
        if a.kind == "U":  # the stage's update k is done once every replica's is
            left = self.u_left.get((s, k), self.sched.replicas[s]) - 1
            self.u_left[(s, k)] = left
            if left == 0:
                self.u_done.add((s, k))
                for waiter in self.waiting.pop(("U", s, k), []):
                    self.advance(waiter, t)
            return
        if a.kind == "W":
            self.done[k] = max(self.done[k], t)
        elif a.kind == "F" and s < self.S - 1:
            self.send(rank, self.sched.owner(s + 1, k), self.costs[s + 1].input_bytes,
                      ("A", s + 1, k), f"act F{k}", t)
        elif a.kind == "B":
            if s > 0:
                self.send(rank, self.sched.owner(s - 1, k), self.costs[s].input_bytes,
                          ("G", s - 1, k), f"grad B{k}", t)
            else:
                self.done[k] = max(self.done[k], t)

    def send(self, src: Rank, dst: Rank, nbytes: float, key: tuple[str, int, int], name: str,
             ready: float) -> None:
        """Reserve the sender's egress and the receiver's ingress port; deliver after latency."""
        out = ("out" if self.duplex else "port", self.gid[src])
        inn = ("in" if self.duplex else "port", self.gid[dst])
        start = max(ready, self.port_free.get(out, 0.0), self.port_free.get(inn, 0.0))
        end = start + nbytes / self.bw
        self.port_free[out] = self.port_free[inn] = end
        self.cut_bytes += nbytes
        self.record(src, "send", name, start, end, bytes=nbytes, to=self.gid[dst])
        self.push(end + self.lat, "arrive", key)
