"""tracing.trace / propagate_shapes on small hand-written models."""
from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn

from fxpipe.errors import ConfigError, InputMismatchError, TracingError
from fxpipe.tracing import TracedGraph, propagate_shapes, trace


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc(x))


class ShapeBranch(nn.Module):
    """Shape-dependent control flow: symbolic_trace fails, export specialises it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > 1:
            x = self.fc(x)
        return self.bn(x)


class DataBranch(nn.Module):
    """Data-dependent control flow: neither tracer can capture it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return self.fc(x)
        return x


class Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


class Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = Inner()
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.inner(x))


class TupleOut(nn.Module):
    def forward(self, x: torch.Tensor):
        return x.chunk(2, dim=1), x.size(0)


def _same_params(gm: torch.fx.GraphModule, model: nn.Module) -> None:
    mine = dict(model.named_parameters())
    theirs = dict(gm.named_parameters())
    assert list(theirs) == list(mine)
    for name, p in theirs.items():
        assert p is mine[name], name


def test_linear_meta_exact() -> None:
    model = Tiny()
    x = torch.randn(2, 4)
    traced = trace(model, x)  # a single tensor is accepted
    assert isinstance(traced, TracedGraph)
    assert traced.method == "symbolic_trace"
    assert traced.input_names == ("x",)
    _same_params(traced.gm, model)
    nodes = {n.name: n for n in traced.gm.graph.nodes}
    fc = nodes["fc"].meta["fxpipe"]
    assert fc["shape"] == (2, 3) and fc["bytes"] == 24 and fc["dtype"] == "torch.float32"
    assert fc["is_tensor"] and fc["sendable"] and "static_value" not in fc
    assert nodes["x"].meta["fxpipe"]["shape"] == (2, 4)
    assert nodes["x"].meta["fxpipe"]["bytes"] == 32
    for n in traced.gm.graph.nodes:
        assert (n.op == "output") != ("fxpipe" in n.meta), n.name
    torch.testing.assert_close(traced.gm(x), model(x))


def test_tuple_and_static_meta() -> None:
    gm = torch.fx.symbolic_trace(TupleOut())
    propagate_shapes(gm, (torch.randn(3, 4),))
    meta = {n.name: n.meta["fxpipe"] for n in gm.graph.nodes if n.op != "output"}
    chunk = meta["chunk"]
    assert chunk["shape"] == [(3, 2), (3, 2)] and chunk["bytes"] == 48
    assert not chunk["is_tensor"] and not chunk["sendable"] and chunk["dtype"] is None
    size = meta["size"]
    assert size["static_value"] == 3 and size["sendable"] and size["bytes"] == 0
    assert size["shape"] is None and not size["is_tensor"]


def test_meta_is_a_dict_and_updates_existing() -> None:
    gm = torch.fx.symbolic_trace(Tiny())
    for n in gm.graph.nodes:
        n.meta["fxpipe"] = {"keep": 1}
    propagate_shapes(gm, torch.randn(5, 4))
    fc = next(n for n in gm.graph.nodes if n.name == "fc")
    assert fc.meta["fxpipe"]["keep"] == 1 and fc.meta["fxpipe"]["shape"] == (5, 3)


def test_shape_control_flow_falls_back_to_export_and_keeps_buffers() -> None:
    model = ShapeBranch().train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(3, 4)
    traced = trace(model, (x,))
    assert traced.method == "export"
    assert model.training
    _same_params(traced.gm, model)
    for k, v in model.state_dict().items():  # eager check + shape propagation left no trace
        assert torch.equal(v, before[k]), k
    for (name, b), (_, orig) in zip(traced.gm.named_buffers(), model.named_buffers()):
        assert b is orig, name
    ops = {str(n.target) for n in traced.gm.graph.nodes}
    assert "_guards_fn" not in ops and not any("assert" in o for o in ops)
    torch.testing.assert_close(traced.gm(x), model(x))
    out = traced.gm(x).sum()
    out.backward()
    assert model.fc.weight.grad is not None


