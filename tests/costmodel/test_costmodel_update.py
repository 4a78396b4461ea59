"""The weight update in the cost model: estimated from bytes, measured on clones, serialised."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn
from cm_helpers import meta, traced

from fxpipe.costmodel import DeviceSpec, Profile, ProfileNode, estimate_graph, profile_graph, to_profile
from fxpipe.costmodel.profile import PROFILE_FORMAT
from fxpipe.costmodel.update import measure_updates
from fxpipe.errors import ConfigError, ProfileFormatError

FAST = dict(warmup=1, repeats=2)
SPEC = DeviceSpec("toy", flops=1e9, mem_bandwidth=1e3, memory=1e9, efficiency=0.5,
                  launch_overhead_s=1e-3)


class Net(nn.Module):
    """Two owning nodes, a parameter-free node, and a frozen layer (no optimizer steps it)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 3)
        self.fc2 = nn.Linear(3, 2)
        self.frozen = nn.Linear(2, 2)
        self.frozen.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.frozen(self.fc2(torch.relu(self.fc1(x))))


@pytest.mark.parametrize("factor", [5.0, 7.0])
def test_estimated_update_is_the_formula_exactly(factor: float) -> None:
    x = torch.randn(2, 4)
    kw = {} if factor == 5.0 else {"optimizer_bytes_factor": factor}
    gm = estimate_graph(traced(nn.Sequential(nn.Linear(4, 3)), x), (x,), SPEC, **kw)
    # weight 4x3 + bias 3, fp32 = 60 bytes in 2 tensors
    assert meta(gm, "_0")["update_s"] == factor * 60 / 1e3 + 2 * 1e-3
    assert meta(gm, "input_1")["update_s"] == 0.0
    assert to_profile(gm).nodes[1].update_s == meta(gm, "_0")["update_s"]


def test_estimated_update_skips_parameter_free_and_frozen_nodes() -> None:
    x = torch.randn(2, 4)
    gm = estimate_graph(traced(Net(), x), (x,), SPEC)
    assert meta(gm, "relu")["update_s"] == 0.0
    assert meta(gm, "frozen")["update_s"] == 0.0
    assert meta(gm, "fc2")["update_s"] == 5.0 * (3 * 2 + 2) * 4 / 1e3 + 2 * 1e-3
    with pytest.raises(ConfigError, match="optimizer_bytes_factor"):
        estimate_graph(gm, (x,), SPEC, optimizer_bytes_factor=-1.0)


def test_measured_update_never_touches_the_model() -> None:
    model = Net()
    x = torch.randn(8, 4)
    gm = traced(model, x)
    gm(x).sum().backward()
    params = {k: v.detach().clone() for k, v in gm.named_parameters()}
    grads = {k: (v.grad.clone() if v.grad is not None else None) for k, v in gm.named_parameters()}
    real = {id(p) for p in gm.parameters()}
    seen: list[list[torch.Tensor]] = []

    def factory(ps: list[torch.Tensor]) -> torch.optim.Optimizer:
        seen.append(ps)
        return torch.optim.Adam(ps, lr=0.1)

    rng = torch.get_rng_state()
    profile_graph(gm, (x,), optimizer_factory=factory, **FAST)
    assert torch.equal(torch.get_rng_state(), rng)
    for k, v in gm.named_parameters():
        assert torch.equal(v, params[k]), k
        assert (v.grad is None) == (grads[k] is None) and (
            v.grad is None or torch.equal(v.grad, grads[k])), k
    assert seen and not any(id(p) in real for ps in seen for p in ps)
    assert meta(gm, "fc1")["update_s"] > 0 and meta(gm, "fc2")["update_s"] > 0
    for name in ("x", "relu", "frozen"):
        assert meta(gm, name)["update_s"] == 0.0, name
    prof = to_profile(gm)
    fc1 = prof.nodes[prof.names.index("fc1")]
    assert fc1.update_s == meta(gm, "fc1")["update_s"]
    assert fc1.compute_s == fc1.forward_s + fc1.backward_s + fc1.update_s


def test_default_optimizer_and_shared_parameters() -> None:
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(10, 6)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return nn.functional.linear(self.embed(ids), self.embed.weight)

    ids = torch.tensor([[1, 2, 3]])
    gm = profile_graph(traced(Tied(), ids), (ids,), **FAST)
    assert meta(gm, "embed")["update_s"] > 0
    assert meta(gm, "linear")["update_s"] == 0.0  # the owner (embed) pays for the tied weight


def _fake_timer(step: Any) -> float:
    """1 ms per tensor plus 1 µs per byte, read off the optimizer the step belongs to."""
    ps = [p for g in step.__self__.param_groups for p in g["params"]]
    return 1e-3 * len(ps) + 1e-6 * sum(p.numel() * p.element_size() for p in ps)


def test_group_apportioning_by_tensors_and_bytes() -> None:
    x = torch.randn(2, 4)
    gm = traced(Net(), x)
    profile_graph(gm, (x,), **FAST)  # annotates ownership
    sgd = lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=0.9)  # noqa: E731
    one = measure_updates(gm, sgd, _fake_timer)  # fc1 and fc2 in one group: 4 tensors
    full = 4e-3 + 1e-6 * (60 + 32)
    base = 4e-3 + 1e-6 * 4 * 4  # four 1-element fp32 tensors
    assert set(one) == {"fc1", "fc2"}
    assert one["fc1"] == pytest.approx(base / 2 + (full - base) * 60 / 92, rel=1e-12)
    assert one["fc1"] + one["fc2"] == pytest.approx(full, rel=1e-12)
    apart = measure_updates(gm, sgd, _fake_timer, group_bytes=1)  # one group per node
    assert apart["fc1"] == pytest.approx(2e-3 + 1e-6 * 60, rel=1e-12)
    assert apart["fc2"] == pytest.approx(2e-3 + 1e-6 * 32, rel=1e-12)


def _node(name: str, update: float = 0.0, **kw: Any) -> ProfileNode:
    return ProfileNode(name, "call_module", "m", 0.25, 0.5, 8.0, 60.0, update_s=update, **kw)


def test_profile_json_round_trip_and_old_files(tmp_path: Path) -> None:
    prof = Profile(nodes=(_node("a", 0.1 + 0.2), _node("b", inputs=("a",))), batch_size=2)
    assert prof.nodes[0].compute_s == 0.25 + 0.5 + (0.1 + 0.2)
    assert prof.total_update_s == 0.1 + 0.2
    f = tmp_path / "p.json"
    prof.save(f)
    assert json.loads(f.read_text())["nodes"][0]["update_s"] == 0.1 + 0.2
    assert Profile.load(f) == prof
    old = {"format": PROFILE_FORMAT, "batch_size": 2, "nodes": [
        {k: v for k, v in nd.items() if k != "update_s"} for nd in prof.to_dict()["nodes"]]}
    (tmp_path / "old.json").write_text(json.dumps(old))
    back = Profile.load(tmp_path / "old.json")
    assert [n.update_s for n in back.nodes] == [0.0, 0.0]
    assert back.nodes[0].compute_s == 0.75
    with pytest.raises(ProfileFormatError, match="update_s"):
        Profile(nodes=(_node("a", -1.0),))
