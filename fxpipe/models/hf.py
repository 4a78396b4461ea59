"""Hugging Face architectures by class name, from a config with overrides: no downloads.

    fxpipe plan "hf:LlamaForCausalLM:hidden_size=4096,intermediate_size=11008,num_hidden_layers=32" \
        --meta --device A100 --workers 8 --seq-len 2048

``hf:<Class>[:key=value,...]`` builds ``transformers.<Class>(<Class>.config_class(**overrides))``
(on the meta device with ``meta=True``: shapes only, enough to trace and plan a model that does
not fit in memory) and batches a model of that kind takes: token ids for language models,
``pixel_values`` for vision models, ``input_features`` for speech, ``labels`` where the head
computes a loss, so the model trains on its own loss.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from fxpipe.errors import ConfigError

PREFIX = "hf:"
Batch = tuple[dict[str, torch.Tensor], None]


def parse(spec: str) -> tuple[str, dict[str, Any]]:
    """``"hf:LlamaForCausalLM:hidden_size=64,tie_word_embeddings=true"`` ->
    ``("LlamaForCausalLM", {"hidden_size": 64, "tie_word_embeddings": True})``."""
    body = spec[len(PREFIX):] if spec.startswith(PREFIX) else spec
    name, _, rest = body.partition(":")
    overrides: dict[str, Any] = {}
    for item in filter(None, (x.strip() for x in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq or not key.strip().isidentifier():
            raise ConfigError(f"bad config override {item!r} in {spec!r}",
                              "write hf:Class:key=value,key=value (e.g. num_hidden_layers=2)")
        overrides[key.strip()] = _value(value.strip())
    return name, overrides


def _value(text: str) -> Any:
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def build(spec: str, *, meta: bool = False, seed: int = 0) -> torch.nn.Module:
    """The model ``spec`` names (see the module doc), weights seeded, or on the meta device."""
    try:
        import transformers
    except ImportError as err:
        raise ConfigError("hf: models need the package transformers, which is not installed",
                          "pip install transformers") from err
    # a config shrunk from the command line trips warnings about ids outside the vocabulary
    # that mean nothing for planning or synthetic training
    transformers.utils.logging.set_verbosity_error()
    name, overrides = parse(spec)
    cls = getattr(transformers, name, None)
    config_class = getattr(cls, "config_class", None)
    if cls is None or config_class is None:
        raise ConfigError(f"transformers has no model class {name!r}",
                          "use a class name such as LlamaForCausalLM, BertForMaskedLM, "
                          "T5ForConditionalGeneration, ViTForImageClassification")
    try:
        config = config_class(**overrides)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"{config_class.__name__} rejects {overrides}: {err}",
                          "check the override names against the config class") from err
    if getattr(config, "is_encoder_decoder", False) and \
            getattr(config, "decoder_start_token_id", None) is None:
        # a bare config (T5's) has none; the hub's checkpoints start decoding at the pad token
        pad = getattr(config, "pad_token_id", None)
        config.decoder_start_token_id = 0 if pad is None else pad
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if meta:
            with torch.device("meta"):
                return cls(config)
        return cls(config)


def batch_maker(model: torch.nn.Module, seq_len: int) -> Callable[..., Batch]:
    """``make_batch(batch_size, seed) -> ({input: tensor, ...}, None)`` for ``model``'s kind:
    its main input, a decoder input where it needs one, and labels where its head has a loss."""
    cfg = model.config
    main = getattr(model, "main_input_name", "input_ids")
    name = type(model).__name__
    vocab = int(getattr(cfg, "vocab_size", 0) or 0)
    encoder_decoder = bool(getattr(cfg, "is_encoder_decoder", False))

    def tokens(g: torch.Generator, *shape: int) -> torch.Tensor:
        if vocab < 2:
            raise ConfigError(f"{name} has no vocab_size", "pass vocab_size=... in the spec")
        return torch.randint(0, vocab, shape, generator=g)

    def make_batch(batch_size: int, seed: int = 0) -> Batch:
        g = torch.Generator().manual_seed(seed)
        batch: dict[str, torch.Tensor] = {}
        if main == "input_ids":
            batch["input_ids"] = tokens(g, batch_size, seq_len)
        elif main == "pixel_values":
            side = int(getattr(cfg, "image_size", 224))
            batch["pixel_values"] = torch.randn(batch_size, int(getattr(cfg, "num_channels", 3)),
                                                side, side, generator=g)
        elif main == "input_features":  # Whisper: mel frames, twice the encoder positions
            frames = 2 * int(getattr(cfg, "max_source_positions", seq_len))
            batch["input_features"] = torch.randn(batch_size, int(cfg.num_mel_bins), frames,
                                                  generator=g)
        else:
            raise ConfigError(f"{name} takes {main!r}, which fxpipe cannot make up",
                              "write a file.py:factory returning (model, example_inputs)")
        if name.endswith(("ForSequenceClassification", "ForImageClassification")):
            labels = int(getattr(cfg, "num_labels", 2))
            batch["labels"] = torch.randint(0, labels, (batch_size,), generator=g)
        elif encoder_decoder and name.endswith(("ForConditionalGeneration", "ForSeq2SeqLM")):
            batch["labels"] = tokens(g, batch_size, max(2, seq_len // 2))
        elif name.endswith(("ForCausalLM", "LMHeadModel", "ForMaskedLM")):
            batch["labels"] = batch["input_ids"].clone()
        return batch, None

    return make_batch
