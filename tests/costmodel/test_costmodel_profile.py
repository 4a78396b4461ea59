"""to_profile, Profile JSON and Cluster parsing."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from cm_helpers import traced

from fxpipe.costmodel import Cluster, Profile, ProfileNode, estimate_graph, profile_graph, to_profile
from fxpipe.errors import ConfigError, ProfileFormatError


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 6)
        self.ln = nn.LayerNorm(6)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.ln(self.embed(ids))
        return F.linear(h, self.embed.weight)


def _profiled() -> tuple[torch.fx.GraphModule, Profile]:
    ids = torch.tensor([[1, 2, 3]])
    gm = profile_graph(traced(Tied(), ids), (ids,), warmup=1, repeats=2)
    return gm, to_profile(gm, batch_size=1)


def test_to_profile_order_and_inputs() -> None:
    gm, prof = _profiled()
    assert prof.names == ["ids", "embed", "ln", "linear"]  # no get_attr, no output
    assert [n.name for n in gm.graph.nodes if n.op == "get_attr"]  # but the graph has one
    by = {n.name: n for n in prof.nodes}
    assert by["linear"].inputs == ("ln",)  # the get_attr argument is folded
    assert by["linear"].shared_params == ("embed.weight",)
    assert by["embed"].target == "embed (Embedding)" and by["embed"].op == "call_module"
    assert by["linear"].target == "torch.nn.functional.linear"
    assert by["ln"].activation_bytes == 3 * 6 * 4
    assert prof.total_parameter_bytes == (60 + 12) * 4
    assert prof.batch_size == 1 and prof.device == "cpu (measured)"


def test_targets_are_readable() -> None:
    class M(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.flatten(x + 1, 1).view(-1)

    x = torch.randn(2, 3)
    prof = to_profile(estimate_graph(traced(M(), x), (x,), "v100"))
    assert [n.target for n in prof.nodes] == ["x", "operator.add", "torch.flatten", "Tensor.view"]


def test_missing_times_is_a_clear_error() -> None:
    gm = traced(Tied(), torch.tensor([[1]]))
    with pytest.raises(ProfileFormatError, match="forward_s") as e:
        to_profile(gm)
    assert "profile_graph" in str(e.value) and "estimate_graph" in str(e.value)
    assert isinstance(e.value, ValueError)


def test_json_round_trip(tmp_path: Path) -> None:
    _, prof = _profiled()
    path = tmp_path / "profile.json"
    prof.save(path)
    back = Profile.load(path)
    assert back == prof
    assert back.nodes[-1].shared_params == ("embed.weight",)


def test_profile_rejects_bad_order() -> None:
    a = ProfileNode("a", "placeholder", "a", 0, 0, 4, 0)
    b = ProfileNode("b", "call_function", "f", 1, 1, 4, 0, inputs=("a",))
    with pytest.raises(ProfileFormatError, match="not an earlier node"):
        Profile(nodes=(b, a))
    with pytest.raises(ProfileFormatError):
        Profile.from_dict({"format": "nope"})


def test_cluster_parsing() -> None:
    assert Cluster(workers=4, bandwidth="10Gbps").bandwidth == 1.25e9
    assert Cluster(workers=4).bandwidth == 1.25e9
    c = Cluster(workers=8, bandwidth="25Gbit/s", device="v100", workers_per_machine=4,
                intra_bandwidth="300GB/s")
    assert c.hierarchical and c.machines == 2 and c.intra_bandwidth == 300e9
    assert c.memory == 16e9 and c.device == "V100"
    assert Cluster.from_dict(c.to_dict()) == c
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ConfigError, match="workers"):
            Cluster(workers=bad)  # type: ignore[arg-type]
    for bw in ("fast", "-3Gbps", 0, "10 parsecs"):
        with pytest.raises(ConfigError):
            Cluster(workers=2, bandwidth=bw)
    with pytest.raises(ConfigError, match="workers_per_machine"):
        Cluster(workers=6, workers_per_machine=4)
    with pytest.raises(ConfigError, match="unknown device"):
        Cluster(workers=2, device="tpu")
