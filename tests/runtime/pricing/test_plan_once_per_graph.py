"""Planning derives the graph's own facts once, however many candidates it prices: the bytes
crossing each cut, the values every stage makes again from the model's inputs, the shared
parameters. A count per fact over a whole fitted choice by simulation (many partitions, plans
of given partitions, simulations and walks) catches a fact made again per candidate."""
from __future__ import annotations

from importlib import import_module

import pytest

import fxpipe
from fxpipe.costmodel.hardware import Cluster
from fxpipe.costmodel.profile import Profile
from fxpipe.models import get
from fxpipe.runtime.pricing import plan_choice
from fxpipe.runtime.pricing.choose import choose_fitted_plan

cuts = import_module("fxpipe.passes.cuts")
made_here = import_module("fxpipe.passes.made_here")
partition = import_module("fxpipe.passes.partition")  # the module, not the function


def test_a_fitted_choice_by_simulation_derives_each_graph_fact_once(monkeypatch) -> None:
    spec = get("gpt")
    compiled = fxpipe.compile(spec.model, Cluster(workers=4, bandwidth="1Gbps"),
                              example_inputs=spec.example_inputs, loss_fn=spec.loss_fn,
                              choose="planner")
    # a copy with a node tuple of its own: nothing derived from it is kept yet
    profile = Profile.from_dict(compiled.profile.to_dict())
    assert made_here.made_here_in(compiled.profile)  # the GPT makes values again (positions)
    calls: dict[str, int] = {}

    def counted(module, name):  # noqa: ANN001, ANN202
        real = getattr(module, name)

        def wrapper(*a, **k):  # noqa: ANN002, ANN003, ANN202
            calls[name] = calls.get(name, 0) + 1
            return real(*a, **k)
        monkeypatch.setattr(module, name, wrapper)

    counted(cuts, "_cut_bytes")
    counted(made_here, "made_here")
    counted(partition, "shared_parameters")
    counted(partition, "plan_for")  # how many candidates: the test must price several
    counted(plan_choice, "plan_for")
    plan = choose_fitted_plan(profile, Cluster(workers=4, bandwidth="100Mbps", memory="1GB"),
                              choose="simulation", schedule="1f1b-flush", microbatches=4)
    assert plan.time_source == "simulated 1f1b-flush"
    assert len(plan.stages) > 1  # a pipeline: its local moves were priced too (_refined)
    assert calls.get("plan_for", 0) >= 10, calls
    assert calls["_cut_bytes"] == 1, calls
    assert calls["made_here"] == 1, calls
    assert calls["shared_parameters"] == 1, calls


@pytest.fixture(autouse=True)
def _fresh_graph_facts(monkeypatch) -> None:
    """Facts other tests derived stay out of this one's counts (and its out of theirs)."""
    monkeypatch.setattr(made_here, "_GRAPHS", [])
