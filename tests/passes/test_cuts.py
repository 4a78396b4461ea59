"""cut_bytes: skip connections priced exactly, non-sendable values forbid cuts."""
from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pd_oracle import live_bytes

from fxpipe.costmodel.hardware import Cluster
from fxpipe.costmodel.profile import Profile, ProfileNode
from fxpipe.passes import all_crossing_values, crossing_values, cut_bytes, partition


def node(name: str, act: float, inputs: tuple[str, ...] = (), sendable: bool = True) -> ProfileNode:
    # a module call: an opaque layer (a function call made from nothing but constants would be
    # made again by each stage that reads it, passes/made_here, and cross no cut)
    return ProfileNode(name=name, op="call_module", target=name, forward_s=0.01, backward_s=0.02,
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


def test_non_sendable_values_back_to_back_and_apart() -> None:
    """a and b cannot be sent; a lives across cut 1 only, b across cut 2 only: cuts 1, 2 are
    forbidden, cut 3 carries c (5 bytes). Then two forbidden stretches apart, with an allowed
    cut between them: e (not sendable) across cut 1, g (not sendable) across cut 3."""
    p = Profile(nodes=(node("a", 10, sendable=False), node("b", 20, ("a",), sendable=False),
                       node("c", 5, ("b",)), node("d", 1, ("c",))))
    cb = cut_bytes(p)
    assert math.isinf(cb[0]) and math.isinf(cb[1]) and cb[2] == 5
    q = Profile(nodes=(node("e", 10, sendable=False), node("f", 20, ("e",)),
                       node("g", 5, ("f",), sendable=False), node("h", 1, ("g",))))
    cb = cut_bytes(q)
    assert math.isinf(cb[0]) and cb[1] == 20 and math.isinf(cb[2])


def test_an_unused_output_changes_no_cut() -> None:
    """A model output nothing consumes crosses no cut, however large (its bytes must not even
    round the others away: 1e20 + 3 - 1e20 is 0 in floating point)."""
    p = Profile(nodes=(node("a", 3), node("b", 1, ("a",)), node("out", 1e20, ("a", "b")),
                       node("c", 7, ("b",))))
    assert cut_bytes(p).tolist() == [3.0, 4.0, 1.0]


def test_crossing_values_positions() -> None:
    r = residual()
    assert crossing_values(r, 1) == ("x",) and crossing_values(r, 5) == ("add",)
    for bad in (0, 6, -1):
        with pytest.raises(ValueError, match=rf"cut position must be in 1\.\.5, got {bad}$"):
            crossing_values(r, bad)
    assert all_crossing_values(r, [1, 2, 5]) == {p: crossing_values(r, p) for p in (1, 2, 5)}


@st.composite
def graphs(draw):
    """Random DAGs in program order: each node uses up to two earlier ones."""
    n = draw(st.integers(1, 8))
    nodes = []
    for i in range(n):
        ins = draw(st.sets(st.integers(0, i - 1), max_size=2)) if i else set()
        nodes.append(node(f"v{i}", draw(st.sampled_from([0.0, 1.0, 2.5, 1e3, 1e12])),
                          tuple(f"v{j}" for j in sorted(ins)),
                          sendable=draw(st.sampled_from([True, True, False]))))
    return Profile(nodes=tuple(nodes))


@settings(max_examples=200, deadline=None)
@given(graphs())
def test_cut_bytes_and_crossing_values_match_the_definition(p: Profile) -> None:
    want = live_bytes(p.names, [nd.inputs for nd in p.nodes], [nd.activation_bytes for nd in p.nodes],
                      [nd.sendable for nd in p.nodes])
    assert cut_bytes(p).tolist() == pytest.approx(want, rel=1e-12)
    for pos in range(1, len(p.nodes)):
        names = tuple(nd.name for i, nd in enumerate(p.nodes) if i < pos and any(
            nd.name in later.inputs for later in p.nodes[pos:]))
        assert crossing_values(p, pos) == names
        assert all_crossing_values(p, [pos]) == {pos: names}


def test_an_early_model_output_is_carried_to_the_last_stage() -> None:
    """A model output made early (an encoder's last hidden state) is returned by the last stage,
    so it is live across every cut after it, by hand: enc (40 bytes, an output) -> h (5) -> y (3)
    -> loss (1); the cuts after enc carry 40 + what the chain carries there."""
    def out(name: str, act: float, inputs: tuple[str, ...] = ()) -> ProfileNode:
        return ProfileNode(name=name, op="call_module", target=name, forward_s=0.01,
                           backward_s=0.02, activation_bytes=act, parameter_bytes=0.0,
                           inputs=inputs, is_output=True)

    p = Profile(nodes=(node("x", 7), out("enc", 40, ("x",)), node("h", 5, ("enc",)),
                       node("y", 3, ("h",)), out("loss", 1, ("y",))))
    assert cut_bytes(p).tolist() == [7.0, 40.0, 40.0 + 5.0, 40.0 + 3.0]
    assert crossing_values(p, 3) == ("enc", "h")


def test_a_value_made_from_the_model_inputs_alone_crosses_no_cut() -> None:
    """ids (7 bytes) -> mask(ids) (a function call on the input alone, 40 bytes) -> emb(ids) (a
    layer, 5) -> h(emb, mask) (3) -> out(h, mask) (1): a stage after the mask makes it again
    from the ids, so the ids (read there) cross instead of the mask, up to the last reader."""
    mask = ProfileNode(name="mask", op="call_function", target="torch.ops.aten.ne.Scalar",
                       forward_s=0.01, backward_s=0.0, activation_bytes=40.0,
                       parameter_bytes=0.0, inputs=("ids",))
    ids = ProfileNode(name="ids", op="placeholder", target="ids", forward_s=0.0, backward_s=0.0,
                      activation_bytes=7.0, parameter_bytes=0.0)
    p = Profile(nodes=(ids, mask, node("emb", 5, ("ids",)),
                       node("h", 3, ("emb", "mask")), node("out", 1, ("h", "mask"))))
    assert cut_bytes(p).tolist() == [7.0, 7.0, 7.0 + 5.0, 7.0 + 3.0]
    assert crossing_values(p, 2) == ("ids",)
    assert all_crossing_values(p, [3, 4]) == {3: ("ids", "emb"), 4: ("ids", "h")}


def test_the_cut_bytes_kept_for_a_graph_cannot_be_changed_by_a_caller() -> None:
    """cut_bytes is computed once per graph and handed to every caller: read-only."""
    p = residual()
    got = cut_bytes(p)
    assert got is cut_bytes(p)
    with pytest.raises(ValueError, match="read-only"):
        got[0] = 0.0