def test_data_dependent_control_flow_raises_with_source_line() -> None:
    with pytest.raises(TracingError) as info:
        trace(DataBranch(), torch.randn(3, 4))
    msg = str(info.value)
    assert "if x.sum() > 0:" in msg
    assert "test_tracing_trace.py" in msg
    assert "leaf_modules" in msg and "torch.where" in msg


def test_wrong_arity_raises_input_mismatch() -> None:
    with pytest.raises(InputMismatchError) as info:
        trace(Tiny(), (torch.randn(2, 4), torch.randn(2, 4)))
    msg = str(info.value)
    assert "(2, 4)" in msg and "forward(x" in msg


def test_wrong_shape_raises_input_mismatch() -> None:
    with pytest.raises(InputMismatchError) as info:
        trace(Tiny(), torch.randn(2, 5))
    assert "(2, 5)" in str(info.value) and "torch.float32" in str(info.value)


@pytest.mark.parametrize("leaf", [Inner, "inner"])
def test_leaf_modules_keep_one_call_module(leaf: object) -> None:
    model = Outer()
    traced = trace(model, torch.randn(2, 4), leaf_modules=[leaf])
    targets = [n.target for n in traced.gm.graph.nodes if n.op == "call_module"]
    assert targets == ["inner", "head"]
    _same_params(traced.gm, model)
    plain = trace(model, torch.randn(2, 4))
    assert [n.target for n in plain.gm.graph.nodes if n.op == "call_module"] == \
        ["inner.a", "inner.b", "head"]


def test_forced_method_and_bad_method() -> None:
    model = Tiny()
    x = torch.randn(2, 4)
    traced = trace(model, (x,), method="export")
    assert traced.method == "export"
    _same_params(traced.gm, model)
    torch.testing.assert_close(traced.gm(x), model(x))
    with pytest.raises(TracingError):
        trace(ShapeBranch(), (x,), method="symbolic_trace")
    with pytest.raises(ConfigError):
        trace(model, (x,), method="jit")


class TiedFunctional(torch.nn.Module):
    """Reads a tied weight through its second alias, functionally (get_attr nodes)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.out = nn.Linear(4, 10, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(self.emb(idx), self.out.weight)  # (B, T, 10)


def test_get_attr_targets_use_canonical_names() -> None:
    model = TiedFunctional()
    idx = torch.randint(0, 10, (2, 3))
    for method in ("symbolic_trace", "export"):
        traced = trace(model, idx, method=method)
        attrs = [n.target for n in traced.gm.graph.nodes if n.op == "get_attr"]
        assert "out.weight" not in attrs, method
        assert set(attrs) <= {n for n, _ in traced.gm.named_parameters()}
        torch.testing.assert_close(traced.gm(idx), model(idx))
        assert traced.gm.get_parameter("emb.weight") is model.emb.weight


class StopsTwice(torch.nn.Module):
    """symbolic_trace stops at the loop over a shape; torch.export gets past it and stops at
    the data-dependent branch further down."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(x.shape[0]):  # symbolic_trace: a Proxy is not an int
            x = x + 1
        if x.sum() > 0:  # export: data-dependent control flow
            return x * 2
        return x


def test_each_tracer_names_the_line_where_it_stopped() -> None:
    with pytest.raises(TracingError) as info:
        trace(StopsTwice(), torch.randn(3, 4))
    msg = str(info.value)
    lines, first = inspect.getsourcelines(StopsTwice.forward)
    where = {code.strip().split("  #")[0]: f"{__file__}:{first + i}: {code.strip()}"
             for i, code in enumerate(lines)}
    assert f"symbolic_trace stopped at {where['for _ in range(x.shape[0]):']}" in msg
    assert f"export stopped at {where['if x.sum() > 0:']}" in msg
