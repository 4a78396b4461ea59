"""split_graph + run_stages: exact transparency, routing, baking and validation."""
from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.utils._pytree as pytree

from fxpipe.codegen import StageSpec, run_stages, split_graph
from fxpipe.codegen.split import MODEL, placed_nodes
from fxpipe.errors import ConfigError, FxpipeError

from _codegen_helpers import MLP, ResCNN, Reused, TinyGPT, annotate, chunk_stage_of

TIGHT = {"rtol": 1e-6, "atol": 1e-7}


def _loss(out: Any) -> torch.Tensor:
    return sum((leaf.float() ** 2).mean() for leaf in pytree.tree_leaves(out)
               if isinstance(leaf, torch.Tensor) and leaf.is_floating_point())


def _check(model: nn.Module, gm: fx.GraphModule, args: tuple, stage_of: dict[str, int],
           ref_fn: Callable[[], Any], kwargs: dict[str, Any] | None = None) -> list[StageSpec]:
    """run_stages == reference, and gradients (by parameter name) match exactly."""
    ref = ref_fn()
    _loss(ref).backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    stages = split_graph(gm, stage_of)
    out = run_stages(stages, args, kwargs)
    assert type(out) is type(ref)
    assert pytree.tree_structure(out) == pytree.tree_structure(ref)
    for a, b in zip(pytree.tree_leaves(out), pytree.tree_leaves(ref)):
        torch.testing.assert_close(a, b, **TIGHT)
    _loss(out).backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert grads.keys() == ref_grads.keys()
    for name, g in grads.items():
        torch.testing.assert_close(g, ref_grads[name], **TIGHT, msg=name)
    own = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    for st in stages:  # same Parameter objects, under the model's own names
        for n, p in st.gm.named_parameters(remove_duplicate=False):
            assert id(p) in own, n
        names = {n for n, _ in model.named_parameters(remove_duplicate=False)}
        assert {n for n, _ in st.gm.named_parameters(remove_duplicate=False)} <= names
    return stages


MODELS = {"rescnn": (ResCNN, lambda: (torch.randn(2, 3, 8, 8),)),
          "mlp": (MLP, lambda: (torch.randn(4, 6),)),
          "reused": (Reused, lambda: (torch.randn(3, 8),)),
          "tinygpt": (TinyGPT, lambda: (torch.randint(0, 50, (2, 8)),))}


@pytest.mark.parametrize("num_stages", [1, 2, 4, 8])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_transparent(name: str, num_stages: int) -> None:
    cls, make_args = MODELS[name]
    model, args = cls(), make_args()
    gm = annotate(fx.symbolic_trace(model), *args)
    stage_of = chunk_stage_of(gm, num_stages)
    stages = _check(model, gm, args, stage_of, lambda: model(*args))
    assert len(stages) == max(stage_of.values()) + 1
    if name == "tinygpt" and num_stages > 1:  # the tied weight's two uses are in different stages
        assert stage_of["wte"] < stage_of["lm_head"]
    if name == "reused" and num_stages >= 4:
        assert stage_of["shared"] != stage_of["shared_1"]


