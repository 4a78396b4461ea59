"""Hugging Face models go through the torch.export fallback (symbolic_trace cannot take them)."""
from __future__ import annotations

import pytest
import torch

import transformers  # noqa: E402  (a dev dependency: missing means a broken install, not a skip)
from transformers.utils import logging as hf_logging  # noqa: E402

from fxpipe.tracing import trace  # noqa: E402

hf_logging.set_verbosity_error()


def _gpt2(use_cache: bool) -> torch.nn.Module:
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=32,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                  use_cache=use_cache)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg)


def _assert_identical_params(gm: torch.nn.Module, model: torch.nn.Module) -> None:
    mine = dict(model.named_parameters())
    theirs = dict(gm.named_parameters())
    assert list(theirs) == list(mine)
    assert [n for n, _ in gm.named_buffers()] == [n for n, _ in model.named_buffers()]
    for name, p in theirs.items():
        assert p is mine[name], name


@pytest.mark.parametrize("train", [True, False])
def test_gpt2_exports_with_identical_tied_parameters(train: bool) -> None:
    model = _gpt2(use_cache=False).train(train)
    x = torch.randint(0, 100, (2, 8))
    traced = trace(model, (x,))
    assert traced.method == "export"
    assert traced.input_names == ("input_ids",)
    _assert_identical_params(traced.gm, model)
    assert traced.gm.get_parameter("lm_head.weight") is \
        traced.gm.get_parameter("transformer.wte.weight")
    assert model.lm_head.weight is model.transformer.wte.weight
    attrs = [n.target for n in traced.gm.graph.nodes if n.op == "get_attr"]
    assert "transformer.wte.weight" in attrs and "lm_head.weight" not in attrs
    assert set(attrs) <= {n for n, _ in traced.gm.named_parameters()} | \
        {n for n, _ in traced.gm.named_buffers()}
    out, ref = traced.gm(x), model(x)
    assert type(out) is type(ref)
    torch.testing.assert_close(out.logits, ref.logits)
    for n in traced.gm.graph.nodes:
        if n.op != "output":
            assert "shape" in n.meta["fxpipe"], n.name
    out.logits.sum().backward()  # gradients land on the user's (tied) parameter
    assert model.transformer.wte.weight.grad is not None


def test_gpt2_with_use_cache_is_traced_without_cache() -> None:
    model = _gpt2(use_cache=True).eval()
    x = torch.randint(0, 100, (2, 8))
    traced = trace(model, (x,))
    assert traced.method == "export"
    assert model.config.use_cache is True  # restored after tracing
    out = traced.gm(x)
    assert "past_key_values" not in out
    torch.testing.assert_close(out.logits, model(x).logits)


def test_bert_classifier_exports() -> None:
    cfg = transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2,
                                  num_attention_heads=2, intermediate_size=64,
                                  max_position_embeddings=32, num_labels=3,
                                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(cfg).eval()
    ids = torch.randint(0, 100, (2, 8))
    mask = torch.ones(2, 8, dtype=torch.long)
    traced = trace(model, (ids, mask))
    assert traced.method == "export"
    assert traced.input_names == ("input_ids", "attention_mask")
    _assert_identical_params(traced.gm, model)
    torch.testing.assert_close(traced.gm(ids, mask).logits, model(ids, mask).logits)
