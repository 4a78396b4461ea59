"""Named parameters for the optimizer factory, to build groups as for the unsplit model.

A factory with a ``names`` keyword gets each tensor's name in the model, so groups can follow
nanoGPT and the Hugging Face Trainer (no weight decay on biases and norms:
:func:`weight_decay_groups`); a tied parameter has one name on every stage holding it."""
from __future__ import annotations

import inspect
import logging
import re
from typing import Any, Callable, Mapping, Sequence

import torch

from fxpipe.codegen.split import StageSpec

from ..errors import RuntimeConfigError
from ..replica.stage import tied_parameters

log = logging.getLogger(__name__)

NORM_TYPES = (torch.nn.LayerNorm, torch.nn.GroupNorm, torch.nn.BatchNorm1d, torch.nn.BatchNorm2d,
              torch.nn.BatchNorm3d, torch.nn.RMSNorm)


def takes_names(factory: Callable[..., Any]) -> bool:
    """Whether the optimizer factory declares a ``names`` parameter."""
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return False
    p = params.get("names")
    return p is not None and p.kind is not inspect.Parameter.POSITIONAL_ONLY


def model_names(stages: Sequence[StageSpec],
                state_keys: Mapping[str, tuple[int, str] | torch.Tensor] | None
                ) -> dict[int, list[str]]:
    """Per stage, the model-level name of each trainable parameter, in the order the stage's
    optimizer receives them (``named_parameters()`` of the stage, trainable only)."""
    first: dict[tuple[int, str], str] = {}
    for key, where in (state_keys or {}).items():
        if isinstance(where, tuple):
            first.setdefault(where, key)
    alias: dict[tuple[int, str], tuple[int, str]] = {}
    for t in tied_parameters(stages):
        low = min(t.names)
        for s, n in t.names.items():
            alias[(s, n)] = (low, t.names[low])
    out: dict[int, list[str]] = {}
    for st in stages:
        names = []
        for n, p in st.gm.named_parameters():
            if not p.requires_grad:
                continue
            home = alias.get((st.index, n), (st.index, n))
            names.append(first.get(home, home[1]))
        out[st.index] = names
    return out


class NamedFactory:
    """The user's factory, given ``names=`` for the stage it is called for (picklable when the
    user's factory is). Takes ``stage`` and ``delay`` so that :func:`bind_optimizer` passes
    them; forwards them when the user's factory takes them."""

    def __init__(self, factory: Callable[..., torch.optim.Optimizer],
                 names: Mapping[int, Sequence[str]]) -> None:
        from ..replica.mitigation import accepted_keywords

        self.factory, self.names = factory, {s: list(v) for s, v in names.items()}
        self.keywords = accepted_keywords(factory)

    def __call__(self, params: list[torch.Tensor], stage: int = 0,
                 delay: int = 0) -> torch.optim.Optimizer:
        names = self.names[stage]
        if len(names) != len(params):
            raise RuntimeConfigError(f"stage {stage}: {len(params)} parameters but {len(names)} "
                                     "names", "a bug: the stage's parameters changed after the "
                                     "trainer was made")
        kw = {k: v for k, v in (("stage", stage), ("delay", delay)) if k in self.keywords}
        return self.factory(params, names=list(names), **kw)


