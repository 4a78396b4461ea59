"""made_here: which values each stage makes itself from the model's inputs, by literal tables."""
from __future__ import annotations

import pytest

from fxpipe.costmodel.profile import Profile, ProfileNode
from fxpipe.passes.made_here import (NodeFacts, made_here, made_here_in, model_inputs_behind,
                                     mutates, op_name, repeatable)


def f(name: str, target: str, *inputs: str, params: bool = False, op: str = "call_function",
      writes: bool = False) -> NodeFacts:
    return NodeFacts(name, op, target, inputs, params, writes)


def ids() -> NodeFacts:
    return f("ids", "ids", op="placeholder")


# A decoder's front, in the shape torch.export gives it: a mask and a rotary table made from the
# input ids and a buffer (folded: no input), an embedding (a parameter) and a layer reading both.
DECODER = [
    ids(),
    f("arange", "torch.ops.aten.arange.default"),                # from constants alone
    f("ne", "torch.ops.aten.ne.Scalar", "ids"),
    f("mask", "torch.ops.aten.__and__.Tensor", "ne", "arange"),  # & is not in place
    f("inv_freq", "torch.ops.aten.to.device"),                   # a buffer, moved
    f("cos", "torch.ops.aten.cos.default", "inv_freq"),
    f("emb", "torch.ops.aten.embedding.default", "ids", params=True),
    f("scaled", "torch.ops.aten.mul.Tensor", "emb", "cos"),      # reads an activation
    f("masked", "torch.ops.aten.mul.Tensor", "scaled", "mask"),
]


def test_a_decoders_mask_and_tables_are_made_here_and_nothing_computed_from_a_parameter() -> None:
    assert made_here(DECODER) == {"arange", "ne", "mask", "inv_freq", "cos"}
    assert model_inputs_behind(DECODER, made_here(DECODER)) == {
        "arange": frozenset(), "ne": {"ids"}, "mask": {"ids"}, "inv_freq": frozenset(),
        "cos": frozenset()}


@pytest.mark.parametrize("target", [
    "torch.ops.aten.bernoulli.p", "torch.ops.aten.native_dropout.default",
    "torch.nn.functional.dropout", "torch.rand", "torch.ops.aten.randn.default",
    "torch.ops.aten.normal.Tensor_float", "torch.ops.aten.empty.memory_format",
    "torch.ops.aten.uniform.default", "torch.ops.aten.multinomial.default", "torch.randperm",
    "torch.nn.functional.batch_norm", "torch.ops.aten._native_batch_norm_legit.default",
    "torch.nn.functional.instance_norm"])
def test_an_unrepeatable_op_and_what_is_made_from_it_are_sent(target: str) -> None:
    """Random ops, uninitialised memory, and normalisations that may update running statistics
    (a buffer, which no write here would taint) are sent, and what is made from them."""
    nodes = [ids(), f("r", target, "ids"), f("use", "torch.ops.aten.mul.Tensor", "r", "ids"),
             f("other", "torch.ops.aten.ne.Scalar", "ids")]
    assert made_here(nodes) == {"other"}


def test_a_write_taints_what_it_writes_into_what_that_was_made_from_and_what_follows() -> None:
    """``m = ne(ids)``, ``v = m.view()``, ``v.mul_(2)`` writes into m through the view: m, v and
    what is made from them are sent (their value after the write); ``ids`` itself is written
    through the views too, so whatever else is made from it is sent as well."""
    nodes = [ids(), f("m", "torch.ops.aten.ne.Scalar", "ids"),
             f("v", "torch.ops.aten.view.default", "m"),
             f("w", "torch.ops.aten.mul_.Tensor", "v"),
             f("after", "torch.ops.aten.add.Tensor", "m"),
             f("fresh", "torch.ops.aten.arange.default")]
    assert made_here(nodes) == {"fresh"}


def test_a_write_behind_a_parameter_taints_nothing_made_from_the_inputs() -> None:
    """A layer's output is fresh storage: writing into it (an in-place ReLU) leaves the mask."""
    nodes = [ids(), f("mask", "torch.ops.aten.ne.Scalar", "ids"),
             f("emb", "torch.ops.aten.embedding.default", "ids", params=True),
             f("relu_", "torch.ops.aten.relu_.default", "emb"),
             f("inplace", "torch.nn.functional.relu", "emb", writes=True),
             f("out", "torch.ops.aten.mul.Tensor", "relu_", "mask")]
    assert made_here(nodes) == {"mask"}


def test_a_module_call_is_opaque() -> None:
    nodes = [ids(), f("norm", "norm (LayerNorm)", "ids", op="call_module"),
             f("act", "act (ReLU)", "ids", op="call_module"),
             f("after", "torch.ops.aten.mul.Tensor", "act")]
    assert made_here(nodes) == frozenset()


@pytest.mark.parametrize(("target", "name", "writes"), [
    ("torch.ops.aten.add_.Tensor", "add_", True), ("torch.ops.aten.add.Tensor", "add", False),
    ("Tensor.masked_fill_", "masked_fill_", True), ("Tensor.masked_fill", "masked_fill", False),
    ("operator.iadd", "iadd", True), ("operator.add", "add", False),
    ("operator.setitem", "setitem", True), ("operator.getitem", "getitem", False),
    ("torch.ops.aten.__and__.Tensor", "__and__", False),
    ("torch.ops.aten.__iand__.Tensor", "__iand__", True),
    ("Tensor.__invert__", "__invert__", False),
    ("drop (Dropout)", "Dropout", False), ("torch.ops.aten.copy_.default", "copy_", True)])
def test_op_names_and_writes(target: str, name: str, writes: bool) -> None:
    assert op_name(target) == name
    assert mutates(target) is writes
    assert repeatable(target) is (not writes and name != "Dropout")


def test_a_profile_gives_the_same_answer_as_its_facts() -> None:
    def node(name: str, target: str, *inputs: str, op: str = "call_function",
             p: float = 0.0) -> ProfileNode:
        return ProfileNode(name=name, op=op, target=target, forward_s=1e-3, backward_s=0.0,
                           activation_bytes=8.0, parameter_bytes=p, inputs=inputs)

    prof = Profile(nodes=(node("ids", "ids", op="placeholder"),
                          node("ne", "torch.ops.aten.ne.Scalar", "ids"),
                          node("emb", "torch.ops.aten.embedding.default", "ids", p=40.0),
                          node("y", "torch.ops.aten.mul.Tensor", "emb", "ne")))
    assert made_here_in(prof) == {"ne"}
