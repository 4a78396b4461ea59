"""fxpipe model zoo: the PipeDream paper's workloads, written plainly, in two sizes.

``get(name, size="mini"|"full")`` builds a seeded :class:`ModelSpec` (the caller's RNG untouched);
``resolve`` adds ``hf:`` names (``hf``) and ``file.py:factory``. Models: ``cnn`` (VGG16, AlexNet),
``resnet``, ``inception``, ``gpt``, ``s2vt``, ``reuse`` (tests); ``pipedream``: published profiles.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from fxpipe.errors import ConfigError

from .cnn import VGG16, AlexNet
from .gpt import GPT
from .inception import InceptionV3
from .resnet import ResNet50
from .reuse import ReuseNet
from .s2vt import S2VT

__all__ = ["ModelSpec", "get", "names", "resolve", "SIZES"]

SIZES = ("mini", "full")
Batch = tuple[tuple[torch.Tensor, ...], torch.Tensor]


@dataclass
class ModelSpec:
    """A model plus everything needed to train it: example inputs, a loss and a batch maker."""

    name: str
    size: str
    model: nn.Module
    example_inputs: Any  # a tuple of positional inputs, or a dict of keyword inputs
    loss_fn: Callable[[Any, Any], torch.Tensor] | None  # None: the model computes its own
    make_batch: Callable[..., Any] | None  # (batch_size, seed) -> (inputs, target)
    batch_size: int
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def num_params(self) -> int:
        """Distinct parameters (a tied weight counts once)."""
        return sum(p.numel() for p in self.model.parameters())


def _classification_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output, target)


def _sequence_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.reshape(-1, output.size(-1)), target.reshape(-1))


def _image_batches(side: int, classes: int) -> Callable[..., Batch]:
    def make_batch(batch_size: int, seed: int = 0) -> Batch:
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(batch_size, 3, side, side, generator=g)
        return (x,), torch.randint(0, classes, (batch_size,), generator=g)
    return make_batch


def _vector_batches(dim: int, classes: int) -> Callable[..., Batch]:
    def make_batch(batch_size: int, seed: int = 0) -> Batch:
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(batch_size, dim, generator=g)
        return (x,), torch.randint(0, classes, (batch_size,), generator=g)
    return make_batch


def _token_batches(seq: int, vocab: int) -> Callable[..., Batch]:
    def make_batch(batch_size: int, seed: int = 0) -> Batch:
        g = torch.Generator().manual_seed(seed)
        tokens = torch.randint(0, vocab, (batch_size, seq + 1), generator=g)
        return (tokens[:, :-1].contiguous(),), tokens[:, 1:].contiguous()  # next-token targets
    return make_batch


def _video_batches(frames: int, feat: int, words: int, vocab: int) -> Callable[..., Batch]:
    def make_batch(batch_size: int, seed: int = 0) -> Batch:
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(batch_size, frames, feat, generator=g)
        caption = torch.randint(0, vocab, (batch_size, words + 1), generator=g)
        return (x, caption[:, :-1].contiguous()), caption[:, 1:].contiguous()
    return make_batch


# name -> size -> (builder, make_batch, loss, default batch size, info)
_Entry = tuple[Callable[[], nn.Module], Callable[..., Batch], Callable[..., torch.Tensor], int,
               dict[str, Any]]


def _registry() -> dict[str, dict[str, _Entry]]:
    cls, seq = _classification_loss, _sequence_loss
    return {
        "alexnet": {
            "mini": (lambda: AlexNet(num_classes=10, width_div=8, pool_out=2, hidden=256),
                     _image_batches(64, 10), cls, 4, {"image": 64}),
            "full": (lambda: AlexNet(), _image_batches(224, 1000), cls, 128, {"image": 224}),
        },
        "gpt": {
            "mini": (lambda: GPT(vocab_size=128, block_size=32, n_layer=12, n_head=4, n_embd=32),
                     _token_batches(16, 128), seq, 4, {"seq": 16}),
            "full": (lambda: GPT(), _token_batches(1024, 50257), seq, 8, {"seq": 1024}),
        },
        "inception": {
            "mini": (lambda: InceptionV3(num_classes=10, width_div=8),
                     _image_batches(75, 10), cls, 4, {"image": 75}),
            "full": (lambda: InceptionV3(), _image_batches(299, 1000), cls, 64, {"image": 299}),
        },
        "resnet50": {
            "mini": (lambda: ResNet50(num_classes=10, width_div=8),
                     _image_batches(64, 10), cls, 4, {"image": 64}),
            "full": (lambda: ResNet50(), _image_batches(224, 1000), cls, 64, {"image": 224}),
        },
        "reuse": {
            "mini": (lambda: ReuseNet(8, 16, 4), _vector_batches(8, 4), cls, 4, {}),
            "full": (lambda: ReuseNet(256, 1024, 10), _vector_batches(256, 10), cls, 64, {}),
        },
        "s2vt": {
            "mini": (lambda: S2VT(feature_dim=64, hidden=32, embed=16, vocab_size=50),
                     _video_batches(8, 64, 6, 50), seq, 4, {"frames": 8, "words": 6}),
            "full": (lambda: S2VT(), _video_batches(80, 4096, 20, 12594), seq, 80,
                     {"frames": 80, "words": 20}),
        },
        "vgg16": {
            "mini": (lambda: VGG16(num_classes=10, width_div=8, image_size=32, hidden=512),
                     _image_batches(32, 10), cls, 4, {"image": 32}),
            "full": (lambda: VGG16(), _image_batches(224, 1000), cls, 64, {"image": 224}),
        },
    }


_REGISTRY = _registry()
# The paper workloads; "reuse" is a test model, still reachable through get().
_PAPER_MODELS = ["alexnet", "gpt", "inception", "resnet50", "s2vt", "vgg16"]


def names(include_test_models: bool = False) -> list[str]:
    """Names of the zoo's models, sorted (the tiny test model "reuse" only on request)."""
    return sorted(_REGISTRY) if include_test_models else list(_PAPER_MODELS)