class SameAs:
    """An optimizer factory that makes, for each stage, an optimizer of the class and defaults
    of ``optimizer`` (an instance the user made over the whole model's parameters)."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.cls, self.defaults = type(optimizer), dict(optimizer.defaults)

    def __call__(self, params: list[torch.Tensor]) -> torch.optim.Optimizer:
        return self.cls(params, **self.defaults)

    def __repr__(self) -> str:
        return f"{self.cls.__name__}({', '.join(f'{k}={v!r}' for k, v in self.defaults.items())})"


def as_factory(optimizer: Any) -> Callable[..., torch.optim.Optimizer]:
    """The trainer's ``optimizer``: a factory ``params -> torch.optim.Optimizer`` (fxpipe makes
    one optimizer per stage replica, over that stage's parameters), or an optimizer instance,
    taken as the factory of its class with its defaults (its parameters and state are not used).
    A class is a factory too (``torch.optim.SGD``: its own defaults). Refused, naming the
    factory it needs: an instance whose parameter groups differ in their options (a factory
    with ``names=`` builds such groups per stage), or anything not callable."""
    hint = ("pass a factory that makes the optimizer for the parameters it is given, e.g. "
            "optimizer=lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9)")
    if isinstance(optimizer, torch.optim.Optimizer):
        options = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        if any(o != options[0] for o in options[1:]):
            raise RuntimeConfigError(
                f"optimizer={type(optimizer).__name__} instance with {len(options)} parameter "
                "groups of different options: fxpipe makes one optimizer per stage and cannot "
                "tell which of a stage's parameters go in which group",
                hint + "; a factory with a names= parameter receives the model's names of the "
                "stage's parameters to group them (fxpipe.runtime.weight_decay_groups)")
        made = SameAs(optimizer)
        log.warning("optimizer=%s instance: each stage gets its own %r over its parameters; the "
                    "instance itself is not stepped (pass a factory to say so explicitly)",
                    type(optimizer).__name__, made)
        return made
    if not callable(optimizer):
        raise RuntimeConfigError(f"optimizer={optimizer!r} is not an optimizer factory", hint)
    return optimizer


def wrap_factory(factory: Callable[..., torch.optim.Optimizer], stages: Sequence[StageSpec],
                 state_keys: Mapping[str, tuple[int, str] | torch.Tensor] | None
                 ) -> Callable[..., torch.optim.Optimizer]:
    """``factory`` as is, or a :class:`NamedFactory` when it takes ``names``."""
    return NamedFactory(factory, model_names(stages, state_keys)) if takes_names(factory) \
        else factory


def no_decay_names(model: torch.nn.Module) -> set[str]:
    """Names of ``model``'s parameters the HF Trainer exempts from weight decay: biases and the
    weights of normalisation layers (for a model at hand; see :func:`weight_decay_groups`)."""
    out = set()
    for mname, mod in model.named_modules():
        for pname, _ in mod.named_parameters(recurse=False):
            full = f"{mname}.{pname}" if mname else pname
            if pname == "bias" or isinstance(mod, NORM_TYPES):
                out.add(full)
    return out


def weight_decay_groups(params: Sequence[torch.Tensor], names: Sequence[str],
                        weight_decay: float,
                        exempt: Callable[[str, torch.Tensor], bool] | None = None
                        ) -> list[dict[str, Any]]:
    """Two parameter groups: ``exempt(name, tensor)`` True -> no weight decay. Default:
    nanoGPT's rule (tensors of fewer than 2 dimensions: biases, norm weights). Empty groups
    are left out."""
    rule = exempt or (lambda _n, p: p.dim() < 2)
    decay = [p for p, n in zip(params, names) if not rule(n, p)]
    rest = [p for p, n in zip(params, names) if rule(n, p)]
    groups = [{"params": decay, "weight_decay": weight_decay},
              {"params": rest, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


EMBEDDING_OR_HEAD = re.compile(
    r"(^|\.)(wte|wpe|lm_head|head|classifier|score|emb[a-z_]*|[a-z_]*_emb[a-z_]*"
    r"|[a-z_]*embeddings?)(\.|$)", re.IGNORECASE)
"""Name segments of embeddings (GPT-2's ``wte``/``wpe``, Llama's ``embed_tokens``, BERT's
``word_embeddings``, ...) and output heads (``lm_head``, ``head``, ``classifier``, ``score``):
2-D tensors that Muon is not for (Jordan's Muon post: AdamW for embeddings and the head)."""


def muon_exempt(name: str, tensor: torch.Tensor) -> bool:
    """The default rule of :func:`muon_groups`: True (the element-wise optimizer) for a tensor
    that is not 2-D or whose name says embedding or head."""
    return tensor.dim() != 2 or EMBEDDING_OR_HEAD.search(name) is not None


def embedding_and_head_names(model: torch.nn.Module) -> set[str]:
    """Names of ``model``'s embedding weights and of its last ``nn.Linear``'s weight (the head,
    in module order), whatever they are called: for a model whose names do not say (an
    ``nn.Sequential`` MLP's head is ``"4.weight"``). A tied tensor's every name is included."""
    out: set[str] = set()
    last = None
    for mname, mod in model.named_modules():
        if isinstance(mod, torch.nn.Embedding):
            out.add(f"{mname}.weight" if mname else "weight")
        elif isinstance(mod, torch.nn.Linear):
            last = f"{mname}.weight" if mname else "weight"
    if last is not None:
        out.add(last)
    chosen = {id(p) for n, p in model.named_parameters(remove_duplicate=False) if n in out}
    return out | {n for n, p in model.named_parameters(remove_duplicate=False) if id(p) in chosen}


def muon_groups(params: Sequence[torch.Tensor], names: Sequence[str], weight_decay: float = 0.0,
                exempt: Callable[[str, torch.Tensor], bool] | None = None
                ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``(muon, other)`` param groups: Muon's, the 2-D hidden matrices (weight decay
    ``weight_decay``); the element-wise optimizer's, everything ``exempt(name, tensor)`` (default
    :func:`muon_exempt`) sends there, split by :func:`weight_decay_groups` (no decay on tensors
    of fewer than 2 dimensions). Feed them to
    :class:`fxpipe.runtime.replica.muon.MuonWithAdamW`. Empty groups are left out."""
    rule = exempt or muon_exempt
    hidden = [p for p, n in zip(params, names) if not rule(n, p)]
    rest = [(p, n) for p, n in zip(params, names) if rule(n, p)]
    muon = [{"params": hidden, "weight_decay": weight_decay}] if hidden else []
    other = weight_decay_groups([p for p, _ in rest], [n for _, n in rest], weight_decay)
    return muon, other
