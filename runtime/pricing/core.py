"""What both plan simulators share: the stage costs, the discrete-event loop and the result.

Kept below :mod:`.plansim` and :mod:`.placed_sim` so that neither imports the other for them; the
model the loop runs is summarised in :mod:`.plansim`.
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from fxpipe.costmodel.hardware import Cluster
from fxpipe.costmodel.profile import Profile
from fxpipe.errors import ConfigError
from fxpipe.passes.partition import SHARD_SYNC, coefficients, shared_parameters
from fxpipe.passes.plan import Plan
from fxpipe.units import format_bytes, format_seconds

from ..schedules.schedule import Action, Rank, sync_sets, tie_by_messages
from ..timeline import TimelineEvent, to_chrome_trace, write_chrome_trace
from .memory import schedule_memory


TIED_CHUNKS = 8  # pieces a background tied all-reduce takes the ports in (see tied_transfer)


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
        self.pair_sent: set[tuple[int, int]] = set()  # (stage, update): its tied part is sent
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
            elif kind == "tied":  # the next piece of a tied all-reduce
                comp, k, left = data
                self.tied_transfer(comp, k, t, left)
            elif kind == "pair":  # the next piece of a tied pair's part
                src, dst, key, left = data
                self.pair_transfer(src, dst, key, t, left)
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
            if self.delay == 0 and self.pair(comp):
                self.pair_update(rank, a, comp, now)
                return
            if self.delay > 0 and i >= self.delay and len(comp) > 1:
                need = ("T", comp[0], i - self.delay)  # lagged tied sum: round i - d arrived
                if need not in self.arrived:
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

    def pair(self, comp: tuple[int, ...]) -> bool:
        """Whether the tied sum of ``comp`` travels as two messages (two stages of one replica
        each, summed at the update: :meth:`fxpipe.runtime.execution.comm.Comm.tied_send`)."""
        return tie_by_messages(comp, self.sched.replicas, 0)

    def pair_update(self, rank: Rank, a: Action, comp: tuple[int, ...], now: float) -> None:
        """Update ``a`` of a stage whose tie is a pair: it sends its part when it gets here
        (on its ports, like a cut) and updates once the other's part has arrived, so the part
        ready first crosses while the other stage computes, as the runtime sends them
        (:meth:`pair_transfer`)."""
        s, i = rank[0], a.minibatch
        other = comp[1] if comp[0] == s else comp[0]
        if (s, i) not in self.pair_sent:
            self.pair_sent.add((s, i))
            self.sync_bytes += self.tied_bytes[s]
            self.pair_transfer(rank, (other, 0), ("P", other, i), now, self.tied_bytes[s])
        if ("P", s, i) not in self.arrived:
            self.waiting.setdefault(("P", s, i), []).append(rank)
            return
        dur = self.costs[s].update_s
        self.ptr[rank] += 1
        if dur > 0:
            self.record(rank, "allreduce", str(a), now, now + dur, update=i)
        self.push(now + dur, "end", (rank, a))

    def pair_transfer(self, src: Rank, dst: Rank, key: tuple[str, int, int], ready: float,
                      left: float) -> None:
        """The next piece of a tied pair's part (``left`` bytes to go): like a lagged sum, on
        the same ports as the cuts in ``TIED_CHUNKS`` pieces, so a cut waits for one piece at
        most (the runtime sends it on a connection of its own, sharing the link)."""
        if left <= 0:
            self.push(ready + self.lat, "arrive", key)
            return
        piece = min(left, self.tied_bytes[src[0]] / TIED_CHUNKS)
        _, end = self.reserve(src, dst, ready, piece)
        self.push(end, "pair", (src, dst, key, left - piece))

    def finished(self, rank: Rank, a: Action, t: float) -> None:
        s, k = rank[0], a.minibatch
        if a.kind == "U":  # the stage's update k is done once every replica's is
            left = self.u_left.get((s, k), self.sched.replicas[s]) - 1
            self.u_left[(s, k)] = left
            if left == 0:
                self.u_done.add((s, k))
                comp = self.comp.get(s, (s,))
                if self.delay > 0 and len(comp) > 1 and all((c, k) in self.u_done for c in comp):
                    self.tied_transfer(comp, k, t)
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

    def tied_transfer(self, comp: tuple[int, ...], k: int, ready: float,
                      left: float | None = None) -> None:
        """Round ``k``'s lagged tied all-reduce, posted once every holder has updated: a ring
        over the holders' replicas, each sending and receiving ``2 (n - 1) / n`` of the tied
        bytes. It runs in the background but on the same ports as the cuts (a slow link carries
        both; the runtime gives it a connection of its own, so the two share the link rather
        than queue): it takes the ports in ``TIED_CHUNKS`` pieces, each reserved when the one
        before ends, so a cut waits for at most one piece. Update ``k + d`` waits for it."""
        holders = [(t, j) for t in comp for j in range(self.sched.replicas[t])]
        n = len(holders)
        ring = max(2.0 * (n - 1) / n * self.tied_bytes[t] for t in comp)
        if left is None:
            left = ring
        if left <= 0:
            self.push(ready + self.lat, "arrive", ("T", comp[0], k))
            return
        piece = min(left, ring / TIED_CHUNKS)
        end = ready
        for i, src in enumerate(holders):  # each holder sends the piece to the next one
            end = max(end, self.reserve(src, holders[(i + 1) % n], ready, piece)[1])
        self.push(end, "tied", (comp, k, left - piece))

    def reserve(self, src: Rank, dst: Rank, ready: float, nbytes: float) -> tuple[float, float]:
        """Hold ``src``'s egress and ``dst``'s ingress port (one port each when not duplex)
        for ``nbytes``, from when both are free and the data is ``ready``: (start, end)."""
        ports = (("out" if self.duplex else "port", self.gid[src]),
                 ("in" if self.duplex else "port", self.gid[dst]))
        start = max(ready, *(self.port_free.get(p, 0.0) for p in ports))
        end = start + nbytes / self.bw
        for p in ports:
            self.port_free[p] = end
        return start, end

    def send(self, src: Rank, dst: Rank, nbytes: float, key: tuple[str, int, int], name: str,
             ready: float) -> None:
        """Reserve the sender's egress and the receiver's ingress port; deliver after latency."""
        start, end = self.reserve(src, dst, ready, nbytes)
        self.cut_bytes += nbytes
        self.record(src, "send", name, start, end, bytes=nbytes, to=self.gid[dst])
        self.push(end + self.lat, "arrive", key)


DEFAULT_FORWARD_FRACTION = 1.0 / 3.0  # backward ~ 2x forward when no profile says otherwise


def tied_from_profile(plan: Plan, profile: Profile) -> list[TiedSync]:
    """The plan's tied parameters: a parameter a node of one stage owns and a node of another
    stage lists in ``shared_params``, with the bytes the planner prices its copies at
    (:func:`fxpipe.passes.partition.shared_parameters`), summed per set of stages."""
    stage_of = {n: sp.index for sp in plan.stages for n in sp.nodes}
    names = profile.names
    by_set: dict[tuple[int, ...], float] = {}
    for owner, nbytes, users in shared_parameters(profile):
        if names[owner] not in stage_of:
            continue
        stages = {stage_of[names[i]] for i in (owner, *users) if names[i] in stage_of}
        if len(stages) > 1:
            key = tuple(sorted(stages))
            by_set[key] = by_set.get(key, 0.0) + nbytes
    return [TiedSync(k, v) for k, v in sorted(by_set.items())]


@dataclass(frozen=True)
class PlanSimulation:
    """Result of :func:`simulate_plan`. Times are seconds; ``steady_state_period`` is seconds per
    minibatch once the pipeline is full (start-up and drain excluded)."""

    plan: Plan
    schedule: str
    minibatches: int
    costs: tuple[StageCosts, ...]
    makespan: float
    steady_state_period: float
    utilisation: tuple[float, ...]           # per stage: F+B time / steady window, replica mean
    activation_bytes_per_minibatch: float    # activations forward + gradients back, all cuts
    sync_bytes_per_minibatch: float          # weight synchronisation of replicated stages
    events: Mapping[int, tuple[TimelineEvent, ...]] = field(hash=False)
    rank_names: Mapping[int, str] = field(hash=False)
    # per stage: most minibatches whose activations a replica holds at once (F until B, or
    # until W when the backward is split): the schedule's activation memory, in minibatches
    in_flight: tuple[int, ...] = ()

    @property
    def activation_memory(self) -> tuple[float, ...]:
        """Bytes of activations a replica of each stage holds at its peak (the plan's
        per-minibatch activation bytes times :attr:`in_flight`; a recomputing stage holds its
        input bytes per minibatch in flight and one minibatch's activations)."""
        return tuple(sp.input_bytes * v + sp.activation_bytes if sp.recompute
                     else sp.activation_bytes * v
                     for sp, v in zip(self.plan.stages, self.in_flight))

    @property
    def memory(self) -> tuple[float, ...]:
        """Bytes a replica of each stage holds at its peak under THIS schedule (weights and
        optimizer state, the versions it stashes, the activations its action list holds at
        once; :mod:`.memory`), where the plan's ``memory_bytes`` is PipeDream's rule."""
        if not self.in_flight:
            return ()
        return schedule_memory(self.plan.stages, self.schedule, self.in_flight)

    @property
    def bytes_per_minibatch(self) -> float:
        return self.activation_bytes_per_minibatch + self.sync_bytes_per_minibatch

    @property
    def bytes_per_sample(self) -> float | None:
        bs = self.plan.batch_size
        return self.bytes_per_minibatch / bs if bs else None

    @property
    def throughput(self) -> float:
        """Samples/s when the plan knows its batch size, else minibatches/s (see
        throughput_unit)."""
        if self.steady_state_period <= 0:
            return math.inf
        return (self.plan.batch_size or 1) / self.steady_state_period

    @property
    def throughput_unit(self) -> str:
        return "samples/s" if self.plan.batch_size else "minibatches/s"

    @property
    def relative_error(self) -> float:
        """(simulated - planned) / planned time per minibatch."""
        p = self.plan.time_per_minibatch
        return (self.steady_state_period - p) / p if p > 0 else 0.0

    def to_chrome_trace(self) -> dict[str, Any]:
        return to_chrome_trace(self.events, self.rank_names)

    def write_trace(self, path: str | Path) -> Path:
        """Chrome/Perfetto JSON, same format as the runtime's measured trace."""
        return write_chrome_trace(self.events, path, self.rank_names)

    def summary(self) -> str:
        lines = [f"simulated {self.minibatches} minibatches, {self.schedule} schedule, "
                 f"replicas {self.plan.replicas} ({self.plan.sync} sync)"]
        for s, (c, u) in enumerate(zip(self.costs, self.utilisation)):
            lines.append(f"  stage {s}: x{self.plan.stages[s].replicas} fwd "
                         f"{format_seconds(c.forward_s)} bwd {format_seconds(c.backward_s)} "
                         + (f"(recompute {format_seconds(c.recompute_s)}) " if c.recompute_s
                            else "") +
                         f"update {format_seconds(c.update_s)} in {format_bytes(c.input_bytes)}"
                         f"  utilisation {u:.0%}"
                         + (f"  activations {self.in_flight[s]} x "
                            f"{format_bytes(self.plan.stages[s].activation_bytes)}, memory "
                            f"{format_bytes(self.memory[s])}" if self.in_flight else ""))
        lines.append(f"steady state: {format_seconds(self.steady_state_period)} per minibatch "
                     f"(plan predicts {format_seconds(self.plan.time_per_minibatch)}, "
                     f"{self.relative_error:+.1%}); {self.throughput:.2f} {self.throughput_unit}")
        lines.append(f"bytes on the wire per minibatch: {format_bytes(self.bytes_per_minibatch)} "
                     f"(cuts {format_bytes(self.activation_bytes_per_minibatch)}, sync "
                     f"{format_bytes(self.sync_bytes_per_minibatch)})")
        lines.append(f"makespan {format_seconds(self.makespan)}")
        return "\n".join(lines)


def stage_costs(plan: Plan, profile: Profile | None = None) -> list[StageCosts]:
    """Per-stage simulation costs from the plan (and the profile's forward/backward split)."""
    cluster = Cluster.from_dict(dict(plan.cluster))
    _, beta, _ = coefficients(cluster, plan.sync, shard=plan.shard is not None)
    ring = SHARD_SYNC if plan.shard is not None else 1.0  # a sharded group's broadcast too
    by_name = {n.name: n for n in profile.nodes} if profile is not None else {}
    out = []
    for sp in plan.stages:
        r = sp.replicas
        extra = sp.recompute_s * r if sp.recompute else 0.0  # the repeated forward
        total = sp.compute_s * r - extra  # the plan divides a stage's compute among its replicas
        frac = DEFAULT_FORWARD_FRACTION
        if by_name:
            missing = [n for n in sp.nodes if n not in by_name]
            if missing:
                raise ConfigError(f"the profile has no node {missing[0]!r} of stage {sp.index}",
                                  "pass the profile the plan was made from")
            f = sum(by_name[n].forward_s for n in sp.nodes)
            b = sum(by_name[n].backward_s for n in sp.nodes)
            if f + b > 0:
                frac = f / (f + b)
        out.append(StageCosts(forward_s=total * frac, backward_s=total * (1.0 - frac) + extra,
                              update_s=r * beta[r - 1] * sp.parameter_bytes if r > 1 else 0.0,
                              parameter_bytes=sp.parameter_bytes, input_bytes=sp.input_bytes,
                              sync_bytes=2.0 * ring * (r - 1) * sp.parameter_bytes,
                              recompute_s=extra))
    return out


def cut_bandwidth(cluster: Cluster) -> float:
    """Bytes/s of a cut transfer: the planner's choice (inter-machine unless one machine)."""
    return cluster.intra_bandwidth if cluster.machines == 1 else cluster.bandwidth
