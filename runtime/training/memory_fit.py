"""Refuse, before any process starts, a schedule whose memory the plan does not fit.

A plan is fitted to ``Cluster(memory=...)`` for one schedule; the one the Trainer runs may hold
more (``gpipe``, ``zb-h2``, ``2bw``). Priced on its own simulated actions, so an out-of-memory
run is an error naming the stage and the bytes, and auto drops candidates that do not fit."""
from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from fxpipe.costmodel.profile import Profile
from fxpipe.errors import ConfigError
from fxpipe.passes.plan import Plan
from fxpipe.units import format_bytes

from ..errors import RuntimeConfigError
from ..pricing.memory import SHAPES, schedule_memory
from ..pricing.memory_walk import walk_memory
from ..pricing.plansim import simulate_plan
from ..schedules.placement import PLACED_KINDS
from ..schedules.spec import AUTO, parse_schedule

log = logging.getLogger(__name__)


def check_schedule_memory(plan: Any, profile: Any, schedule: str, microbatches: int | None,
                          split: int | None, temporaries: tuple[float, float] = (0.0, 0.0)
                          ) -> tuple[float, ...]:
    """Per stage, the bytes a replica holds under ``schedule`` (empty where it is not priced:
    ``auto``, whose candidates are priced by its own decision, and the placed kinds); raises
    :class:`RuntimeConfigError` where a stage needs more than the plan's cluster memory.
    ``split``: microbatches each loader minibatch is cut into (each holds its share of the
    profiled minibatch's activations). Under a cap, what is held against it is what the
    planner fitted (``fxpipe.runtime.pricing.peak_fit``): the larger of the schedule's rule and
    its peak walked through the actions (:func:`~fxpipe.runtime.pricing.memory_walk.walk_memory`, the
    optimizer step's ``temporaries`` included)."""
    spec = parse_schedule(schedule)
    if spec.kind == AUTO or spec.kind in PLACED_KINDS:
        return ()
    k = split if split and split > 1 else microbatches
    S = len(plan.stages)
    try:
        sim = simulate_plan(plan, profile, schedule=spec.kind, microbatches=k,
                            minibatches=max(4 * S, 2 * (k or S)))
    except ConfigError:  # a combination the Trainer refuses with its own message
        return ()
    scale = 1.0 / split if split and split > 1 else 1.0
    memory = schedule_memory(plan.stages, spec.kind, sim.in_flight, scale)
    cap = plan.cluster.get("memory")
    if cap is not None and profile is not None:
        peaks = walk_memory(plan, profile, spec.kind, microbatches=k, temporaries=temporaries,
                            scale=scale)
        memory = tuple(max(b, p.peak) for b, p in zip(memory, peaks))
    over = [(s, b) for s, b in enumerate(memory) if cap is not None and b > cap]
    if over:
        s, need = max(over, key=lambda x: x[1])
        held = sim.in_flight[s]
        sp = plan.stages[s]
        fitted = max(sp.memory_bytes, sp.peak_bytes or 0.0)
        raise RuntimeConfigError(
            f"schedule {schedule!r} needs {format_bytes(need)} per worker on stage {s} at its "
            f"peak ({held} minibatches' activations held at once"
            + (f", microbatches={k}" if k else "") + f"), the cluster has {format_bytes(cap)} "
            f"per worker (the plan fits {format_bytes(fitted)} as "
            f"{plan.memory_rule.label()} holds it)",
            "use fewer microbatches per update, the schedule the plan was made for, "
            "schedule='1f1b-flush' (it holds at most one set per stage after it), or compile "
            "for this schedule (fxpipe.compile(..., schedule=...)), with recompute='auto' or "
            "more workers")
    log.debug("memory per stage under %s: %s", schedule,
              ", ".join(format_bytes(b) for b in memory))
    return memory


def fitting_candidates(plan: Any, profile: Any, candidates: Sequence[str],
                       microbatches: int | None, split: int | None,
                       temporaries: tuple[float, float] = (0.0, 0.0)) -> tuple[str, ...]:
    """``auto``'s candidates whose memory the plan fits (a plan made for ``1f1b-flush`` under a
    cap may not fit ``pipedream``'s stashed versions): the others are dropped, with a log line,
    before any pilot runs; when the baseline (``1f1b-flush``) does not fit, or nothing does, its
    refusal is raised (naming the stage and the bytes), not auto's "needs the baseline"."""
    if plan.cluster.get("memory") is None:  # no cap: every candidate fits
        return tuple(candidates)
    kept, dropped = [], []
    for c in candidates:
        try:
            check_schedule_memory(plan, profile, c, microbatches, split, temporaries)
            kept.append(c)
        except RuntimeConfigError as err:
            dropped.append((c, err))
    if dropped:
        log.info("auto: candidates %s do not fit the plan's memory (%s); choosing among %s",
                 [c for c, _ in dropped], dropped[0][1].message, kept)
    refused = dict(dropped)
    if "1f1b-flush" in refused:  # auto's baseline: without it there is nothing to compare with
        raise refused["1f1b-flush"]
    if not kept:
        raise dropped[0][1]
    return tuple(kept)


def walked_peaks(plan: Plan, profile: Profile | None, kind: str, microbatches: int | None,
                 split: int | None, temporaries: tuple[float, float]) -> tuple[Any, ...] | None:
    """Per stage, the peak walked through schedule ``kind``
    (:func:`fxpipe.runtime.pricing.memory_walk.walk_memory`) with ``microbatches`` per update,
    each minibatch cut into ``split`` parts (None or 1: whole) and the optimizer step's
    ``temporaries``; None where it is not walked: no profile, or a kind without a memory rule
    (``auto``, whose pick may change, the placed kinds), as
    ``fxpipe.runtime.pricing.peak_fit`` does not walk them."""
    if profile is None or kind not in SHAPES:  # e.g. auto, the placed kinds
        return None
    split = split if split and split > 1 else None
    try:
        return walk_memory(plan, profile, kind, microbatches=split or microbatches,
                           temporaries=temporaries, scale=1.0 / split if split else 1.0)
    except ConfigError:  # a combination the Trainer refuses with its own message
        return None
