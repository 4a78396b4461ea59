"""The profiler never changes what the model computes, however often it runs a node.

Nodes that write into an input (aten overloads such as ``add_.Tensor``, ``index_put_``, ``copy_``,
``out=`` variants, or any function that does so without saying) are timed on private copies. Each
graph below increments an index tensor in place and then looks it up in a 5-row embedding: one
increment is in range, the repeated increments of a profiler that shared the tensor would not be
(the failure T5's relative-position buckets hit: IndexError in an embedding)."""
from __future__ import annotations

import operator
from typing import Any, Callable

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F

from fxpipe.costmodel import estimate_graph, profile_graph
from fxpipe.costmodel.profiler import _is_inplace, schema_mutates

aten = torch.ops.aten
WEIGHT = torch.arange(20.0).reshape(5, 4)


def bump_quietly(t: torch.Tensor) -> torch.Tensor:
    """Writes into its argument, with nothing in its name or signature saying so."""
    t.add_(1)
    return t


def _graph(write: Callable[[fx.Graph, fx.Node], fx.Node]) -> fx.GraphModule:
    """idx -> clone -> <write in place: idx + 1> -> embedding(WEIGHT, .) -> sum."""
    root = torch.nn.Module()
    root.register_buffer("weight", WEIGHT.clone())
    root.register_buffer("rows", torch.tensor([0, 1, 2, 3]))  # index_put_(accumulate): += 1
    root.register_buffer("ones", torch.ones(4, dtype=torch.long))
    g = fx.Graph()
    idx = g.placeholder("idx")
    y = g.call_function(aten.clone.default, (idx,))
    z = write(g, y)
    w = g.get_attr("weight")
    e = g.call_function(F.embedding, (z, w))
    g.output(g.call_function(torch.sum, (e,)))
    return fx.GraphModule(root, g)


WRITES: dict[str, Callable[[fx.Graph, fx.Node], fx.Node]] = {
    "aten.add_.Tensor": lambda g, y: g.call_function(aten.add_.Tensor, (y, 1)),
    "aten.add_ (packet)": lambda g, y: g.call_function(aten.add_, (y, 1)),
    "aten.index_put_": lambda g, y: g.call_function(
        aten.index_put_.default, (y, [g.get_attr("rows")], g.get_attr("ones"), True)),
    "aten.copy_": lambda g, y: g.call_function(
        aten.copy_.default, (y, g.call_function(operator.add, (y, 1)))),
    "torch.add(out=)": lambda g, y: g.call_function(torch.add, (y, 1), {"out": y}),
    "operator.iadd": lambda g, y: g.call_function(operator.iadd, (y, 1)),
    "Tensor.add_": lambda g, y: g.call_method("add_", (y, 1)),
    "undeclared write": lambda g, y: g.call_function(bump_quietly, (y,)),
}
IDX = torch.tensor([0, 1, 2, 3])  # + 1 -> rows 1..4 of 5: once is fine, twice is out of range
EXPECTED = float(WEIGHT[IDX + 1].sum())


@pytest.mark.parametrize("name", sorted(WRITES))
def test_profiling_a_node_that_writes_in_place_changes_nothing(name: str) -> None:
    gm = _graph(WRITES[name])
    idx = IDX.clone()
    assert float(gm(idx.clone())) == EXPECTED
    profile_graph(gm, (idx,), warmup=3, repeats=8)
    assert torch.equal(idx, IDX)  # the caller's example input is untouched
    assert float(gm(idx.clone())) == EXPECTED
    writer = [n for n in gm.graph.nodes if n.op in ("call_function", "call_method")
              and n.name != "add"][1]  # (copy_'s source is an add)
    assert writer.meta["fxpipe"]["forward_s"] > 0
    assert torch.equal(gm.weight, WEIGHT)


@pytest.mark.parametrize("name", sorted(WRITES))
def test_estimating_a_node_that_writes_in_place_changes_nothing(name: str) -> None:
    gm = _graph(WRITES[name])
    estimate_graph(gm, (IDX.clone(),), "v100")
    assert float(gm(IDX.clone())) == EXPECTED


@pytest.mark.parametrize("target,mutates", [
    (aten.add_.Tensor, True), (aten.add.Tensor, False), (aten.add_, True), (aten.add, True),
    (aten.add.out, True), (aten.index_put_.default, True), (aten.index_put.default, False),
    (aten.copy_.default, True), (aten.relu.default, False), (aten.relu_.default, True),
    (torch.add, False), (F.relu, False)])
def test_schema_says_which_aten_overloads_write(target: Any, mutates: bool) -> None:
    # the aten.add packet has an out= overload, which writes: a call through the packet may
    assert schema_mutates(target) is mutates


def test_static_detection_covers_overloads_out_and_methods() -> None:
    g = fx.Graph()
    x = g.placeholder("x")
    nodes = {
        "overload": g.call_function(aten.add_.Tensor, (x, 1)),
        "functional": g.call_function(aten.add.Tensor, (x, 1)),
        "out": g.call_function(torch.add, (x, 1), {"out": x}),
        "method": g.call_method("mul_", (x, 2)),
        "plain method": g.call_method("mul", (x, 2)),
    }
    g.output(x)
    gm = fx.GraphModule(torch.nn.Module(), g)
    assert {k: _is_inplace(n, gm) for k, n in nodes.items()} == {
        "overload": True, "functional": False, "out": True, "method": True,
        "plain method": False}
