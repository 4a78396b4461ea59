"""runtime/pricing/choose.py plans with the graph's facts derived once: choosing among many
candidates by simulation, then again on a re-priced copy of the profile, runs the made-here rule,
the last uses and the cut bytes once each (passes/made_here.per_graph), and plans the same as
with them derived afresh for every candidate."""
from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest

from fxpipe.costmodel import Cluster, Profile
from fxpipe.models import pipedream
from fxpipe.passes import cuts
from fxpipe.passes import made_here as mh
from fxpipe.runtime.pricing.choose import choose_plan


def _counted(monkeypatch: pytest.MonkeyPatch) -> Counter:
    calls: Counter = Counter()
    for module, name in ((mh, "made_here"), (cuts, "_last_use_of"), (cuts, "_cut_bytes")):
        fn = getattr(module, name)

        def wrapper(*a, _fn=fn, _name=name, **k):
            calls[_name] += 1
            return _fn(*a, **k)
        monkeypatch.setattr(module, name, wrapper)
    monkeypatch.setattr(mh, "_GRAPHS", [])
    return calls


def test_the_graphs_facts_are_derived_once_per_graph(monkeypatch: pytest.MonkeyPatch) -> None:
    profile = Profile.from_pipedream(pipedream.profile_path("pipedream:vgg16"))
    cluster = Cluster(workers=8, bandwidth=1.25e9)
    calls = _counted(monkeypatch)
    plan = choose_plan(profile, cluster, choose="simulation")
    assert calls == {"made_here": 1, "_last_use_of": 1, "_cut_bytes": 1}
    again = choose_plan(replace(profile, meta={**profile.meta, "note": "re-priced"}), cluster,
                        choose="simulation")
    assert calls == {"made_here": 1, "_last_use_of": 1, "_cut_bytes": 1}
    assert again.replicas == plan.replicas
    # derived afresh for each candidate (no graph kept), the same plan
    monkeypatch.setattr(mh, "GRAPHS_KEPT", 0)
    monkeypatch.setattr(mh, "_GRAPHS", [])
    fresh = choose_plan(profile, cluster, choose="simulation")
    assert calls["made_here"] > 2 and fresh.to_dict() == plan.to_dict()
