"""Zero-bubble schedules (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024), as data.

Backwards split into B and W; a greedy list scheduler runs the oldest ready B, else an F within
``limits``, else a W that delays no B or F. Every W precedes the update, as in ``1f1b-flush``.
"""
from __future__ import annotations

import heapq
from typing import Sequence

from fxpipe.errors import ConfigError

from .schedule import Action, Rank, _one_f_one_b

Costs = Sequence[tuple[float, float, float]]  # per stage: (F, B, W) seconds of one replica


def limits(kind: str, windows: Sequence[int]) -> tuple[int, ...]:
    """Most minibatches in flight (F done, W not) per replica of each stage: 1F1B's windows for
    ``zb-h1`` (the same activation memory as 1F1B), and for ``zb-h2`` twice the input stage's
    window less one on every stage, the least with which the simulated bubble of a balanced
    pipeline is only the last stage's start-up (makespan ``3m + S - 1`` with F = B = W = 1, for
    S = 2, 3, 4, 8 and m = S, 2S, 4S: tests/runtime/schedules/test_runtime_zerobubble.py)."""
    if kind == "zb-h1":
        return tuple(windows)
    if kind == "zb-h2":
        return tuple(2 * windows[0] - 1 for _ in windows)
    raise ConfigError(f"{kind!r} is not a zero-bubble kind", "use zb-h1 or zb-h2")


def batch_orders(replicas: Sequence[int], minibatches: Sequence[int], limit: Sequence[int],
                 costs: Costs | None = None, comm: Sequence[float] | None = None
                 ) -> dict[Rank, list[Action]]:
    """The F/B/W actions of one batch (``minibatches``, in order) for every rank, in the order
    the greedy list scheduler runs them (docs/design-notes.md); versions are stamped later.
    ``comm[s]``: seconds a message takes across the cut into stage s (activations forward,
    gradients back; ``comm[0]`` unused), so a W is not put where a message will arrive."""
    S = len(replicas)
    cost = list(costs) if costs is not None else [(1.0, 1.0, 1.0)] * S
    if len(cost) != S or any(len(c) != 3 or min(c) < 0 for c in cost):
        raise ConfigError(f"costs={list(cost)!r} needs one (F, B, W) >= 0 per stage",
                          "e.g. [(1.0, 1.0, 1.0)] * stages")
    wire = list(comm) if comm is not None else [0.0] * S
    if len(wire) != S or min(wire) < 0:
        raise ConfigError(f"comm={wire!r} needs one time >= 0 per stage (the cut into it)")
    ranks = [(s, j) for s, r in enumerate(replicas) for j in range(r)]
    todo_f = {rk: [k for k in minibatches if k % replicas[rk[0]] == rk[1]] for rk in ranks}
    done: dict[tuple[str, int, int], float] = {}  # (kind, stage, minibatch) -> end time
    waiting_b = {rk: [] for rk in ranks}  # F done, B not: oldest first
    waiting_w = {rk: [] for rk in ranks}  # B done, W not
    in_flight = {rk: 0 for rk in ranks}
    order: dict[Rank, list[Action]] = {rk: [] for rk in ranks}
    total = {rk: 3 * len(todo_f[rk]) for rk in ranks}
    # heap of (time, push number, rank); a rank with nothing ready waits behind the ranks due at
    # the same time, and once a whole round of them made no progress, until the next completion
    heap = [(0.0, i, rk) for i, rk in enumerate(ranks) if total[rk]]
    heapq.heapify(heap)
    pushes = len(heap)
    progress = 0
    stalled: dict[Rank, tuple[int, float]] = {rk: (-1, -1.0) for rk in ranks}
    # every completion and arrival time so far, as a heap: a stalled rank waits for the first
    # one after now (scanning ``done`` for it made scheduling quadratic in the batch)
    events: list[float] = []

    def dep(kind: str, s: int, k: int) -> tuple[str, int, int] | None:
        return (("F", s - 1, k) if s > 0 else None) if kind == "F" \
            else ("F", s, k) if s == S - 1 else ("B", s + 1, k)

    def arrival(key: tuple[str, int, int]) -> float:
        """When the message of dependency ``key`` reaches its consumer (inf: not scheduled)."""
        end = done.get(key, float("inf"))
        if key[0] == "F":  # an activation crosses into stage key[1] + 1
            return end + (wire[key[1] + 1] if key[1] + 1 < S else 0.0)
        return end + wire[key[1]] if key[0] == "B" else end  # a gradient into key[1] - 1

    def ready(kind: str, s: int, k: int, t: float) -> bool:
        key = dep(kind, s, k)
        return key is None or (key[1] == s and done.get(key, float("inf")) <= t) or \
            (key[1] != s and arrival(key) <= t)

    def arrives(kind: str, s: int, k: int, t: float) -> float:
        """When action ``kind`` of minibatch k on stage s can start, as far as is known: its
        dependency's arrival once that is scheduled, else never (a rank waiting on a dependency
        nobody has scheduled yet must not wait for it, or two ranks could wait on each other)."""
        key = dep(kind, s, k)
        if key is None:
            return t
        return done.get(key, float("inf")) if key[1] == s else arrival(key)

    def w_fits(rk: Rank, t: float) -> bool:
        """A W now delays no B and no F that could otherwise start before it ends."""
        s, end = rk[0], t + cost[rk[0]][2]
        nxt = ([todo_f[rk][0]] if todo_f[rk] and in_flight[rk] < limit[s] else [])
        return all(arrives("B", s, k, t) >= end for k in waiting_b[rk]) and \
            all(arrives("F", s, k, t) >= end for k in nxt)

    while heap:
        t, _, rk = heapq.heappop(heap)
        s = rk[0]
        pick: Action | None = None
        b_ready = [k for k in waiting_b[rk] if ready("B", s, k, t)]
        if b_ready:
            pick = Action("B", b_ready[0])
            waiting_b[rk].remove(pick.minibatch)
            waiting_w[rk].append(pick.minibatch)
        elif todo_f[rk] and in_flight[rk] < limit[s] and ready("F", s, todo_f[rk][0], t):
            pick = Action("F", todo_f[rk].pop(0))
            waiting_b[rk].append(pick.minibatch)
            in_flight[rk] += 1
        elif waiting_w[rk] and (w_fits(rk, t) or not (waiting_b[rk] or todo_f[rk])):
            # a W where it delays nothing else: F's and B's are the critical path
            pick = Action("W", waiting_w[rk].pop(0))
            in_flight[rk] -= 1
        if pick is None:
            # a rank due now that has not waited since the last progress may still make
            # something ready; otherwise only what completes (or arrives, or starts) later can
            stalled[rk] = (progress, t)
            while events and events[0] <= t:  # t never decreases: past events stay past
                heapq.heappop(events)
            later = events[:1] + [h[0] for h in heap if h[0] > t or stalled[h[2]] != (progress, t)]
            if not later:
                raise ConfigError(f"zero-bubble scheduling is stuck on stage {s} replica {rk[1]}",
                                  "every stage needs a memory limit of at least 1")
            heapq.heappush(heap, (min(later), pushes, rk))
            pushes += 1
            continue
        progress += 1
        dur = cost[s]["FBW".index(pick.kind)]
        done[(pick.kind, s, pick.minibatch)] = t + dur
        heapq.heappush(events, t + dur)  # a completion, and when its message arrives
        heapq.heappush(events, arrival((pick.kind, s, pick.minibatch)))
        order[rk].append(pick)
        if len(order[rk]) < total[rk]:
            heapq.heappush(heap, (t + dur, pushes, rk))
            pushes += 1
    return order


