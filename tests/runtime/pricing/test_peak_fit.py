"""runtime/pricing/peak_fit.py: the cap held against the walked peak. A hand-made chain whose rule fits a
cap its walked peak does not: re-planned for a lower cap until every peak fits, the user's cap
kept on the plan, and a clear error naming the stage where no lower cap helps."""
from __future__ import annotations

import pytest

from fxpipe.costmodel.hardware import Cluster
from fxpipe.costmodel.profile import Profile, ProfileNode
from fxpipe.errors import InfeasiblePlanError
from fxpipe.passes import partition
from fxpipe.passes.plan import Plan
from fxpipe.runtime.pricing.peak_fit import fit_peaks, with_peaks
from fxpipe.runtime.pricing.memory import memory_rule
from fxpipe.runtime.pricing.memory_walk import walk_memory

KIND, M = "1f1b-flush", 2
RULE = memory_rule(KIND, M)


def chain(n: int = 8) -> Profile:
    """n nodes of 1 ms forward, 2 ms backward, 100 B of weights; the first two fat (800 B out,
    the rest 100 B): the balanced 4-stage cut puts both on stage 0, whose peak (their sets, the
    gradient buffers posted ahead, the working set) is twice its rule's."""
    return Profile(nodes=tuple(
        ProfileNode(name=f"n{i}", op="call_module", target="m", forward_s=1e-3, backward_s=2e-3,
                    activation_bytes=800.0 if i < 2 else 100.0, parameter_bytes=100.0,
                    inputs=(f"n{i - 1}",) if i else ()) for i in range(n)), batch_size=4)


def choose(prof: Profile, calls: list[float | None], workers: int = 4):  # noqa: ANN201
    """The planner for 4 straight stages (1 for one worker), recording each cap it is given;
    one plan, so it ignores which candidates fit."""
    def plan(c: Cluster, keep: object = None) -> Plan:
        calls.append(c.memory)
        return partition(prof, c, memory_rule=RULE, stages=min(workers, 4), straight=True)
    return plan


def test_no_cap_records_the_peaks() -> None:
    prof, calls = chain(), []
    plan = fit_peaks(choose(prof, calls), prof, Cluster(workers=4, bandwidth=1e9), KIND, M,
                     (0.0, 0.0))
    assert calls == [None]
    want = walk_memory(plan, prof, KIND, microbatches=M)
    assert [sp.peak_bytes for sp in plan.stages] == [p.peak for p in want]
    assert "peak" in plan.summary().splitlines()[0]


def test_a_cap_between_rule_and_peak_is_planned_again_for_a_lower_cap() -> None:
    prof = chain()
    free = with_peaks(choose(prof, [])(Cluster(workers=4, bandwidth=1e9)), prof, KIND, M,
                      (0.0, 0.0))
    assert [len(sp.nodes) for sp in free.stages] == [2, 2, 2, 2]
    rule, peak = (max(sp.memory_bytes for sp in free.stages),
                  max(sp.peak_bytes or 0.0 for sp in free.stages))
    assert rule < peak
    cap = rule + 0.7 * (peak - rule)  # the planner's plan fits it by its rule, not at its peak
    calls: list[float | None] = []
    plan = fit_peaks(choose(prof, calls), prof, Cluster(workers=4, bandwidth=1e9, memory=cap),
                     KIND, M, (0.0, 0.0))
    assert calls[0] == cap and len(calls) >= 2 and all(c < cap for c in calls[1:])
    assert all((sp.peak_bytes or 0.0) <= cap for sp in plan.stages)
    assert [len(sp.nodes) for sp in plan.stages][0] == 1  # the fat nodes apart
    assert plan.cluster["memory"] == cap  # the user's cap, not the lowered one
    # the peaks are what the walk says for that plan
    assert [sp.peak_bytes for sp in plan.stages] == \
        [p.peak for p in walk_memory(plan, prof, KIND, microbatches=M)]


