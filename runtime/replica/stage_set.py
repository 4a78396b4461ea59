"""Facts about a pipeline's whole list of stages, needed without building any replica.

Whether the stages can run (:func:`check_stages`), which Parameters several stages share (tied
weights, gradients summed across them) and how a batch binds to the model's inputs.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch

from fxpipe.codegen.split import MODEL, StageSpec

from ..errors import RuntimeConfigError
from ..schedules.schedule import sync_sets

log = logging.getLogger("fxpipe.runtime.replica.stage")

LossFn = Callable[[Any, Any], torch.Tensor]

def check_stages(stages: Sequence[StageSpec], replicas: Sequence[int]) -> None:
    """Reject pipelines the runtime cannot carry out, with a hint."""
    if not stages:
        raise RuntimeConfigError("no stages", "pass the list split_graph returned")
    if len(replicas) != len(stages):
        raise RuntimeConfigError(f"{len(stages)} stages but replicas={list(replicas)}",
                                 "give one replica count per stage")
    last = len(stages) - 1
    for st in stages:
        for name, cons in zip(st.outputs, st.consumers):
            if MODEL in cons and st.index != last:
                raise RuntimeConfigError(
                    f"model output {name!r} is produced by stage {st.index}, not the last stage",
                    "the loss runs on the last stage: put every model output there")
    if stages[last].io is None:
        raise RuntimeConfigError("the stages carry no model I/O description",
                                 "build them with fxpipe.codegen.split_graph")
    for t in tied_parameters(stages):
        log.info("parameter %r is used by stages %s: one logical parameter, its gradients are "
                 "summed across those stages at every update", t.key, list(t.stages))


@dataclass(frozen=True)
class TiedParameter:
    """A Parameter used by several stages (e.g. GPT's ``wte.weight`` / ``lm_head.weight``).

    Why it matters: every stage holding it trains a copy, so the copies stay one logical
    parameter only if every update of each copy uses the same gradient: the sum of all its uses'
    gradients (Megatron's embedding all-reduce). ``key``: its name in the lowest stage;
    ``names[s]``: its name in stage s (tied weights can have a different name per stage).
    """

    key: str
    names: Mapping[int, str]

    @property
    def stages(self) -> tuple[int, ...]:
        return tuple(sorted(self.names))


def tied_parameters(stages: Sequence[StageSpec]) -> tuple[TiedParameter, ...]:
    """Trainable Parameters shared by identity across stages (split_graph keeps the model's
    Parameter objects, and a pickled list of stages keeps the sharing), sorted by key."""
    seen: dict[int, dict[int, str]] = {}
    for st in stages:
        for n, p in st.gm.named_parameters(remove_duplicate=False):
            if p.requires_grad:
                seen.setdefault(id(p), {}).setdefault(st.index, n)
    tied = [TiedParameter(names[min(names)], dict(sorted(names.items())))
            for names in seen.values() if len(names) > 1]
    return tuple(sorted(tied, key=lambda t: t.key))


def tie_sets(tied: Sequence[TiedParameter]) -> dict[tuple[int, ...], list[TiedParameter]]:
    """Tied parameters grouped by the exact set of stages holding them: one all-reduce (and one
    process group) per set, in sorted order so every rank posts them in the same order."""
    out: dict[tuple[int, ...], list[TiedParameter]] = {}
    for t in tied:
        out.setdefault(t.stages, []).append(t)
    return dict(sorted(out.items()))


def sync_components(tied: Sequence[TiedParameter]) -> list[tuple[int, ...]]:
    """Stages whose updates must happen together (connected through tied parameters)."""
    return sync_sets([t.stages for t in tied])


def model_env(stages: Sequence[StageSpec], inputs: Any) -> dict[str, Any]:
    """Model inputs by placeholder name, from a tensor, a tuple of positional inputs or a dict
    of keyword inputs (a Hugging Face batch)."""
    io = stages[-1].io
    if isinstance(inputs, Mapping):
        return io.bind_inputs((), inputs)  # type: ignore[union-attr]
    args = inputs if isinstance(inputs, (tuple, list)) else (inputs,)
    return io.bind_inputs(args, None)  # type: ignore[union-attr]