def get(name: str, size: str = "mini", batch_size: int | None = None, seed: int = 0) -> ModelSpec:
    """Build model ``name`` at ``size`` with seeded weights and example inputs of ``batch_size``."""
    if name not in _REGISTRY:
        raise ConfigError(f"unknown model {name!r}; known models: {', '.join(sorted(_REGISTRY))}",
                          hint="pick one of the names above (fxpipe.models.names())")
    if size not in SIZES:
        raise ConfigError(f"unknown model size {size!r}; known sizes: {', '.join(SIZES)}",
                          hint='use size="mini" for quick runs, "full" for the paper sizes')
    if batch_size is not None and (not isinstance(batch_size, int) or batch_size < 1):
        raise ConfigError(f"batch_size must be a positive integer, got {batch_size!r}",
                          hint="pass e.g. batch_size=8, or None for the model's default")
    build, make_batch, loss, default_batch, info = _REGISTRY[name][size]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = build()
    bs = default_batch if batch_size is None else batch_size
    inputs, _ = make_batch(bs, seed=seed)
    return ModelSpec(name=name, size=size, model=model, example_inputs=inputs, loss_fn=loss,
                     make_batch=make_batch, batch_size=bs, info=dict(info))


def resolve(name: str, *, size: str = "mini", batch_size: int | None = None, seed: int = 0,
            seq_len: int = 128, meta: bool = False, input_shape: tuple[int, ...] | None = None
            ) -> ModelSpec:
    """What the ``fxpipe`` command's MODEL names: a zoo name, ``hf:<Class>[:key=value,...]``
    (a Hugging Face architecture from its config, see :mod:`fxpipe.models.hf`; ``meta``: on the
    meta device, ``seq_len`` tokens per sample), or ``file.py:factory`` where ``factory()``
    returns a :class:`ModelSpec`, ``(model, example_inputs)``, or a bare module (then
    ``input_shape`` makes its one random input)."""
    from . import hf

    if name.startswith(hf.PREFIX):
        model = hf.build(name, meta=meta, seed=seed)
        make_batch = hf.batch_maker(model, seq_len)
        bs = batch_size or 8
        inputs, _ = make_batch(bs, seed=seed)
        return ModelSpec(name=name, size="custom", model=model, example_inputs=inputs,
                         loss_fn=None, make_batch=make_batch, batch_size=bs,
                         info={"seq": seq_len, "meta": meta})
    if meta:
        raise ConfigError(f"--meta applies to hf: models, not {name!r}",
                          "for your own model, build it under `with torch.device('meta'):` in "
                          "a file.py:factory")
    path, sep, factory = name.rpartition(":")
    if sep and path.endswith(".py"):
        return _from_factory(name, path, factory, input_shape)
    return get(name, size=size, batch_size=batch_size, seed=seed)


def load_factory(path: str, name: str, *, kind: str, file_hint: str,
                 callable_hint: str) -> Callable[[], Any]:
    """The callable ``name`` of the Python file ``path`` (a user's ``file.py:factory``, for a
    model or for data), with a clear ConfigError when the file or the callable is missing."""
    import importlib.util
    from pathlib import Path

    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"{kind} file {path!r} does not exist", file_hint)
    mod_spec = importlib.util.spec_from_file_location(file.stem, file)
    assert mod_spec is not None and mod_spec.loader is not None
    module = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(module)
    factory = getattr(module, name, None)
    if not callable(factory):
        raise ConfigError(f"{path!r} has no callable {name!r}", callable_hint)
    return factory


def _from_factory(spec: str, path: str, name: str,
                  input_shape: tuple[int, ...] | None) -> ModelSpec:
    factory = load_factory(path, name, kind="model",
                           file_hint="MODEL is a zoo name, hf:Class or file.py:factory",
                           callable_hint="MODEL is file.py:factory where factory() returns a "
                                         "model")
    made = factory()
    if isinstance(made, ModelSpec):
        return made
    if isinstance(made, tuple) and len(made) == 2 and isinstance(made[0], nn.Module):
        model, inputs = made
        inputs = inputs if isinstance(inputs, (tuple, dict)) else (inputs,)
    elif isinstance(made, nn.Module):
        if not input_shape:
            raise ConfigError("the factory returned a bare module, so fxpipe needs --input-shape",
                              "e.g. --input-shape 32,3,224,224, or return (model, example_inputs)")
        model, inputs = made, (torch.randn(*input_shape),)
    else:
        raise ConfigError(f"the factory returned {type(made).__name__}",
                          "return an fxpipe.models.ModelSpec, (model, example_inputs) or an "
                          "nn.Module")
    return ModelSpec(name=spec, size="custom", model=model, example_inputs=inputs, loss_fn=None,
                     make_batch=None, batch_size=_first_dim(inputs))


def _first_dim(inputs: Any) -> int:
    values = inputs.values() if isinstance(inputs, dict) else inputs
    return next((int(x.shape[0]) for x in values if isinstance(x, torch.Tensor) and x.dim()), 1)