def test_no_plan_fits_the_peak_is_a_clear_error() -> None:
    prof = chain()
    one = with_peaks(choose(prof, [], 1)(Cluster(workers=1, bandwidth=1e9)), prof, KIND, M,
                     (0.0, 0.0))
    cap = (one.stages[0].memory_bytes + one.stages[0].peak_bytes) / 2  # one worker: no choice
    with pytest.raises(InfeasiblePlanError, match=r"stage 0 peaks at .* under 1f1b-flush .* over "
                       r"the cluster's") as ei:
        fit_peaks(choose(prof, [], 1), prof, Cluster(workers=1, bandwidth=1e9, memory=cap), KIND,
                  M, (0.0, 0.0))
    assert "schedule='1f1b-flush'" in (ei.value.hint or "")


def test_optimizer_temporaries_count_against_the_cap() -> None:
    # temporaries of 3 P: the same cap that fits without them does not with them
    prof = chain()
    plain = fit_peaks(choose(prof, []), prof, Cluster(workers=4, bandwidth=1e9), KIND, M,
                      (0.0, 0.0))
    heavy = fit_peaks(choose(prof, []), prof, Cluster(workers=4, bandwidth=1e9), KIND, M,
                      (3.0, 0.0))
    assert all(h.peak_bytes >= p.peak_bytes for h, p in zip(heavy.stages, plain.stages))


def _over_and_fitting(prof: Profile, cap: float) -> tuple[Plan, Plan]:
    """The balanced 4-stage plan, which peaks over ``cap``, and the plan with the fat nodes
    apart, which fits it (what planning again for a lower cap finds)."""
    free = choose(prof, [])(Cluster(workers=4, bandwidth=1e9))
    apart = fit_peaks(choose(prof, []), prof, Cluster(workers=4, bandwidth=1e9, memory=cap),
                      KIND, M, (0.0, 0.0))
    assert len(free.stages[0].nodes) == 2 and len(apart.stages[0].nodes) == 1
    return free, apart


def _cap_between(prof: Profile) -> float:
    free = with_peaks(choose(prof, [])(Cluster(workers=4, bandwidth=1e9)), prof, KIND, M,
                      (0.0, 0.0))
    rule = max(sp.memory_bytes for sp in free.stages)
    peak = max(sp.peak_bytes or 0.0 for sp in free.stages)
    return rule + 0.7 * (peak - rule)


def test_a_chooser_keeping_the_candidates_that_fit_is_run_once() -> None:
    # a chooser of several candidates (as the choice by simulation) takes the fastest one whose
    # walked peaks fit: no planning for lower caps
    prof = chain()
    cap = _cap_between(prof)
    cluster = Cluster(workers=4, bandwidth=1e9, memory=cap)
    over, fits = _over_and_fitting(prof, cap)
    calls: list[float | None] = []

    def candidates(c: Cluster, keep) -> Plan:  # noqa: ANN001
        calls.append(c.memory)
        return next(p for p in (over, fits) if keep is None or keep(p))

    plan = fit_peaks(candidates, prof, cluster, KIND, M, (0.0, 0.0),
                     search=lambda c: pytest.fail("no search needed"))
    assert calls == [cap]
    assert [sp.nodes for sp in plan.stages] == [sp.nodes for sp in fits.stages]
    assert all((sp.peak_bytes or 0.0) <= cap for sp in plan.stages)


def test_the_search_finds_the_lower_cap_and_the_choice_runs_once_more_there() -> None:
    # no candidate at the user's cap fits its peaks: the cheap search bisects the caps, the
    # (expensive) choice runs only at the user's cap and at the one the search found
    prof = chain()
    cap = _cap_between(prof)
    cluster = Cluster(workers=4, bandwidth=1e9, memory=cap)
    chosen: list[float | None] = []
    searched: list[float | None] = []

    def one_candidate(c: Cluster, keep) -> Plan:  # noqa: ANN001
        chosen.append(c.memory)
        p = partition(prof, c, memory_rule=RULE, stages=4, straight=True)
        if keep is not None and not keep(p):
            raise InfeasiblePlanError("keep refused all 1 candidates")
        return p

    plan = fit_peaks(one_candidate, prof, cluster, KIND, M, (0.0, 0.0),
                     search=choose(prof, searched))
    assert len(searched) >= 2 and searched[0] == cap and all(c < cap for c in searched[1:])
    assert len(chosen) == 2 and chosen[0] == cap and chosen[1] in searched[1:]
    assert all((sp.peak_bytes or 0.0) <= cap for sp in plan.stages)
    assert plan.cluster["memory"] == cap
