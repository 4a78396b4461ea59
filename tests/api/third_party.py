"""Models nobody here wrote, from tiny configs: Hugging Face architectures and torch.nn's own
attention, transformer and LSTM layers (dropout off, so two runs compute the same numbers).

Each case gives a seeded model and a batch maker. Hugging Face cases pass ``labels`` among the
keyword inputs and train on the model's own loss; the torch.nn cases take positional inputs, a
target and a loss function.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

V = 64  # vocabulary of the language models


@dataclass
class Case:
    model: nn.Module
    make: Callable[[torch.Generator], tuple[Any, Any]]  # -> (inputs: tuple or dict, target)
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None

    def batch(self, seed: int) -> tuple[Any, Any]:
        return self.make(torch.Generator().manual_seed(seed))


def _hf(name: str, cfg: Any) -> nn.Module:
    import transformers

    torch.manual_seed(0)
    return getattr(transformers, name)(cfg)


def _lm(model: nn.Module) -> Case:
    def make(g: torch.Generator) -> tuple[dict[str, torch.Tensor], None]:
        ids = torch.randint(0, V, (2, 8), generator=g)
        return {"input_ids": ids, "labels": ids}, None
    return Case(model, make)


def _classifier(model: nn.Module, classes: int = 3) -> Case:
    def make(g: torch.Generator) -> tuple[dict[str, torch.Tensor], None]:
        return {"input_ids": torch.randint(0, V, (2, 8), generator=g),
                "labels": torch.randint(0, classes, (2,), generator=g)}, None
    return Case(model, make)


def _seq2seq(model: nn.Module) -> Case:
    def make(g: torch.Generator) -> tuple[dict[str, torch.Tensor], None]:
        return {"input_ids": torch.randint(3, V, (2, 8), generator=g),
                "labels": torch.randint(3, V, (2, 6), generator=g)}, None
    return Case(model, make)


def gpt2() -> Case:
    import transformers
    return _lm(_hf("GPT2LMHeadModel", transformers.GPT2Config(
        vocab_size=V, n_embd=32, n_layer=2, n_head=2, n_positions=32, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0)))


def llama() -> Case:
    import transformers
    return _lm(_hf("LlamaForCausalLM", transformers.LlamaConfig(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)))


def mistral() -> Case:
    import transformers
    return _lm(_hf("MistralForCausalLM", transformers.MistralConfig(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)))


def qwen2() -> Case:
    import transformers
    return _lm(_hf("Qwen2ForCausalLM", transformers.Qwen2Config(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)))


def mixtral() -> Case:
    """Mixture of experts with transformers' default experts implementation (routing through
    ``argmax``/``histc`` indices: integer values in the middle of the graph)."""
    import transformers
    return _lm(_hf("MixtralForCausalLM", transformers.MixtralConfig(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        num_local_experts=4, num_experts_per_tok=2)))


def qwen2_moe() -> Case:
    import transformers
    return _lm(_hf("Qwen2MoeForCausalLM", transformers.Qwen2MoeConfig(
        vocab_size=V, hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
        shared_expert_intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, num_experts=4,
        num_experts_per_tok=2)))


def gpt_neox() -> Case:
    import transformers
    return _lm(_hf("GPTNeoXForCausalLM", transformers.GPTNeoXConfig(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=32, hidden_dropout=0.0,
        attention_dropout=0.0)))


def bert() -> Case:
    import transformers
    return _classifier(_hf("BertForSequenceClassification", transformers.BertConfig(
        vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=32, num_labels=3,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)))


def distilbert() -> Case:
    import transformers
    return _lm(_hf("DistilBertForMaskedLM", transformers.DistilBertConfig(
        vocab_size=V, dim=32, n_layers=2, n_heads=2, hidden_dim=64, max_position_embeddings=32,
        dropout=0.0, attention_dropout=0.0)))


def t5() -> Case:
    import transformers
    return _seq2seq(_hf("T5ForConditionalGeneration", transformers.T5Config(
        vocab_size=V, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, dropout_rate=0.0,
        decoder_start_token_id=0, pad_token_id=0)))


def bart() -> Case:
    import transformers
    return _seq2seq(_hf("BartForConditionalGeneration", transformers.BartConfig(
        vocab_size=V, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64,
        max_position_embeddings=32, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)))


def whisper() -> Case:
    import transformers
    model = _hf("WhisperForConditionalGeneration", transformers.WhisperConfig(
        vocab_size=V, num_mel_bins=8, encoder_layers=1, decoder_layers=1,
        encoder_attention_heads=2, decoder_attention_heads=2, d_model=32, encoder_ffn_dim=64,
        decoder_ffn_dim=64, max_source_positions=8, max_target_positions=16, pad_token_id=0,
        bos_token_id=1, eos_token_id=2, decoder_start_token_id=1, dropout=0.0,
        attention_dropout=0.0, activation_dropout=0.0))

    def make(g: torch.Generator) -> tuple[dict[str, torch.Tensor], None]:
        return {"input_features": torch.randn(2, 8, 16, generator=g),
                "labels": torch.randint(3, V, (2, 5), generator=g)}, None
    return Case(model, make)


def vit() -> Case:
    import transformers
    model = _hf("ViTForImageClassification", transformers.ViTConfig(
        image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2,
        num_attention_heads=2, intermediate_size=64, num_labels=3, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0))

    def make(g: torch.Generator) -> tuple[dict[str, torch.Tensor], None]:
        return {"pixel_values": torch.randn(2, 3, 16, 16, generator=g),
                "labels": torch.randint(0, 3, (2,), generator=g)}, None
    return Case(model, make)


class _Attention(nn.Module):
    """torch.nn.MultiheadAttention between two linear layers."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 16)
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
        self.out = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.inp(x))
        h, _ = self.attn(h, h, h, need_weights=False)
        return self.out(h).mean(1)


