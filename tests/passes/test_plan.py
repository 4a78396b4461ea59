"""Plan: exact JSON round trip, atomic save, malformed files."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from fxpipe.costmodel.hardware import Cluster
from fxpipe.costmodel.profile import Profile, ProfileNode
from fxpipe.errors import PlanFormatError
from fxpipe.passes import PLAN_FORMAT, Plan, partition


def make_plan() -> Plan:
    nodes = tuple(ProfileNode(name=f"n{i}", op="call_module", target="m", forward_s=0.1 / (i + 1),
                              backward_s=0.2 / 3, activation_bytes=1e6 * (7 - i),
                              parameter_bytes=1e5 * i * i, inputs=(f"n{i - 1}",) if i else ())
                  for i in range(7))
    return partition(Profile(nodes=nodes, batch_size=64), Cluster(workers=6, bandwidth="1Gbps"))


def test_round_trip(tmp_path: Path) -> None:
    plan = make_plan()
    assert Plan.from_dict(plan.to_dict()) == plan
    assert Plan.from_dict(json.loads(json.dumps(plan.to_dict()))) == plan
    f = tmp_path / "plan.json"
    plan.save(f)
    assert Plan.load(f) == plan
    assert not (tmp_path / "plan.json.tmp").exists()
    assert json.loads(f.read_text())["format"] == PLAN_FORMAT
    assert plan.throughput == 64 / plan.time_per_minibatch
    s = plan.summary()
    assert "time per minibatch" in s and "NOAM" in s and "speedup" in s


@pytest.mark.parametrize("mutate,field", [
    (lambda d: d.pop("sync"), "sync"),
    (lambda d: d.update(noam="two"), "noam"),
    (lambda d: d["stages"][0].update(replicas=1.5), "replicas"),
    (lambda d: d["stages"][0].pop("nodes"), "nodes"),
    (lambda d: d.update(time_per_minibatch=-1), "time_per_minibatch"),
    (lambda d: d.update(format="other/9"), "format"),
])
def test_malformed(tmp_path: Path, mutate, field: str) -> None:
    d = make_plan().to_dict()
    mutate(d)
    f = tmp_path / "bad.json"
    f.write_text(json.dumps(d))
    with pytest.raises(PlanFormatError) as ei:
        Plan.load(f)
    assert field in str(ei.value) and "bad.json" in str(ei.value)


def test_missing_and_garbage(tmp_path: Path) -> None:
    with pytest.raises(PlanFormatError, match="does not exist"):
        Plan.load(tmp_path / "nope.json")
    (tmp_path / "g.json").write_text("{not json")
    with pytest.raises(PlanFormatError, match="not valid JSON"):
        Plan.load(tmp_path / "g.json")
