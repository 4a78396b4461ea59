"""PipeDream's cost model written out from its definitions: the planner tests' oracle.

Nothing here imports ``fxpipe.passes`` (the code under test): the formulas are DESIGN.md's "Cost
model" (after PipeDream, Harlap et al. section 3.1), spelled out per stage, summing each stage's
nodes directly instead of through the solver's prefix sums. A test that prices a plan with these
functions and gets the planner's number has checked the planner against the definition, not
against itself.

Per stage s with compute C, owned parameter bytes P, activation bytes A and r replicas, on a
cluster of ``workers`` with ``workers_per_machine`` per machine:

- sync bandwidth: the intra-machine link when the cluster is one machine or r <= workers per
  machine (the replicas share a machine), else the network between machines;
- stage time: (C + k (r-1)/r P / B_sync) / r, k = 2 for ring all-reduce, 4 for PipeDream's
  parameter server;
- cut into stage s: 2 X / (B_cut r), X = bytes of every value produced before the stage and used in
  or after it (each counted once), B_cut = the network unless the cluster is one machine;
- in flight: v = ceil(replicas of stages s..end / r);
- memory per replica: P (2 + opt) + (v - 1) P + v A (PipeDream); under another schedule
  (``SCHEDULE_MEMORY``, written from each schedule's definition): P (2 + opt) + k P + h A with
  k stashed versions and h activation sets held, e.g. 1F1B with a flush every m microbatches
  stashes nothing and holds min(v, ceil(m / r)): a replica gets every r-th of the m.
- a sharded replica group (ZeRO-1, torch's ZeroRedundancyOptimizer): each of the r replicas
  keeps 1/r of the ``sharded`` bytes of optimizer state per parameter byte (the rest of
  ``opt`` whole), and after the gradients' ring all-reduce broadcasts its share of the new
  weights, (r-1)/r P more per replica: k = 3 in the stage time.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class Net:
    """The cluster as plain numbers (bytes per second)."""

    workers: int
    bandwidth: float
    intra_bandwidth: float
    workers_per_machine: int = 1
    sync: str = "allreduce"

    @property
    def one_machine(self) -> bool:
        return self.workers == self.workers_per_machine

    def sync_bandwidth(self, r: int) -> float:
        return self.intra_bandwidth if self.one_machine or r <= self.workers_per_machine \
            else self.bandwidth

    def cut_bandwidth(self) -> float:
        return self.intra_bandwidth if self.one_machine else self.bandwidth


@dataclass(frozen=True)
class Priced:
    """One plan priced by the definitions."""

    bottleneck: float
    stage_times: tuple[float, ...]
    cut_times: tuple[float, ...]   # 0 for stage 0
    in_flight: tuple[int, ...]
    memory: tuple[float, ...]


def stage_time(c: float, p: float, r: int, net: Net, sharded: bool = False) -> float:
    k = (3.0 if sharded else 2.0) if net.sync == "allreduce" else 4.0
    return (c + k * (r - 1) / r * p / net.sync_bandwidth(r)) / r


def sharded_opt(opt: float, sharded: float | None, r: int) -> float:
    """Optimizer state per parameter byte one of r replicas keeps (``sharded`` None: all)."""
    return opt if sharded is None else opt - sharded * (1 - 1 / r)


def cut_time(x: float, r: int, net: Net) -> float:
    return 2.0 * x / (net.cut_bandwidth() * r)


def in_flight(replicas: Sequence[int], s: int) -> int:
    return math.ceil(sum(replicas[s:]) / replicas[s])


def memory(p: float, a: float, v: int, opt: float) -> float:
    return p * (2 + opt) + (v - 1) * p + v * a


SCHEDULE_MEMORY = {
    # name -> (stashed versions, activation sets) of a replica with window v, r replicas, m
    # microbatches per update
    "pipedream": lambda v, r, m: (v - 1, v),
    "2bw": lambda v, r, m: (1, v),                        # one shadow version, 1F1B's window
    "1f1b-flush": lambda v, r, m: (0, min(v, math.ceil(m / r))),
    "gpipe": lambda v, r, m: (0, math.ceil(m / r)),       # every forward before any backward
}


def schedule_memory(p: float, a: float, v: int, r: int, m: int, opt: float,
                    schedule: str) -> float:
    k, h = SCHEDULE_MEMORY[schedule](v, r, m)
    return p * (2 + opt) + k * p + h * a


def price(compute: Sequence[float], params: Sequence[float], acts: Sequence[float],
          cuts: Sequence[float], starts: Sequence[int], replicas: Sequence[int], net: Net,
          opt: float = 1.0, schedule: str = "pipedream", m: int | None = None,
          shared: Sequence[tuple[int, float, Sequence[int]]] = (),
          sharded: float | None = None) -> Priced:
    """``cuts[p - 1]``: bytes live across cut position p (before node p); ``schedule`` and
    ``m`` (microbatches per update, default the cluster's workers): whose memory; ``shared``:
    parameters (owner node, bytes, user nodes) of which a stage with a user and without the
    owner keeps a copy, in its memory like its own parameters (not in its time); ``sharded``:
    the optimizer state per parameter byte a sharded replica group splits (None: unsharded)."""
    ends = [*starts[1:], len(compute)]
    st, ct, vs, mem = [], [], [], []
    for s, (a, e, r) in enumerate(zip(starts, ends, replicas)):
        c, p, x = sum(compute[a:e]), sum(params[a:e]), sum(acts[a:e])
        copies = sum(b for o, b, users in shared
                     if not a <= o < e and any(a <= u < e for u in users))
        st.append(stage_time(c, p, r, net, sharded is not None and r > 1))
        p += copies
        ct.append(cut_time(cuts[a - 1], r, net) if s else 0.0)
        vs.append(in_flight(replicas, s))
        o = sharded_opt(opt, sharded, r)
        mem.append(memory(p, x, vs[-1], o) if schedule == "pipedream" else
                   schedule_memory(p, x, vs[-1], r, m or net.workers, o, schedule))
    return Priced(max(st + ct), tuple(st), tuple(ct), tuple(vs), tuple(mem))


def live_bytes(names: Sequence[str], inputs: Sequence[Sequence[str]], sizes: Sequence[float],
               sendable: Sequence[bool] | None = None) -> list[float]:
    """Bytes live across each cut position 1..N-1 of a graph in this node order: a value
    produced before the cut and consumed at or after it, once however many later users it has;
    inf where a value that cannot be sent is live."""
    index = {n: i for i, n in enumerate(names)}
    out = []
    for p in range(1, len(names)):
        live = {index[u] for j in range(p, len(names)) for u in inputs[j] if index[u] < p}
        if sendable is not None and not all(sendable[i] for i in live):
            out.append(math.inf)
        else:
            out.append(float(sum(sizes[i] for i in live)))
    return out