class _Encoder(nn.Module):
    """Two torch.nn.TransformerEncoderLayers and a classifier."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, 16)
        self.layers = nn.ModuleList(nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0,
                                                               batch_first=True)
                                    for _ in range(2))
        self.head = nn.Linear(16, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        for layer in self.layers:
            h = layer(h)
        return self.head(h.mean(1))


class _Recurrent(nn.Module):
    """An LSTM language model: embedding, two-layer LSTM, vocabulary projection."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, 16)
        self.rnn = nn.LSTM(16, 24, num_layers=2, batch_first=True)
        self.proj = nn.Linear(24, V)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h, _ = self.rnn(self.emb(ids))
        return self.proj(h)


def _torch_case(model: nn.Module, make: Callable[[torch.Generator], tuple[Any, Any]],
                loss_fn: Callable[[Any, Any], torch.Tensor]) -> Case:
    return Case(model, make, loss_fn)


def mha() -> Case:
    torch.manual_seed(0)
    return _torch_case(_Attention(), lambda g: ((torch.randn(2, 5, 16, generator=g),),
                                                torch.randint(0, 4, (2,), generator=g)),
                       F.cross_entropy)


def transformer_encoder() -> Case:
    torch.manual_seed(0)
    return _torch_case(_Encoder(), lambda g: ((torch.randint(0, V, (2, 6), generator=g),),
                                              torch.randint(0, 4, (2,), generator=g)),
                       F.cross_entropy)


def lstm() -> Case:
    torch.manual_seed(0)

    def make(g: torch.Generator) -> tuple[tuple[torch.Tensor], torch.Tensor]:
        ids = torch.randint(0, V, (2, 7), generator=g)
        return (ids[:, :-1],), ids[:, 1:]
    return _torch_case(_Recurrent(), make,
                       lambda out, y: F.cross_entropy(out.reshape(-1, V), y.reshape(-1)))


CASES: dict[str, Callable[[], Case]] = {
    "gpt2": gpt2, "llama": llama, "mistral": mistral, "qwen2": qwen2, "gpt_neox": gpt_neox,
    "mixtral": mixtral, "qwen2_moe": qwen2_moe,
    "bert": bert, "distilbert": distilbert, "t5": t5, "bart": bart, "whisper": whisper,
    "vit": vit, "nn_mha": mha, "nn_transformer_encoder": transformer_encoder, "nn_lstm": lstm,
}