def batch_makespan(replicas: Sequence[int], orders: dict[Rank, list[Action]],
                   costs: Costs | None = None, comm: Sequence[float] | None = None) -> float:
    """When the last action of one batch's ``orders`` ends, each rank running its list in order
    and each action starting once its rank is free and its input has arrived: the cost model
    :func:`batch_orders` schedules by (inf if the orders deadlock)."""
    S = len(replicas)
    cost = list(costs) if costs is not None else [(1.0, 1.0, 1.0)] * S
    wire = list(comm) if comm is not None else [0.0] * S
    end: dict[tuple[str, int, int], float] = {}
    free = {rk: 0.0 for rk in orders}
    nxt = {rk: 0 for rk in orders}
    moved = True
    while moved:
        moved = False
        for rk, acts in orders.items():
            s = rk[0]
            while nxt[rk] < len(acts):
                a, k = acts[nxt[rk]], acts[nxt[rk]].minibatch
                if a.kind == "F":
                    need = ("F", s - 1, k, wire[s]) if s > 0 else None
                elif a.kind == "B":
                    need = ("F", s, k, 0.0) if s == S - 1 else ("B", s + 1, k, wire[s + 1])
                else:
                    need = ("B", s, k, 0.0)
                if need is not None and need[:3] not in end:
                    break
                start = max(free[rk], end[need[:3]] + need[3] if need is not None else 0.0)
                free[rk] = end[(a.kind, s, k)] = start + cost[s]["FBW".index(a.kind)]
                nxt[rk] += 1
                moved = True
    if any(nxt[rk] < len(acts) for rk, acts in orders.items()):
        return float("inf")
    return max(free.values(), default=0.0)


def one_f_one_b_orders(replicas: Sequence[int], minibatches: Sequence[int],
                       windows: Sequence[int]) -> dict[Rank, list[Action]]:
    """1F1B's order with every W right after its B: what ``1f1b-flush`` runs, split. It holds
    no more in flight than 1F1B, so it is a valid order for both zero-bubble kinds."""
    out: dict[Rank, list[Action]] = {}
    for s, r in enumerate(replicas):
        for j in range(r):
            acts = _one_f_one_b([k for k in minibatches if k % r == j], windows[s])
            out[(s, j)] = [x for a in acts
                           for x in ((a, Action("W", a.minibatch)) if a.kind == "B" else (a,))]
    return out


def best_batch_orders(kind: str, replicas: Sequence[int], minibatches: Sequence[int],
                      windows: Sequence[int], costs: Costs | None = None,
                      comm: Sequence[float] | None = None) -> dict[Rank, list[Action]]:
    """The orders of one batch for ``kind``: the greedy list scheduler's, unless an order that
    also fits ``kind``'s memory finishes the batch sooner under the same costs. The greedy is a
    heuristic: on unbalanced stages it can lose to plain 1F1B (37 of 1000 random 2-4 stage
    cases with costs in {0.5, 1, 2}, up to 12% slower), and zb-h2's larger windows can lose to
    zb-h1's. The candidates, in order of preference on a tie: the greedy with ``kind``'s limits,
    with zb-h1's (``windows``, 1F1B's), and 1F1B's order with W right after B. So a zero-bubble
    kind is never slower than ``1f1b-flush`` on the costs it was built for."""
    mbs = list(minibatches)
    cands = [batch_orders(replicas, mbs, limits(kind, windows), costs, comm)]
    if kind == "zb-h2":
        cands.append(batch_orders(replicas, mbs, limits("zb-h1", windows), costs, comm))
    cands.append(one_f_one_b_orders(replicas, mbs, windows))
    times = [batch_makespan(replicas, c, costs, comm) for c in cands]
    return cands[times.index(min(times))]
