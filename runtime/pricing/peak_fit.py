"""The memory cap held against the peak a run reaches, not only the rule between actions.

:func:`fit_peaks` walks the chosen plan through its schedule (:mod:`.memory_walk`)
and, where a stage peaks over ``Cluster(memory=...)``, plans again for lower caps, keeping the
fastest plan whose walked peaks (``StagePlan.peak_bytes``) fit; the plan keeps the user's cap.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace

from fxpipe.costmodel.hardware import Cluster
from fxpipe.costmodel.profile import Profile
from fxpipe.errors import InfeasiblePlanError
from fxpipe.passes.plan import Plan
from fxpipe.units import format_bytes

from .memory import SHAPES
from .memory_walk import walk_memory

log = logging.getLogger(__name__)

ROUNDS = 6
"""Plans tried for lower caps before giving up."""


def with_peaks(plan: Plan, profile: Profile, schedule: str, microbatches: int | None,
               temporaries: tuple[float, float]) -> Plan:
    """``plan`` with each stage's walked peak under ``schedule`` (unchanged where the schedule
    is not walked: the placed kinds, ``auto``)."""
    if schedule not in SHAPES:
        return plan
    peaks = walk_memory(plan, profile, schedule, microbatches=microbatches,
                        temporaries=temporaries)
    return replace(plan, stages=tuple(replace(sp, peak_bytes=p.peak)
                                      for sp, p in zip(plan.stages, peaks)))


def fit_peaks(choose: Callable[[Cluster], Plan], profile: Profile, cluster: Cluster,
              schedule: str, microbatches: int | None,
              temporaries: tuple[float, float]) -> Plan:
    """The plan ``choose(cluster)`` makes where every stage's walked peak under ``schedule``
    fits ``cluster.memory``; else the plan ``choose`` makes for the highest lower cap found
    whose peaks fit (the solver's optimum only gets slower as its cap drops), searched from
    the cap minus the worst stage's excess over its rule, then by bisection, :data:`ROUNDS`
    plans at most. Raises :class:`InfeasiblePlanError` naming the stage and its peak when
    none fits."""
    plan = with_peaks(choose(cluster), profile, schedule, microbatches, temporaries)
    cap = cluster.memory
    if cap is None or plan.stages[0].peak_bytes is None or _fits(plan, cap):
        return plan
    lo, hi = 0.0, cap  # caps for the rule: at hi a stage peaks over, at lo nothing better
    best: Plan | None = None
    guess = cap - _excess(plan, cap)
    for _ in range(ROUNDS):
        lowered = guess if lo < guess < hi else (lo + hi) / 2
        log.info("walked peak over the cap %s: planning for %s", format_bytes(cap),
                 format_bytes(lowered))
        try:
            again = choose(Cluster.from_dict({**cluster.to_dict(), "memory": lowered}))
        except InfeasiblePlanError:  # nothing fits the rule this low: look higher
            lo, guess = lowered, (lowered + hi) / 2
            continue
        again = with_peaks(replace(again, cluster={**again.cluster, "memory": cap}), profile,
                           schedule, microbatches, temporaries)
        if _fits(again, cap):  # a plan: keep it, and look for a faster one higher up
            best, lo, guess = again, lowered, (lowered + hi) / 2
        else:
            plan, hi, guess = again, lowered, lowered - _excess(again, cap)
    if best is not None:
        return best
    worst = max(plan.stages, key=lambda sp: sp.peak_bytes or 0.0)
    parts = _parts(plan, profile, schedule, microbatches, temporaries, worst.index)
    raise InfeasiblePlanError(
        f"stage {worst.index} peaks at {format_bytes(worst.peak_bytes or 0.0)} per worker "
        f"under {schedule} ({parts}; "
        f"its rule's {format_bytes(worst.memory_bytes)} between actions), over the "
        f"cluster's {format_bytes(cap)}, and no plan for a lower cap fits",
        "use more workers, recompute='auto', a flushing schedule that holds less "
        "(schedule='1f1b-flush'), or a larger memory")


def _parts(plan: Plan, profile: Profile, schedule: str, microbatches: int | None,
           temporaries: tuple[float, float], stage: int) -> str:
    """What stage ``stage``'s walked peak is made of, in words."""
    from fxpipe.runtime.pricing.memory_walk import walk_memory

    parts = walk_memory(plan, profile, schedule, microbatches=microbatches,
                        temporaries=temporaries)[stage].parts
    words = {"base": "state and versions", "held": "activations held",
             "working": "the action's working set", "received": "receive buffers posted",
             "sent": "sends not yet proven received"}
    return ", ".join(f"{words[k]} {format_bytes(v)}" for k, v in parts.items() if v)


def _fits(plan: Plan, cap: float) -> bool:
    return all((sp.peak_bytes or 0.0) <= cap for sp in plan.stages)


def _excess(plan: Plan, cap: float) -> float:
    """The most any stage over ``cap`` peaks above its rule's memory."""
    return max((sp.peak_bytes or 0.0) - sp.memory_bytes for sp in plan.stages
               if (sp.peak_bytes or 0.0) > cap)