class Skip(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.relu(self.a(x))
        return self.c(self.b(h)) + h, h


def test_routing_skip_connection_goes_direct_and_outputs_leave_from_the_last_stage() -> None:
    model = Skip()
    gm = fx.symbolic_trace(model)
    stage_of = {"x": 0, "a": 0, "relu": 0, "b": 1, "c": 2, "add": 2}
    s0, s1, s2 = split_graph(gm, stage_of)
    # h (relu) is a model output made on stage 0: it goes straight to stage 2 (which needs it
    # anyway), and stage 2 returns it beside the sum, so the loss sees the whole output there
    assert (s0.index, s0.inputs, s0.sources, s0.outputs, s0.consumers) == \
        (0, ("x",), (-1,), ("relu",), ((1, 2),))
    assert (s1.inputs, s1.sources, s1.outputs, s1.consumers) == (("relu",), (0,), ("b",), ((2,),))
    assert (s2.inputs, s2.sources, s2.outputs, s2.consumers) == \
        (("relu", "b"), (0, 1), ("relu", "add"), ((-1,), (-1,)))
    x = torch.randn(2, 4)
    out = run_stages([s0, s1, s2], (x,))
    ref = model(x)
    assert isinstance(out, tuple) and len(out) == 2
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    assert dict(s1.gm.named_parameters()).keys() == {"b.weight", "b.bias"}
    assert s1.gm.b is model.b


class Reshape(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.size(0)
        return torch.relu(self.fc(x)).view(n, 2, -1)


def test_size_crossing_a_boundary_is_recomputed_not_baked() -> None:
    """A number computed from a tensor (here the batch size) is recomputed by the stage that
    uses it, from the model input, so the stages take any batch; baking the example's 4 in
    stage 1 broke every other batch size (microbatches)."""
    model, x = Reshape(), torch.randn(4, 6)
    gm = annotate(fx.symbolic_trace(model), x)
    stage_of = {"x": 0, "size": 0, "fc": 0, "relu": 1, "view": 1}
    s0, s1 = split_graph(gm, stage_of)
    assert s0.outputs == ("fc",) and s1.inputs == ("x", "fc") and s1.sources == (MODEL, 0)
    assert "size_here = x.size(0)" in s1.gm.code and "relu.view(size_here, 2, -1)" in s1.gm.code
    for batch in (x, torch.randn(3, 6), torch.randn(1, 6)):
        torch.testing.assert_close(run_stages([s0, s1], (batch,)), model(batch), rtol=0, atol=0)


class MaskedStack(nn.Module):
    """Two layers reading one mask and one position table made from the input ids alone, as a
    decoder's layers read its attention mask and rotary tables. ``variant``: "dropout" drops
    out of the mask (a value made again would differ), "write" writes into it in place,
    "inplace" through an op named like any other but called with ``inplace=True``."""

    def __init__(self, variant: str = "") -> None:
        super().__init__()
        self.emb, self.a, self.b = nn.Embedding(10, 4), nn.Linear(4, 4), nn.Linear(4, 4)
        self.variant = variant

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        keep = (ids != 0).unsqueeze(-1).float()
        if self.variant == "dropout":
            keep = torch.nn.functional.dropout(keep, 0.5, training=True)
        if self.variant == "write":
            keep.mul_(0.5)
        if self.variant == "inplace":
            keep = torch.nn.functional.relu(keep, inplace=True)
        pos = torch.arange(ids.size(1)).float().unsqueeze(-1) / 10
        h = self.a(self.emb(ids) + pos) * keep
        return self.b(h) * keep + pos


def _two_stages(gm: fx.GraphModule) -> dict[str, int]:
    """Everything up to the first layer's product on stage 0, the second layer on stage 1."""
    second = False
    stage_of = {}
    for n in placed_nodes(gm):
        second = second or n.name == "b"
        stage_of[n.name] = int(second)
    return stage_of


def test_a_mask_made_from_the_inputs_is_made_again_where_it_is_read_not_sent() -> None:
    """Stage 1 reads the mask and the position table: it makes both from the ids it reads,
    so stage 0 sends only its layer's output; outputs and gradients equal the model's, for
    any batch and sequence length."""
    torch.manual_seed(0)
    model = MaskedStack()
    x = torch.randint(0, 10, (3, 5))
    gm = annotate(fx.symbolic_trace(model), x)
    stage_of = _two_stages(gm)
    s0, s1 = _check(model, gm, (x,), stage_of, lambda: model(x))
    assert (s0.outputs, s1.inputs, s1.sources) == (("mul",), ("ids", "mul"), (MODEL, 0))
    assert "float_1_here" in s1.gm.code and "truediv_here" in s1.gm.code
    for ids in (torch.randint(0, 10, (2, 7)), torch.randint(0, 10, (1, 3))):
        torch.testing.assert_close(run_stages([s0, s1], (ids,)), model(ids), rtol=0, atol=0)


@pytest.mark.parametrize("variant", ["dropout", "write", "inplace"])
def test_a_mask_dropped_out_or_written_into_is_sent(variant: str) -> None:
    """Made again, a dropped-out mask would draw other elements, and a mask written into in
    place would miss the write: stage 0 sends its own. The position table is still made again
    beside the dropout; beside the write it is sent too (the write may reach the ids through
    views, and the table is made from them)."""
    model = MaskedStack(variant)
    x = torch.randint(0, 10, (3, 5))
    gm = fx.symbolic_trace(model)
    s0, s1 = split_graph(annotate(gm, x), _two_stages(gm))
    sent = {"dropout": {"dropout"}, "write": {"float_1", "truediv"},
            "inplace": {"relu", "truediv"}}[variant]
    made_again = variant == "dropout"
    assert set(s0.outputs) == {"mul", *sent}
    assert set(s1.inputs) == {"mul", *sent} | ({"ids"} if made_again else set())
    assert ("truediv_here" in s1.gm.code) is made_again
    if variant != "dropout":
        torch.testing.assert_close(run_stages([s0, s1], (x,)), model(x), rtol=0, atol=0)


def test_unsendable_crossing_raises() -> None:
    model, x = TinyGPT(), torch.randint(0, 50, (2, 8))
    gm = annotate(fx.symbolic_trace(model), x)
    stage_of = chunk_stage_of(gm, 1)
    split = next(n for n in gm.graph.nodes if n.op == "call_method" and n.target == "split")
    late = {n.name for n in gm.graph.nodes if n.name in stage_of
            and list(gm.graph.nodes).index(n) > list(gm.graph.nodes).index(split)}
    stage_of.update({k: 1 for k in late})
    with pytest.raises(ConfigError, match=split.name):
        split_graph(gm, stage_of)


@pytest.mark.parametrize("bad, match", [
    ({"x": 0, "a": 0, "relu": 0, "b": 1, "c": 2}, "add"),             # missing node
    ({"x": 0, "a": 0, "relu": 0, "b": 1, "c": 3, "add": 3}, "contiguous"),
    ({"x": 0, "a": 1, "relu": 0, "b": 1, "c": 1, "add": 1}, "relu"),  # input in a later stage
    ({"x": 0, "a": 0, "relu": 0, "b": 0, "c": 0, "add": 0, "zzz": 0}, "zzz"),
    ({"x": 0, "a": 0, "relu": 0, "b": 0, "c": 0, "add": -1}, "add"),
])
def test_invalid_stage_of(bad: dict[str, int], match: str) -> None:
    with pytest.raises(FxpipeError, match=match):
        split_graph(fx.symbolic_trace(Skip()), bad)


class Attn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(16)
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> dict[str, Any]:
        h = self.ln(x)
        a, _ = self.attn(h, h, h, need_weights=False)
        y = x + a
        return {"y": y + self.mlp(y) * scale, "aux": (a.mean(), h)}


@pytest.mark.parametrize("num_stages", [2, 4])
def test_torch_export_graph(num_stages: int) -> None:
    model = Attn()
    x, scale = torch.randn(2, 5, 16), torch.tensor(0.5)
    gm = torch.export.export(model, (x,), {"scale": scale}, strict=False).module()
    annotate(gm, x, scale)
    stage_of = chunk_stage_of(gm, num_stages)
    stages = _check(gm, gm, (x,), stage_of, lambda: gm(x, scale=scale), {"scale": scale})
    out = run_stages(stages, (x,), {"scale": scale})
    assert set(out) == {"y", "aux"} and isinstance(out["aux"], tuple)


def test_hf_gpt2_export() -> None:
    import transformers  # a dev dependency: a failed import must fail, not skip
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=32,
                                  use_cache=False)
    model = transformers.GPT2LMHeadModel(cfg).eval()  # no dropout: exact comparison
    ids = torch.randint(0, 100, (2, 8))
    gm = torch.export.export(model, (ids,), strict=False).module()
    stage_of = chunk_stage_of(gm, 3)  # no fxpipe meta: falls back on torch.export's meta["val"]
    stages = _check(gm, gm, (ids,), stage_of, lambda: gm(ids))
    assert type(run_stages(stages, (ids,))).__name__ == "CausalLMOutputWithCrossAttentions"


def test_export_guard_node_may_be_listed() -> None:
    gm = torch.export.export(Skip(), (torch.randn(2, 4),), strict=False).module()
    stage_of = chunk_stage_of(gm, 2)
    guard = [n.name for n in gm.graph.nodes if n.op == "call_module" and n.target == "_guards_fn"]
    stages = split_graph(gm, {**stage_of, **{g: 0 for g in guard}})
    x = torch.randn(2, 4)
    torch.testing.assert_close(run_stages(stages, (x,)), gm(x), rtol=0, atol=0)
