"""fxpipe's stages in the shape torch.distributed.pipelining wants: each stage feeds the next.

:class:`CarryStage` k takes what crosses the boundary before it (:func:`carried`) and returns what
crosses the one after, passing through what it does not use; its parameters are fxpipe's own.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn

from fxpipe.errors import ConfigError

from .split import MODEL, StageSpec, model_io


def carried(stages: Sequence[StageSpec]) -> list[tuple[str, ...]]:
    """``out[b]``: the values crossing the boundary after stage b (b = 0 .. S-2), in a fixed
    order: model inputs first (in the model's order), then by producing stage and output."""
    io = model_io(stages, "carried")
    rank = {n: (-1, i) for i, n in enumerate(io.input_names)}
    for st in stages:
        rank.update({n: (st.index, i) for i, n in enumerate(st.outputs)})
    out = []
    for b in range(len(stages) - 1):
        need = {n for st in stages[b + 1:] for n, src in zip(st.inputs, st.sources)
                if src == MODEL or src <= b}
        out.append(tuple(sorted(need, key=rank.__getitem__)))
    return out


class CarryStage(nn.Module):
    """Stage ``spec`` with the calling convention of a torch pipeline stage (see the module
    doc): ``forward(*carried_in) -> carried_out`` (a tensor when there is one value), the model
    output on the last stage. Stage 0 takes the model's inputs, in placeholder order."""

    def __init__(self, spec: StageSpec, carry_in: Sequence[str], carry_out: Sequence[str] | None
                 ) -> None:
        super().__init__()
        self.stage = spec.gm  # parameters stay the fxpipe stage's own tensors
        self.spec_inputs, self.carry_in = tuple(spec.inputs), tuple(carry_in)
        self.spec_outputs = tuple(spec.outputs)
        self.carry_out = None if carry_out is None else tuple(carry_out)
        self.io = spec.io
        # outputs a torch schedule must get as tensors of their own: a value also read inside
        # this stage (zero-bubble schedules detach a stage's outputs in place after the input
        # gradients, which would cut it out of the graph its weight gradients still need)
        # (by position in the output node: a stage unpickled in another process has been
        # re-traced, and its nodes renamed)
        out_node = next(n for n in spec.gm.graph.nodes if n.op == "output")
        self.shared_outputs = frozenset(
            name for name, node in zip(self.spec_outputs, out_node.args[0])
            if isinstance(node, torch.fx.Node) and any(u.op != "output" for u in node.users))
        missing = [n for n in self.spec_inputs if n not in self.carry_in]
        if missing:
            raise ConfigError(f"stage {spec.index} needs {missing}, which nothing carries to it",
                              "build the stages with fxpipe.codegen.split_graph")

    def forward(self, *args: Any) -> Any:
        if len(args) != len(self.carry_in):
            raise ConfigError(f"stage expects {len(self.carry_in)} carried values "
                              f"{list(self.carry_in)}, got {len(args)}")
        env = dict(zip(self.carry_in, args))
        outs = self.stage(*(env[n] for n in self.spec_inputs))
        made = dict(zip(self.spec_outputs, outs))
        if self.carry_out is None:  # the last stage: the model's output
            return self.io.build_output({**env, **made})  # type: ignore[union-attr]
        # a value passed through untouched leaves as a copy, so autograd sees it as this
        # stage's output (its gradient flows back through here to whoever made it), and so
        # does a value this stage also reads itself (see __init__)
        vals = [_own(made[n], n in self.shared_outputs) if n in made else _own(env[n], True)
                for n in self.carry_out]
        return vals[0] if len(vals) == 1 else tuple(vals)


def _own(t: Any, shared: bool) -> Any:
    """``t`` as a tensor of this stage's own: a copy when it is shared (see above) or a view
    (torch's zero-bubble backward cannot detach a view in place)."""
    if isinstance(t, torch.Tensor) and t.is_floating_point() and (shared or t._is_view()):
        return t.clone()
    return t


def model_inputs(stages: Sequence[StageSpec]) -> tuple[str, ...]:
    """The model inputs some stage reads, in the model's order: what stage 0 takes."""
    io = model_io(stages, "model_inputs")
    used = {n for st in stages for n, src in zip(st.inputs, st.sources) if src == MODEL}
    return tuple(n for n in io.input_names if n in used)


def carry_stages(stages: Sequence[StageSpec]) -> list[CarryStage]:
    """One :class:`CarryStage` per fxpipe stage."""
    bounds = carried(stages)
    ins = [model_inputs(stages)] + bounds
    outs: list[tuple[str, ...] | None] = [*bounds, None]
    return [CarryStage(st, ins[st.index], outs[st.index]) for st in stages]
