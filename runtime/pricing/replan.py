"""Re-planning from measured stage times: the decision, as pure numbers.

Rescales the profile stage by stage to the measurements, re-solves, and proposes the new plan when
predicted faster by a threshold; :mod:`fxpipe.runtime.training.trainer_switch` applies it.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any, Sequence

from fxpipe.costmodel import Cluster, Profile
from fxpipe.costmodel.overheads import with_overheads
from fxpipe.errors import ConfigError
from fxpipe.passes import Plan
from fxpipe.passes.partition import partition, plan_for

from ..timeline import TimelineEvent
from .memory import held_parameters

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StageTimes:
    """Measured seconds of one stage replica: forward and backward per minibatch, optimizer step
    per update."""

    forward_s: float
    backward_s: float
    update_s: float


@dataclass(frozen=True)
class Proposal:
    """What re-planning found: the current partition and the re-solved one, both costed on the
    rescaled profile; ``gain`` = current / proposed time per minibatch - 1; ``adopt`` when the
    gain exceeds the threshold."""

    current: Plan
    proposed: Plan
    gain: float
    adopt: bool
    factors: tuple[tuple[float, float, float], ...]  # per stage: forward, backward, update
    profile: Profile | None = None  # the rescaled profile both plans are costed on

    def summary(self) -> str:
        return (f"re-plan: replicas {self.current.replicas} -> {self.proposed.replicas}, "
                f"predicted {self.current.time_per_minibatch * 1e3:.3g} -> "
                f"{self.proposed.time_per_minibatch * 1e3:.3g} ms per minibatch "
                f"({self.gain:+.1%}); {'adopt' if self.adopt else 'keep the current plan'}")


def measure(events: Sequence[TimelineEvent]) -> StageTimes:
    """One rank's times from its timeline: mean forward and backward span per minibatch, mean
    optimizer time per update (all of an update's spans, grouped by ``args["update"]``)."""
    def per(category: str, key: str) -> float:
        sums: dict[object, float] = {}
        for e in events:
            if e.category == category:
                k = e.args.get(key, e.name)
                sums[k] = sums.get(k, 0.0) + e.duration
        return sum(sums.values()) / len(sums) if sums else 0.0
    return StageTimes(per("forward", "minibatch"), per("backward", "minibatch"),
                      per("optimizer", "update"))


def after_first_update(events: Sequence[TimelineEvent]) -> list[TimelineEvent]:
    """The events after this rank's first update has finished: a trainer's first segment
    pays one-time costs in its first update (first-use allocations, the lazy set-up of every
    peer-to-peer connection): on the emulated cluster (bench/replan.py) the first two backward
    passes took 60-90 ms against 10-15 ms later, and a profile rescaled to that segment
    predicted +67% (planner) and +117% (simulated) of the measured time. All events when
    nothing of a later update was recorded (a segment of one update)."""
    ups = [e for e in events if e.category == "optimizer"]
    if not ups:
        return list(events)
    first = min(e.args.get("update", 0) for e in ups)
    end = max(e.end for e in ups if e.args.get("update", 0) == first)
    rest = [e for e in events if e.start >= end]
    return rest if any(e.category in ("forward", "backward") for e in rest) else list(events)


def stage_starts(profile: Profile, plan: Plan) -> list[int]:
    """Index in ``profile`` of each stage's first node."""
    index = {n: i for i, n in enumerate(profile.names)}
    try:
        return [min(index[n] for n in st.nodes) for st in plan.stages]
    except (KeyError, ValueError) as err:
        raise ConfigError("the plan names nodes the profile does not have",
                          "pass the profile the plan was made from") from err


def rescale(profile: Profile, plan: Plan, measured: Sequence[StageTimes], *,
            ties_measured: bool = False
            ) -> tuple[Profile, tuple[tuple[float, float, float], ...]]:
    """``profile`` with each stage's node costs multiplied so that the stage's predicted forward,
    backward and update equal the measured ones (a stage with no predicted cost of a kind keeps
    it); returns the per-stage factors too. The runtime's overheads left to price are those
    measured stage times do not hold (``Overheads.in_measured_stages``; ``ties_measured``: the
    updates measured hold the tied all-reduces, as the reference executor's do)."""
    if len(measured) != len(plan.stages):
        raise ConfigError(f"{len(measured)} stage measurements for a plan of "
                          f"{len(plan.stages)} stages", "measure every stage")
    stage_of = plan.stage_of()
    by_stage: list[list[int]] = [[] for _ in plan.stages]
    for i, nd in enumerate(profile.nodes):
        if nd.name not in stage_of:
            raise ConfigError(f"profile node {nd.name!r} is in no stage of the plan",
                              "pass the profile the plan was made from")
        by_stage[stage_of[nd.name]].append(i)
    factors = []
    for s, m in enumerate(measured):
        nodes = [profile.nodes[i] for i in by_stage[s]]
        f = []
        for attr, got in (("forward_s", m.forward_s), ("backward_s", m.backward_s),
                          ("update_s", m.update_s)):
            want = sum(getattr(nd, attr) for nd in nodes)
            f.append(got / want if want > 0 and got > 0 else 1.0)
        factors.append((f[0], f[1], f[2]))
    nodes = list(profile.nodes)
    for s, idx in enumerate(by_stage):
        ff, fb, fu = factors[s]
        for i in idx:
            nd = nodes[i]
            nodes[i] = replace(nd, forward_s=nd.forward_s * ff, backward_s=nd.backward_s * fb,
                               update_s=nd.update_s * fu)
    # measured forward, backward and update already hold the replica's calls and the stash's
    # copy: of the runtime's overheads only the messages are still missing
    ov = profile.overheads
    meta = (profile.meta if ov.zero
            else with_overheads(profile.meta, ov.in_measured_stages(ties=ties_measured)))
    return replace(profile, nodes=tuple(nodes), meta=meta), tuple(factors)


def mean_times(times: Sequence[StageTimes]) -> StageTimes:
    """The mean of several measurements of a stage (its replicas, or segments), kind by kind."""
    return StageTimes(*(sum(getattr(t, f) for t in times) / len(times)
                        for f in ("forward_s", "backward_s", "update_s")))


def reprice(profile: Profile, plan: Plan, measured: Sequence[StageTimes], cluster: Cluster, *,
            sync: str = "allreduce", ties_measured: bool = False
            ) -> tuple[Profile, tuple[tuple[float, float, float], ...], Plan]:
    """``profile`` rescaled to ``measured`` (:func:`rescale`), its factors, and ``plan``'s own
    partition costed on it, memory priced as the plan's was (:func:`memory_terms`)."""
    scaled, factors = rescale(profile, plan, measured, ties_measured=ties_measured)
    current = plan_for(scaled, cluster, stage_starts(profile, plan), plan.replicas, sync=sync,
                       **memory_terms(plan))
    return scaled, tuple(factors), current


def memory_terms(plan: Plan) -> dict[str, Any]:
    """What a re-plan must price memory with to keep ``plan``'s: its schedule's rule and its
    state per parameter byte (``state = P (2 + opt)``, recovered from a stage that records it;
    SGD with momentum's 1 for plans saved before)."""
    opt = next((sp.state_bytes / held_parameters(sp) - 2.0 for sp in plan.stages
                if sp.state_bytes is not None and sp.parameter_bytes > 0), 1.0)
    return {"memory_rule": plan.memory_rule, "optimizer_state_factor": max(opt, 0.0)}


def use_all_workers(profile: Profile, cluster: Cluster, plan: Plan, workers: int, *,
                    sync: str = "allreduce") -> Plan:
    """``plan`` on exactly ``workers`` workers: when the solver used fewer (more replicas did not
    pay), the spare workers join the one stage where they cost least (each stage tried, costed
    with :func:`plan_for`), because a running job cannot hand processes back."""
    spare = workers - sum(plan.replicas)
    if spare <= 0:
        return plan
    starts = stage_starts(profile, plan)
    options = [plan_for(profile, cluster, starts, [r + spare * (i == s) for i, r in
                                                   enumerate(plan.replicas)], sync=sync,
                        **memory_terms(plan))
               for s in range(len(plan.replicas))]
    return min(options, key=lambda p: p.time_per_minibatch)


def propose(profile: Profile, plan: Plan, measured: Sequence[StageTimes], cluster: Cluster, *,
            threshold: float = 0.05, sync: str = "allreduce",
            workers: int | None = None) -> Proposal:
    """Rescale ``profile`` to ``measured`` (one :class:`StageTimes` per stage, e.g. the mean of
    :func:`measure` over its replicas), cost the current partition and re-solve on it.
    ``workers``: re-solve for exactly that many workers (a running job's; see
    docs/design-notes.md)."""
    if not threshold >= 0:
        raise ConfigError(f"threshold={threshold!r}", "a non-negative fraction, e.g. 0.05")
    if workers is not None:
        cluster = Cluster.from_dict({**cluster.to_dict(), "workers": workers,
                                     "workers_per_machine": 1 if workers % max(
                                         cluster.workers_per_machine, 1) else
                                     cluster.workers_per_machine})
    scaled, factors, current = reprice(profile, plan, measured, cluster, sync=sync)
    # the re-plan fits memory as the running plan was fitted
    proposed = partition(scaled, cluster, sync=sync, **memory_terms(plan))
    if workers is not None:
        proposed = use_all_workers(scaled, cluster, proposed, workers, sync=sync)
    gain = current.time_per_minibatch / proposed.time_per_minibatch - 1.0
    moved = (stage_starts(scaled, proposed), proposed.replicas) != (
        stage_starts(profile, plan), plan.replicas)
    adopt = moved and gain > threshold
    out = Proposal(current, proposed, gain, adopt, factors, scaled)
    log.info("%s", out.summary())
    return out
