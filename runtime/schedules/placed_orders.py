"""The per-batch orders of the placed kinds (:mod:`.placement`), one merged list per process.

:func:`megatron_order`: Megatron-LM's interleaved warm-up, 1F1B, cool-down. :func:`greedy_orders`:
list scheduling over processes (oldest ready B, else deepest ready F, else a W that delays nothing).
"""
from __future__ import annotations

import heapq
import math
from typing import Sequence

from fxpipe.errors import ConfigError

from .schedule import Action, Rank

Step = tuple[Rank, Action]  # one entry of a process's merged list


def megatron_order(p: int, P: int, v: int, mbs: Sequence[int]) -> list[Step]:
    """Process p's F/B order for one batch ``mbs`` (len a multiple of P) under Megatron-LM's
    interleaved schedule with v chunks (docs/design-notes.md): warm-up, 1F1B, cool-down."""
    m = len(mbs)
    total = m * v
    if m == P:  # Megatron: with as many microbatches as processes, all forwards first
        warm = total
    else:
        warm = min((P - p - 1) * 2 + (v - 1) * P, total)

    def step(k: int, forward: bool) -> Step:
        chunk = (k % (P * v)) // P
        if not forward:
            chunk = v - 1 - chunk
        mb = mbs[(k // (P * v)) * P + k % P]
        return ((chunk * P + p, 0), Action("F" if forward else "B", mb))

    out = [step(k, True) for k in range(warm)]
    for k in range(total - warm):
        out += [step(k + warm, True), step(k, False)]
    out += [step(k, False) for k in range(total - warm, total)]
    return out


def dualpipev_order(p: int, P: int, mbs: Sequence[int]) -> list[Step]:
    """Process p's order for one batch ``mbs`` (at least 2P microbatches) under DualPipeV
    (DeepSeek's DualPipe folded into a V, as torch's ``ScheduleDualPipeV`` runs it): the process
    hosts stage p (chunk 0) and stage 2P - 1 - p (chunk 1). Its eight phases: forwards of chunk
    0; pairs of chunk 0 and chunk 1 forwards; chunk 1's input backward, a pending weight
    backward and a chunk 1 forward; the steady state pairing chunk 0's forward with chunk 1's
    full backward and chunk 1's forward with chunk 0's; chunk 1's full backward then chunk 1's
    forward with chunk 0's backward; both chunks' backwards, input-only from the middle on
    (zero bubble); pending weight backwards with chunk 0's backwards; the last weight
    backwards. A full backward is B then W at once; an input backward's W waits in a queue
    (oldest first). DualPipe overlaps a paired forward and backward on the GPU; here they
    run one after the other, as torch runs them without an overlap callback."""
    m = len(mbs)
    if m < 2 * P:
        raise ConfigError(f"dualpipev with a batch of {m} microbatches on {P} processes",
                          f"DualPipeV needs at least as many microbatches per batch as stages "
                          f"({2 * P})")
    chunk = ((p, 0), (2 * P - 1 - p, 0))
    nxt = {(c, kind): 0 for c in (0, 1) for kind in "FB"}
    pending: list[tuple[int, int]] = []  # (chunk, microbatch) of input backwards awaiting W
    out: list[Step] = []

    def forward(c: int) -> None:
        out.append((chunk[c], Action("F", mbs[nxt[(c, "F")]])))
        nxt[(c, "F")] += 1

    def backward(c: int, full: bool) -> None:
        k = mbs[nxt[(c, "B")]]
        nxt[(c, "B")] += 1
        out.append((chunk[c], Action("B", k)))
        if full:
            out.append((chunk[c], Action("W", k)))
        else:
            pending.append((c, k))

    def weight() -> None:
        if pending:
            c, k = pending.pop(0)
            out.append((chunk[c], Action("W", k)))

    for _ in range(2 * (P - p - 1)):  # 1: chunk 0's forwards
        forward(0)
    for _ in range(p + 1):  # 2: forwards of both chunks
        forward(0)
        forward(1)
    for _ in range(P - p - 1):  # 3: zero bubble on chunk 1
        backward(1, full=False)
        weight()
        forward(1)
    for _ in range(m - 2 * P + p + 1):  # 4: the steady state, forwards paired with backwards
        forward(0)
        backward(1, full=True)
        forward(1)
        backward(0, full=True)
    for _ in range(P - p - 1):  # 5
        backward(1, full=True)
        forward(1)
        backward(0, full=True)
    split = False
    for i in range(p + 1):  # 6: both chunks' backwards, input-only from the middle on
        split = split or (i == (p + 1) // 2 and p % 2 == 1)
        backward(1, full=not split)
        split = split or (i == (p + 1) // 2 and p % 2 == 0)
        backward(0, full=not split)
    for _ in range(P - p - 1):  # 7
        weight()
        backward(0, full=not split)
    for _ in range(p + 1):  # 8: the weight backwards left
        weight()
    return out


def greedy_orders(hosts: Sequence[Sequence[Rank]], num_stages: int, mbs: Sequence[int],
                  limit: int, split: bool,
                  costs: Sequence[tuple[float, float, float]] | None = None,
                  comm: Sequence[float] | None = None) -> list[list[Step]]:
    """Every process's order for one batch by list scheduling (docs/design-notes.md): ``limit``
    minibatches admitted per process (F done on its first stage, that stage's W, or fused B,
    not: the last work of a minibatch on the process, the backward running down the stages;
    each holds at most one activation per hosted stage), ``costs[s]`` = (F,
    B, W) seconds of stage s (unit costs by default; W's cost joins B's when not ``split``).
    A message across the cut into stage s arrives ``comm[s]`` seconds after its producer ended
    when producer and consumer are on different processes (default 0), at once on the same
    one; so a W is not put where it would delay a message about to arrive."""
    S = num_stages
    cost = list(costs) if costs is not None else [(1.0, 1.0, 1.0)] * S
    if len(cost) != S or any(len(c) != 3 or min(c) < 0 for c in cost):
        raise ConfigError(f"costs={list(cost)!r} needs one (F, B, W) >= 0 per stage",
                          "e.g. [(1.0, 1.0, 1.0)] * stages")
    wire = list(comm) if comm is not None else [0.0] * S
    if len(wire) != S or min(wire, default=0.0) < 0:
        raise ConfigError(f"comm={wire!r} needs one time >= 0 per stage (the cut into it)",
                          "e.g. [0.0] * stages")
    where = {r[0]: p for p, h in enumerate(hosts) for r in h}
    if limit < 1:
        raise ConfigError(f"in-flight limit {limit}", "allow at least 1 in flight per process")
    P = len(hosts)
    done: dict[tuple[str, int, int], float] = {}
    todo_f = {s: list(mbs) for s in range(S)}
    wait_b: dict[int, list[int]] = {s: [] for s in range(S)}
    wait_w: dict[int, list[int]] = {s: [] for s in range(S)}
    in_flight = [0] * P  # minibatches admitted on the process's first stage, not finished there
    first = [min(r[0] for r in h) for h in hosts]
    order: list[list[Step]] = [[] for _ in range(P)]
    left = [len(h) * len(mbs) * (3 if split else 2) for h in hosts]
    heap = [(0.0, i, p) for i, p in enumerate(p for p in range(P) if left[p])]
    heapq.heapify(heap)
    pushes, progress = len(heap), 0
    stalled: dict[int, tuple[int, float]] = {}  # process -> (progress, time) of its last idle

    times: list[float] = []  # every end and every arrival so far: when an idle process looks

    def dep_end(kind: str, s: int, k: int) -> float:
        """When the input of ``kind`` k on stage s is there (inf: not scheduled yet)."""
        if kind == "F":
            if s == 0:
                return 0.0
            return done.get(("F", s - 1, k), math.inf) + \
                (wire[s] if where[s - 1] != where[s] else 0.0)
        if s == S - 1:
            return done.get(("F", s, k), math.inf)
        return done.get(("B", s + 1, k), math.inf) + \
            (wire[s + 1] if where[s + 1] != where[s] else 0.0)

    def dur(kind: str, s: int) -> float:
        f, b, w = cost[s]
        return f if kind == "F" else w if kind == "W" else (b if split else b + w)

    while heap:
        t, _, p = heapq.heappop(heap)
        stages = [r[0] for r in hosts[p]]
        # an F on the process's first stage admits a minibatch (limited); deeper F's continue
        # admitted ones: never limited, or a process full of first-stage F's would wait forever
        allowed = [q for q in stages if todo_f[q] and (q != first[p] or in_flight[p] < limit)]
        bs = sorted((k, -s) for s in stages for k in wait_b[s] if dep_end("B", s, k) <= t)
        fs = sorted((-q, todo_f[q][0]) for q in allowed if dep_end("F", q, todo_f[q][0]) <= t)
        pick: tuple[str, int, int] | None = None
        if bs:
            pick = ("B", -bs[0][1], bs[0][0])
        elif fs:
            pick = ("F", -fs[0][0], fs[0][1])
        else:
            ws = sorted((k, -s) for s in stages for k in wait_w[s])
            if ws:
                k, s = ws[0][0], -ws[0][1]
                soon = [dep_end("B", q, j) for q in stages for j in wait_b[q]] + \
                    [dep_end("F", q, todo_f[q][0]) for q in allowed]
                if all(e >= t + dur("W", s) for e in soon):
                    pick = ("W", s, k)
        if pick is None:  # idle until something this process may run can start
            stalled[p] = (progress, t)
            later = [e for e in times if e > t] + [h[0] for h in heap if h[0] > t]
            if later:
                heapq.heappush(heap, (min(later), pushes, p))
            elif any(stalled.get(h[2]) != (progress, t) for h in heap):  # others due now may help
                heapq.heappush(heap, (t, pushes, p))
            else:
                raise ConfigError(f"greedy scheduling is stuck on process {p}",
                                  "allow more minibatches in flight per process")
            pushes += 1
            continue
        progress += 1
        kind, s, k = pick
        if kind == "F":
            todo_f[s].pop(0)
            wait_b[s].append(k)
            in_flight[p] += s == first[p]
        elif kind == "B":
            wait_b[s].remove(k)
            if split:
                wait_w[s].append(k)
            else:
                in_flight[p] -= s == first[p]
        else:
            wait_w[s].remove(k)
            in_flight[p] -= s == first[p]
        done[(kind, s, k)] = end = t + dur(kind, s)
        times.append(end)
        if kind == "F" and s + 1 < S:
            times.append(end + wire[s + 1])
        elif kind == "B" and s > 0:
            times.append(end + wire[s])
        order[p].append(((s, 0), Action(kind, k)))  # type: ignore[arg-type]
        left[p] -= 1
        if left[p]:
            heapq.heappush(heap, (t + dur(kind, s), pushes, p))
            pushes += 1
    return order
