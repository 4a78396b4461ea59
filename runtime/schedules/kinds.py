"""The schedule kinds: ``make_schedule`` and the generators behind it. Pure Python.

Turns a kind, a replica vector and a number of minibatches into validated per-rank action lists:
PipeDream's 1F1B, 2BW, 1F1B-flush, GPipe, and zero-bubble kinds (W placed by :mod:`.zerobubble`).
"""
from __future__ import annotations

import math
from typing import Sequence

from fxpipe.errors import ConfigError

from . import zerobubble
from .schedule import (SCHEDULE_KINDS, Action, Rank, Schedule, ScheduleError, _one_f_one_b,
                       _with_versions, validate)


def _windows(replicas: list[int], noam: int | None) -> tuple[int, tuple[int, ...]]:
    """In-flight minibatches per replica of each stage: ceil(workers from s on / r_s) (PipeDream).

    With an explicit ``noam`` the input stage admits that many and stage s keeps what is left
    after the workers upstream of it hold theirs (at least 1, at most the default).
    """
    suffix = [sum(replicas[s:]) for s in range(len(replicas))]
    default = [math.ceil(suffix[s] / r) for s, r in enumerate(replicas)]
    if noam is None:
        return default[0], tuple(default)
    wins = [noam] + [max(1, min(default[s], math.ceil((noam * replicas[0] - (suffix[0] - suffix[s]))
                                                      / replicas[s])))
                     for s in range(1, len(replicas))]
    return noam, tuple(wins)


def _insert_updates(acts: list[Action], group_of: dict[int, int], groups: int) -> list[Action]:
    """Put update g right after the rank's last backward of a group <= g (before its first
    backward when it has none), so a replica idle in a group still joins that all-reduce."""
    b_pos = [i for i, a in enumerate(acts) if a.kind == "B"]
    b_grp = [group_of[acts[i].minibatch] for i in b_pos]
    after: dict[int, list[int]] = {}
    n_le = 0  # B's come in increasing minibatch order, so b_grp is sorted: one sweep (linear)
    for g in range(groups):
        while n_le < len(b_grp) and b_grp[n_le] <= g:
            n_le += 1
        pos = b_pos[n_le - 1] + 1 if n_le else (b_pos[0] if b_pos else len(acts))
        after.setdefault(pos, []).append(g)
    out: list[Action] = []
    for i in range(len(acts) + 1):
        out.extend(Action("U", g) for g in after.get(i, []))
        if i < len(acts):
            out.append(acts[i])
    return out


def make_schedule(kind: str, replicas: list[int], num_minibatches: int, *,
                  noam: int | None = None, microbatches: int | None = None,
                  costs: Sequence[tuple[float, float, float]] | None = None,
                  comm: Sequence[float] | None = None) -> Schedule:
    """Generate the schedule of ``kind`` (one of SCHEDULE_KINDS) and validate it.

    ``microbatches`` (m) is the number of minibatches per weight update for the batched kinds
    (default: the total number of workers, the smallest batch that fills the pipeline); pipedream
    updates after every backward round. ``noam`` overrides the input stage's admission window.
    ``costs``: per stage (F, B, W) seconds and ``comm`` per cut (into stage s) seconds, which the
    zero-bubble kinds' greedy scheduler places W's by (:mod:`fxpipe.runtime.schedules.zerobubble`;
    default: equal unit costs, no communication).
    """
    if kind not in SCHEDULE_KINDS:
        raise ConfigError(f"unknown schedule kind {kind!r}", f"use one of {SCHEDULE_KINDS}")
    if not replicas or any(not isinstance(r, int) or r < 1 for r in replicas):
        raise ConfigError(f"bad replica vector {replicas!r}", "give one count >= 1 per stage")
    if num_minibatches < 0:
        raise ConfigError(f"num_minibatches={num_minibatches} is negative", "use 0 or more")
    if noam is not None and (noam < 1 or kind == "gpipe"):
        raise ConfigError(f"noam={noam} with kind {kind!r}",
                          "noam must be >= 1 and does not apply to gpipe")
    if kind == "pipedream" and microbatches not in (None, 1):
        raise ConfigError(f"microbatches={microbatches} with pipedream",
                          "pipedream updates after every minibatch; use 2bw or 1f1b-flush")
    m = microbatches if microbatches is not None else sum(replicas)
    if m < 1:
        raise ConfigError(f"microbatches={m}", "use at least 1 microbatch per batch")
    noam_, wins = _windows(replicas, noam)
    n = num_minibatches
    zb: list[dict[Rank, list[Action]]] = []
    if kind.startswith("zb-"):
        zb = [zerobubble.best_batch_orders(kind, replicas, range(b * m, min(n, (b + 1) * m)),
                                           wins, costs, comm) for b in range(math.ceil(n / m))]
        wins = zerobubble.limits(kind, wins)
    acts: dict[Rank, tuple[Action, ...]] = {}
    for s, r in enumerate(replicas):
        for j in range(r):
            mine = [k for k in range(j, n, r)]
            if kind in ("pipedream", "2bw"):
                size = r if kind == "pipedream" else m
                groups = math.ceil(n / size)
                body = _insert_updates(_one_f_one_b(mine, wins[s]),
                                       {k: k // size for k in mine}, groups)
                if kind == "pipedream":
                    acts[(s, j)] = _with_versions(body, lambda k, u: u)
                else:
                    acts[(s, j)] = _with_versions(body, lambda k, u: max(0, k // m - 1))
            else:
                body = []
                by_batch: dict[int, list[int]] = {}  # one pass over mine (not one per batch)
                for k in mine:
                    by_batch.setdefault(k // m, []).append(k)
                for b in range(math.ceil(n / m)):
                    batch = by_batch.get(b, [])
                    if kind == "gpipe":
                        body += [Action("F", k) for k in batch] + [Action("B", k) for k in batch]
                    elif zb:
                        body += zb[b][(s, j)]
                    else:
                        body += _one_f_one_b(batch, wins[s])
                    body.append(Action("U", b))
                acts[(s, j)] = _with_versions(body, lambda k, u: u)
    sched = Schedule(kind, tuple(replicas), n, acts, 1 if kind == "pipedream" else m, noam_, wins)
    try:
        validate(sched)
    except ScheduleError as err:
        raise ConfigError(f"{kind} cannot run replicas={replicas} with m={m}, noam={noam}: "
                          f"{err.message}", f"2bw needs microbatches >= the number of workers "
                          f"({sum(replicas)}) to keep two weight versions") from err
    return sched
