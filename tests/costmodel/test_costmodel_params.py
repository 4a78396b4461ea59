"""Parameter ownership: exact bytes, reused layers and tied weights counted once."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from cm_helpers import meta, traced

from fxpipe.costmodel import annotate_parameters


class OneLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


def test_linear_owns_60_bytes() -> None:
    gm = annotate_parameters(traced(OneLinear(), torch.randn(2, 4)))
    m = meta(gm, "fc")
    assert m["params"] == ("fc.weight", "fc.bias")
    assert m["parameter_bytes"] == 60  # (4*3 + 3) * 4 bytes
    assert m["shared_params"] == ()
    assert meta(gm, "x")["params"] == () and meta(gm, "x")["parameter_bytes"] == 0


def test_conv_and_batchnorm_bytes_nested_names() -> None:
    model = nn.Sequential(nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8)))
    gm = annotate_parameters(traced(model, torch.randn(1, 3, 6, 6)))
    conv, bn = meta(gm, "_0_0"), meta(gm, "_0_1")
    assert conv["params"] == ("0.0.weight", "0.0.bias")
    assert conv["parameter_bytes"] == (8 * 3 * 3 * 3 + 8) * 4 == 896
    assert bn["params"] == ("0.1.weight", "0.1.bias") and bn["parameter_bytes"] == 64
    # running_mean + running_var (fp32) + num_batches_tracked (int64): state, not parameters
    assert bn["buffer_bytes"] == 8 * 4 * 2 + 8


class Reused(nn.Module):
    """One layer applied at two depths."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(5, 5)
        self.b = nn.Linear(5, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(self.b(self.a(x)))


def test_reused_layer_counted_once() -> None:
    gm = annotate_parameters(traced(Reused(), torch.randn(2, 5)))
    first, second = [n for n in gm.graph.nodes if n.op == "call_module" and n.target == "a"]
    m1, m2 = first.meta["fxpipe"], second.meta["fxpipe"]
    assert m1["params"] == ("a.weight", "a.bias") and m1["parameter_bytes"] == 120
    assert m2["params"] == () and m2["parameter_bytes"] == 0
    assert m2["shared_params"] == ("a.weight", "a.bias")
    total = sum(n.meta["fxpipe"]["parameter_bytes"] for n in gm.graph.nodes
                if "parameter_bytes" in n.meta.get("fxpipe", {}))
    assert total == 2 * 120


class TiedGetAttr(nn.Module):
    """Embedding whose weight is reused by F.linear (reached through a get_attr node)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 6)
        self.proj = nn.Linear(6, 6)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.linear(self.proj(self.embed(ids)), self.embed.weight)


def test_tied_weight_via_get_attr() -> None:
    gm = annotate_parameters(traced(TiedGetAttr(), torch.tensor([[1, 2, 3]])))
    assert meta(gm, "embed")["params"] == ("embed.weight",)
    assert meta(gm, "embed")["parameter_bytes"] == 240
    lin = meta(gm, "linear")
    assert lin["params"] == () and lin["shared_params"] == ("embed.weight",)
    assert lin["parameter_bytes"] == 0
    # the get_attr node is not stage work: no ownership entries
    get_attr = next(n for n in gm.graph.nodes if n.op == "get_attr")
    assert "params" not in get_attr.meta.get("fxpipe", {})


class TiedHead(nn.Module):
    """GPT-style lm_head Linear whose .weight IS the embedding's Parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 6)
        self.lm_head = nn.Linear(6, 10)
        self.lm_head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.embed(ids))


def test_tied_lm_head_counted_once() -> None:
    model = TiedHead()
    gm = annotate_parameters(traced(model, torch.tensor([[1, 2]])))
    head = meta(gm, "lm_head")
    assert head["params"] == ("lm_head.bias",) and head["parameter_bytes"] == 40
    assert head["shared_params"] == ("embed.weight",)  # the owner's name, to match stages by name
    total = sum(meta(gm, n)["parameter_bytes"] for n in ("embed", "lm_head"))
    assert total == sum(p.numel() * 4 for p in model.parameters()) == 240 + 40


class RootParam(nn.Module):
    """A bare parameter on the root, used after other work: owned by its first consumer."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4))
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.fc(x))
        return y @ self.w + y @ self.w


def test_get_attr_parameter_owned_by_first_consumer() -> None:
    gm = annotate_parameters(traced(RootParam(), torch.randn(2, 4)))
    matmuls = [n for n in gm.graph.nodes if n.op == "call_function" and "matmul" in str(n.target)]
    assert len(matmuls) == 2
    assert matmuls[0].meta["fxpipe"]["params"] == ("w",)
    assert matmuls[0].meta["fxpipe"]["parameter_bytes"] == 64
    assert matmuls[1].meta["fxpipe"]["shared_params"] == ("w",)
    assert meta(gm, "relu")["params"] == ()
