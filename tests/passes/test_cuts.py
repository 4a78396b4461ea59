"""cut_bytes: skip connections priced exactly, non-sendable values forbid cuts."""
from __future__ import annotations

import math

from fxpipe.costmodel.profile import Profile, ProfileNode
from fxpipe.costmodel.hardware import Cluster
from fxpipe.passes import crossing_values, cut_bytes, partition


def node(name: str, act: float, inputs: tuple[str, ...] = (), sendable: bool = True) -> ProfileNode:
    return ProfileNode(name=name, op="call_function", target=name, forward_s=0.01, backward_s=0.02,
                       activation_bytes=act, parameter_bytes=0.0, inputs=inputs, sendable=sendable)


def residual() -> Profile:
    # x -> conv1 -> relu -> conv2 -> add(conv2, x) -> fc ; x is the skip tensor (1000 bytes)
    return Profile(nodes=(node("x", 1000), node("conv1", 300, ("x",)), node("relu", 200, ("conv1",)),
                          node("conv2", 100, ("relu",)), node("add", 50, ("conv2", "x")),
                          node("fc", 7, ("add",))))


def test_residual_cut_includes_skip() -> None:
    cb = cut_bytes(residual())
    assert cb.tolist() == [1000.0, 1000 + 300.0, 1000 + 200.0, 1000 + 100.0, 50.0]
    assert crossing_values(residual(), 2) == ("x", "conv1")


def test_value_counted_once_even_with_many_consumers() -> None:
    p = Profile(nodes=(node("a", 10), node("b", 1, ("a",)), node("c", 1, ("a", "b")),
                       node("d", 1, ("a", "c"))))
    assert cut_bytes(p).tolist() == [10.0, 11.0, 11.0]


def test_non_sendable_forbids_cut() -> None:
    p = Profile(nodes=(node("a", 10), node("t", 20, ("a",), sendable=False), node("u", 5, ("t",)),
                       node("v", 5, ("u",))))
    cb = cut_bytes(p)
    assert math.isinf(cb[1]) and cb[0] == 10 and cb[2] == 5
    plan = partition(p, Cluster(workers=4, bandwidth=1e3), straight=True)
    starts = [p.names.index(s.nodes[0]) for s in plan.stages]
    assert 2 not in starts


def test_cut_comm_in_plan_uses_exact_bytes() -> None:
    plan = partition(residual(), Cluster(workers=2, bandwidth=100.0), stages=2)
    s1 = plan.stages[1]
    assert s1.input_bytes == cut_bytes(residual())[residual().names.index(s1.nodes[0]) - 1]
    assert s1.comm_s == 2 * s1.input_bytes / (100.0 * s1.replicas)
