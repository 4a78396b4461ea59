"""The memory cap held against the peak a run reaches, not only the rule between actions.

:func:`fit_peaks` walks plans through their schedule (:mod:`.memory_walk`): the chooser keeps
the fastest candidate whose walked peaks (``StagePlan.peak_bytes``) fit ``Cluster(memory=...)``;
where none does, a cheap search (the planner's optimum) finds the highest lower cap whose plan
fits, and the chooser runs once more there. The plan keeps the user's cap.
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
"""Lower caps the search tries before giving up."""

Keep = Callable[[Plan], bool]
"""Whether a candidate plan's walked peaks fit the cap: a chooser prefers the ones it keeps."""


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


def fit_peaks(choose: Callable[[Cluster, Keep | None], Plan], profile: Profile,
              cluster: Cluster, schedule: str, microbatches: int | None,
              temporaries: tuple[float, float],
              search: Callable[[Cluster], Plan] | None = None) -> Plan:
    """The plan ``choose(cluster, keep)`` makes, ``keep`` saying which candidates' walked peaks
    under ``schedule`` fit ``cluster.memory`` (a chooser of one plan may ignore it). Where the
    chosen plan does not fit, ``search`` (default ``choose`` itself; a cheaper chooser, such as
    the planner's optimum, for a chooser that simulates many candidates) is run for lower caps,
    from the cap minus the worst stage's excess over its rule, then by bisection,
    :data:`ROUNDS` plans at most, and ``choose`` once more at the highest lower cap whose plan
    fits (the solver's optimum only gets slower as its cap drops; the search's own plan where
    that choice keeps none). Raises
    :class:`InfeasiblePlanError` naming the stage and its peak when none fits."""
    cap = cluster.memory

    def walked(p: Plan) -> Plan:
        return with_peaks(p, profile, schedule, microbatches, temporaries)

    def keep(p: Plan) -> bool:
        return _fits(walked(p), cap or 0.0)

    if cap is None or schedule not in SHAPES:
        return walked(choose(cluster, None))
    try:
        plan = walked(choose(cluster, keep))
    except InfeasiblePlanError:  # every candidate fits the rule but peaks over the cap
        if search is None:
            raise
        plan = walked(search(cluster))
    if _fits(plan, cap):
        return plan
    found = _lower_cap(search or (lambda c: choose(c, keep)), walked, cluster, plan)
    if found is None:
        worst = max(plan.stages, key=lambda sp: sp.peak_bytes or 0.0)
        parts = _parts(plan, profile, schedule, microbatches, temporaries, worst.index)
        raise InfeasiblePlanError(
            f"stage {worst.index} peaks at {format_bytes(worst.peak_bytes or 0.0)} per worker "
            f"under {schedule} ({parts}; "
            f"its rule's {format_bytes(worst.memory_bytes)} between actions), over the "
            f"cluster's {format_bytes(cap)}, and no plan for a lower cap fits",
            "use more workers, recompute='auto', a flushing schedule that holds less "
            "(schedule='1f1b-flush'), or a larger memory")
    lowered, best = found
    if search is not None:  # the full choice once, at the cap the search found
        try:
            again = walked(_with_cap(choose(_capped(cluster, lowered), keep), cap))
        except InfeasiblePlanError as err:
            log.info("no candidate for %s fits: %s", format_bytes(lowered), err)
        else:
            if _fits(again, cap):
                return again
    return best


def _lower_cap(search: Callable[[Cluster], Plan], walked: Callable[[Plan], Plan],
               cluster: Cluster, plan: Plan) -> tuple[float, Plan] | None:
    """The highest cap below ``cluster.memory`` found whose ``search`` plan's walked peaks fit
    it, and that plan (with the user's cap); None when none of :data:`ROUNDS` tries does.
    ``plan``: the plan over the cap, whose excess guides the first try."""
    cap = cluster.memory or 0.0
    lo, hi = 0.0, cap  # caps for the rule: at hi a stage peaks over, at lo nothing better
    best: tuple[float, Plan] | None = None
    guess = cap - _excess(plan, cap)
    for _ in range(ROUNDS):
        lowered = guess if lo < guess < hi else (lo + hi) / 2
        log.info("walked peak over the cap %s: planning for %s", format_bytes(cap),
                 format_bytes(lowered))
        try:
            again = search(_capped(cluster, lowered))
        except InfeasiblePlanError:  # nothing fits the rule this low: look higher
            lo, guess = lowered, (lowered + hi) / 2
            continue
        again = walked(_with_cap(again, cap))
        if _fits(again, cap):  # a plan: keep it, and look for a faster one higher up
            best, lo, guess = (lowered, again), lowered, (lowered + hi) / 2
        else:
            hi, guess = lowered, lowered - _excess(again, cap)
    return best


def _capped(cluster: Cluster, memory: float) -> Cluster:
    return Cluster.from_dict({**cluster.to_dict(), "memory": memory})


def _with_cap(plan: Plan, cap: float) -> Plan:
    return replace(plan, cluster={**plan.cluster, "memory": cap})


def _parts(plan: Plan, profile: Profile, schedule: str, microbatches: int | None,
           temporaries: tuple[float, float], stage: int) -> str:
    """What stage ``stage``'s walked peak is made of, in words."""
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
