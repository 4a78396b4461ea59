"""plansim prices activation recomputation: a recomputing stage's backward starts with its
forward again (hand-computed on a two-layer profile)."""
from __future__ import annotations

import pytest

from fxpipe.costmodel.hardware import Cluster
from fxpipe.costmodel.profile import Profile, ProfileNode
from fxpipe.passes import plan_for
from fxpipe.runtime.pricing.plansim import simulate_plan, stage_costs


def _profile() -> Profile:
    """x (model input) -> l1 -> l2; each layer F 1 s, B 2 s; tiny bytes (cuts cost ~1e-7 s)."""
    def node(name: str, f: float, inputs: tuple[str, ...], op: str = "call_module") -> ProfileNode:
        return ProfileNode(name=name, op=op, target=name, forward_s=f, backward_s=2 * f,
                           activation_bytes=100.0, parameter_bytes=10.0, inputs=inputs)
    return Profile(nodes=(node("x", 0.0, (), "placeholder"), node("l1", 1.0, ("x",)),
                          node("l2", 1.0, ("l1",))), batch_size=4)


@pytest.mark.parametrize("with_profile", [True, False])
def test_recomputing_stage_costs_one_more_forward(with_profile: bool) -> None:
    """Stage 0 = [x, l1] recomputes: plan compute 1 + 2 + 1 = 4 s, of which 1 s again; the
    simulator gives it forward 1 s and backward 2 + 1 = 3 s. Stage 1 = [l2]: 1 s and 2 s. The
    profile's split (F:B = 1:2) and the default one (1/3 forward) agree here."""
    prof, cl = _profile(), Cluster(workers=2, bandwidth=1e9)
    plan = plan_for(prof, cl, [0, 2], [1, 1], recompute=[True, False])
    costs = stage_costs(plan, prof if with_profile else None)
    assert [(c.forward_s, c.backward_s, c.recompute_s) for c in costs] == [
        (1.0, 3.0, 1.0), (1.0, 2.0, 0.0)]
    plain = stage_costs(plan_for(prof, cl, [0, 2], [1, 1]), prof if with_profile else None)
    assert [(c.forward_s, c.backward_s, c.recompute_s) for c in plain] == [
        (1.0, 2.0, 0.0), (1.0, 2.0, 0.0)]


@pytest.mark.parametrize("schedule", ["pipedream", "1f1b-flush", "zb-h1"])
def test_simulated_period_includes_the_extra_forward(schedule: str) -> None:
    """Two straight stages, stage 0 the bottleneck once it recomputes: 1 + 3 = 4 s per
    minibatch in steady state under pipedream (3 s without). The flushing and zero-bubble
    schedules add their bubbles, so for them only "slower than without" is asserted."""
    prof, cl = _profile(), Cluster(workers=2, bandwidth=1e9)
    rec = simulate_plan(plan_for(prof, cl, [0, 2], [1, 1], recompute=[True, False]), prof,
                        schedule=schedule, minibatches=64)
    plain = simulate_plan(plan_for(prof, cl, [0, 2], [1, 1]), prof, schedule=schedule,
                          minibatches=64)
    if schedule == "pipedream":
        assert rec.steady_state_period == pytest.approx(4.0, rel=1e-3)
        assert plain.steady_state_period == pytest.approx(3.0, rel=1e-3)
    assert plain.steady_state_period < rec.steady_state_period
    assert "(recompute 1 s)" in rec.summary()
    assert "recompute" not in plain.summary()



def test_choosing_by_simulation_passes_recompute_through() -> None:
    """tests/passes/test_recompute.py's cap case: x (10 B) -> l1 (P 0, A 300) -> l2 (P 100,
    A 10) on 2 workers of 400 B. Only [x, l1] | [l2] with stage 0 recomputing fits (330 B and
    310 B; the one-stage merge needs 620 B without and 630 B with), so the simulated choice is
    that plan, flags included; without recomputation nothing fits."""
    from fxpipe.errors import InfeasiblePlanError
    from fxpipe.runtime.pricing.plan_choice import choose_by_simulation

    def node(name: str, f: float, p: float, a: float, inputs: tuple[str, ...] = (),
             op: str = "call_module") -> ProfileNode:
        return ProfileNode(name=name, op=op, target=name, forward_s=f, backward_s=2 * f,
                           activation_bytes=a, parameter_bytes=p, inputs=inputs)

    prof = Profile(nodes=(node("x", 0.0, 0.0, 10.0, op="placeholder"),
                          node("l1", 1.0, 0.0, 300.0, ("x",)),
                          node("l2", 1.0, 100.0, 10.0, ("l1",))), batch_size=4)
    cl = Cluster(workers=2, bandwidth=1e9, memory=400)
    choice = choose_by_simulation(prof, cl, recompute="auto", minibatches=32)
    assert choice.plan.recompute == [True, False]
    assert [s.memory_bytes for s in choice.plan.stages] == [330.0, 310.0]
    with pytest.raises(InfeasiblePlanError):
        choose_by_simulation(prof, cl, minibatches=32)
