"""Split one traced GraphModule into per-stage GraphModules (the heart of codegen).

Not ``torch.fx.passes.split_module``: each value goes straight from its producer to every stage
using it, stages share the model's Parameters under their names, and static values are not sent.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch
import torch.fx as fx

from fxpipe.errors import ConfigError

from fxpipe.costmodel.extract import describe_target, reaches_parameters
from fxpipe.passes.made_here import NodeFacts, made_here
from fxpipe.tracing.modelio import ModelIO

log = logging.getLogger(__name__)

MODEL = -1
"""Stage index meaning "the model" (a model input as a source, the model output as a consumer)."""

_PLACED_OPS = ("placeholder", "call_function", "call_method", "call_module")


@dataclass(frozen=True)
class StageSpec:
    """One pipeline stage: its GraphModule and where its inputs come from / outputs go.

    ``gm(*inputs)`` returns a tuple aligned with ``outputs``. ``sources[i]`` is the stage producing
    ``inputs[i]`` (-1: a model input); ``consumers[j]`` lists the stages consuming ``outputs[j]``
    in ascending order, followed by -1 when the value is (part of) the model output. ``io`` (same
    object in every stage of a split) rebuilds the model's own output structure.
    """

    index: int
    gm: fx.GraphModule
    inputs: tuple[str, ...]
    sources: tuple[int, ...]
    outputs: tuple[str, ...]
    consumers: tuple[tuple[int, ...], ...]
    io: ModelIO | None = field(default=None, compare=False, repr=False)


def model_io(stages: Sequence[StageSpec], caller: str) -> ModelIO:
    """The model I/O description shared by ``stages``; a clear error for an empty list or stages
    built some other way than :func:`split_graph` / ``load_exported``."""
    if not stages:
        raise ConfigError(f"{caller} got no stages", hint="pass the list split_graph returned")
    io = stages[0].io
    if io is None:
        raise ConfigError("the stages carry no model I/O description",
                          hint="build them with split_graph or load_exported")
    return io


def is_guard_node(node: fx.Node) -> bool:
    """torch.export's ``_guards_fn`` input check: not model work, dropped from stages."""
    return node.op == "call_module" and str(node.target) == "_guards_fn" and not node.users


def placed_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    """The nodes a plan must assign to stages: placeholders and compute nodes, in program order."""
    return [n for n in gm.graph.nodes if n.op in _PLACED_OPS and not is_guard_node(n)]


def value_kind(node: fx.Node) -> tuple[str, Any]:
    """Classify what ``node`` produces: ("tensor", None), ("static", value) or ("unsendable", None).

    Uses ``meta["fxpipe"]`` (tracing.shapes) and falls back on torch.export's ``meta["val"]``; an
    unknown value is assumed to be a tensor (it is routed, which is always correct in-process).
    """
    m = node.meta.get("fxpipe")
    if isinstance(m, Mapping) and m:
        if m.get("is_tensor"):
            return "tensor", None
        if "static_value" in m:
            return "static", m["static_value"]
        if m.get("sendable") is False:
            return "unsendable", None
        return "tensor", None
    val = node.meta.get("val", node.meta.get("example_value"))
    if val is None and "val" not in node.meta:
        return "tensor", None
    if isinstance(val, torch.Tensor):
        return "tensor", None
    if val is None or (isinstance(val, (bool, int, float)) and type(val) in (bool, int, float)):
        return "static", val
    return "unsendable", None


def _validate(gm: fx.GraphModule, nodes: list[fx.Node], stage_of: Mapping[str, int]) -> int:
    """Check ``stage_of`` covers the graph and respects data dependencies; return #stages."""
    names = {n.name for n in nodes}
    missing = [n.name for n in nodes if n.name not in stage_of]
    if missing:
        raise ConfigError(f"stage_of has no stage for {len(missing)} node(s): {missing[:10]}",
                          hint="assign every placeholder and compute node (not get_attr/output)")
    guards = {n.name for n in gm.graph.nodes if is_guard_node(n)}  # accepted, then ignored
    unknown = sorted(k for k in stage_of if k not in names and k not in guards)
    if unknown:
        known = {n.name for n in gm.graph.nodes}
        what = "get_attr/output/guard nodes" if all(k in known for k in unknown) else "unknown nodes"
        raise ConfigError(f"stage_of names {what}: {unknown[:10]}",
                          hint="the plan was made for a different graph, or lists non-placeable nodes")
    for name in names:
        s = stage_of[name]
        if isinstance(s, bool) or not isinstance(s, int) or s < 0:
            raise ConfigError(f"node {name!r} has stage {s!r}; stages are ints >= 0")
    used = sorted({stage_of[n] for n in names})
    if used != list(range(len(used))):
        raise ConfigError(f"stage indices must be contiguous from 0, got {used}",
                          hint="renumber the stages 0..S-1 with none empty")
    for n in nodes:
        for inp in n.all_input_nodes:
            if inp.op == "get_attr" or is_guard_node(inp):
                continue
            if stage_of[inp.name] > stage_of[n.name]:
                raise ConfigError(
                    f"node {n.name!r} is in stage {stage_of[n.name]} but its input {inp.name!r} "
                    f"is in the later stage {stage_of[inp.name]}",
                    hint="a node's stage must be >= the stages of its inputs")
    return len(used)


def split_graph(gm: fx.GraphModule, stage_of: Mapping[str, int]) -> list[StageSpec]:
    """Split ``gm`` into ``max(stage_of)+1`` stage GraphModules (see docs/design-notes.mdstring).

    Raises ConfigError for an invalid ``stage_of`` or for a non-sendable, non-static value (tuple
    of tensors, opaque object) that would cross a stage boundary.
    """
    nodes = placed_nodes(gm)
    num_stages = _validate(gm, nodes, stage_of)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    io = ModelIO.from_graph_module(gm)
    model_out = set(io.output_names())

    stage_inputs: list[dict[fx.Node, int]] = [{} for _ in range(num_stages)]  # node -> source
    stage_outputs: list[dict[fx.Node, set[int]]] = [{} for _ in range(num_stages)]
    baked: list[dict[fx.Node, Any]] = [{} for _ in range(num_stages)]
    recomputed: list[set[fx.Node]] = [set() for _ in range(num_stages)]  # see _provide
    made = made_here(node_facts(gm, nodes))
    for n in nodes:
        src = stage_of[n.name]
        is_input = n.op == "placeholder"
        user_stages = sorted({stage_of[u.name] for u in n.users
                              if u.op in _PLACED_OPS and not is_guard_node(u)})
        for c in user_stages:
            if is_input or c > src:
                _provide(n, c, stage_of, stage_inputs, stage_outputs, baked, recomputed, made)
        if n.name in model_out:
            _route_model_output(n, src, num_stages - 1, stage_inputs, stage_outputs, baked)

    specs: list[StageSpec] = []
    for k in range(num_stages):
        body = [n for n in nodes if n.op != "placeholder"
                and (stage_of[n.name] == k or n in recomputed[k])]
        ins = sorted(stage_inputs[k], key=order.__getitem__)
        outs = sorted(stage_outputs[k], key=order.__getitem__)
        stage_gm = _build_stage_gm(gm, k, ins, body, outs, baked[k], recomputed[k])
        consumers = tuple(tuple(sorted(c for c in stage_outputs[k][n] if c != MODEL))
                          + ((MODEL,) if MODEL in stage_outputs[k][n] else ()) for n in outs)
        specs.append(StageSpec(index=k, gm=stage_gm, inputs=tuple(n.name for n in ins),
                               sources=tuple(stage_inputs[k][n] for n in ins),
                               outputs=tuple(n.name for n in outs), consumers=consumers, io=io))
        log.debug("stage %d: %d nodes, inputs %s, outputs %s", k, len(body),
                  specs[-1].inputs, specs[-1].outputs)
    return specs


def node_facts(gm: fx.GraphModule, nodes: Sequence[fx.Node]) -> list[NodeFacts]:
    """What :func:`fxpipe.passes.made_here.made_here` reads of ``nodes``, as the profile
    records it (plus ``inplace=True``, which the profile does not record)."""
    facts = []
    for n in nodes:
        inputs = tuple(dict.fromkeys(a.name for a in n.all_input_nodes
                                     if a.op != "get_attr" and not is_guard_node(a)))
        writes = n.kwargs.get("inplace") is True or (
            n.op == "call_module" and getattr(gm.get_submodule(str(n.target)), "inplace", False)
            is True)
        facts.append(NodeFacts(n.name, n.op, describe_target(gm, n), inputs,
                               reaches_parameters(gm, n), writes))
    return facts


def _provide(n: fx.Node, c: int, stage_of: Mapping[str, int],
             stage_inputs: list[dict[fx.Node, int]], stage_outputs: list[dict[fx.Node, set[int]]],
             baked: list[dict[fx.Node, Any]], recomputed: list[set[fx.Node]],
             made: frozenset[str]) -> None:
    """Make ``n`` available to stage ``c``: a model input is read there, a tensor is sent
    there, a constant is baked in, and two kinds of value are made again there from their
    inputs, provided in turn: a number computed from tensors (a size: the batch, which differs
    between microbatches and from the example; baked, it would fix the stage to the example's
    batch), and a value made from the model's inputs alone (``made``: an attention mask, a
    rotary table; :mod:`fxpipe.passes.made_here` says why and which)."""
    if n.op == "get_attr" or (n.op != "placeholder" and stage_of[n.name] == c):
        return
    if n.op == "placeholder":
        stage_inputs[c][n] = MODEL
        return
    kind, value = value_kind(n)
    if kind == "static" and not _from_tensors(n):
        baked[c][n] = value
    elif kind == "static" or n.name in made:
        if n not in recomputed[c]:
            recomputed[c].add(n)
            for a in n.all_input_nodes:
                _provide(a, c, stage_of, stage_inputs, stage_outputs, baked, recomputed, made)
    elif kind == "unsendable":
        raise ConfigError(
            f"value {n.name!r} (stage {stage_of[n.name]}) is not sendable (a tuple of tensors or "
            f"an opaque object) but stage {c} uses it",
            hint="move the cut so that no stage boundary falls while it is live")
    else:
        stage_inputs[c][n] = stage_of[n.name]
        stage_outputs[stage_of[n.name]].setdefault(n, set()).add(c)


def _from_tensors(n: fx.Node, seen: dict[fx.Node, bool] | None = None) -> bool:
    """Is the static value of ``n`` computed from a tensor (a model input or any tensor value),
    directly or through other static values?"""
    seen = {} if seen is None else seen
    if n not in seen:
        seen[n] = False
        seen[n] = any(a.op == "placeholder" or value_kind(a)[0] != "static"
                      or _from_tensors(a, seen) for a in n.all_input_nodes
                      if a.op != "get_attr")
    return seen[n]


def _route_model_output(n: fx.Node, src: int, last: int, stage_inputs: list[dict[fx.Node, int]],
                        stage_outputs: list[dict[fx.Node, set[int]]],
                        baked: list[dict[fx.Node, Any]]) -> None:
    """Every model output leaves the pipeline from the last stage, where the loss runs.

    Why: an encoder-decoder returns ``encoder_last_hidden_state`` (made on an early stage) beside
    the logits; the trainer computes ``loss_fn(output, target)`` on the last stage from the whole
    output. So a value made earlier is sent straight to the last stage (like any other crossing
    value: its gradient, zero unless the loss uses it, flows back) and passed through; a model
    input returned as output is read there; a small constant is baked into it.
    """
    if src == last and n.op != "placeholder":
        stage_outputs[last].setdefault(n, set()).add(MODEL)
        return
    if n.op == "placeholder":
        stage_inputs[last][n] = MODEL
    else:
        kind, value = value_kind(n)
        if kind == "static":
            baked[last][n] = value  # the last stage returns the constant itself
        elif kind == "unsendable":
            raise ConfigError(
                f"model output {n.name!r} is made on stage {src} and is not sendable (a tuple of "
                "tensors or an opaque object), so it cannot reach the last stage",
                hint="move the cut so that it falls after this output is made")
        else:
            stage_inputs[last][n] = src
            stage_outputs[src].setdefault(n, set()).add(last)
    stage_outputs[last].setdefault(n, set()).add(MODEL)


def _build_stage_gm(gm: fx.GraphModule, k: int, ins: list[fx.Node], body: list[fx.Node],
                    outs: list[fx.Node], baked: Mapping[fx.Node, Any],
                    recomputed: set[fx.Node] | frozenset[fx.Node] = frozenset()
                    ) -> fx.GraphModule:
    """Copy stage ``k``'s nodes into a fresh graph; get_attr nodes are re-created on demand.
    A ``recomputed`` node (made on an earlier stage and again here, see :func:`_provide`) is copied
    under a name of its own (``<name>_here``): node names stay unique across the stages."""
    graph = fx.Graph()
    env: dict[fx.Node, Any] = {}
    for n in ins:
        ph = graph.placeholder(n.name)
        ph.meta = dict(n.meta)
        env[n] = ph

    def lookup(a: fx.Node) -> Any:
        if a in env:
            return env[a]
        if a in baked:
            return baked[a]
        if a.op == "get_attr":
            new = graph.create_node("get_attr", a.target, name=a.name)
            new.meta = dict(a.meta)
            env[a] = new
            return new
        raise AssertionError(f"stage {k}: {a.name!r} is neither computed nor received here")

    for n in body:
        if n in recomputed:
            env[n] = graph.create_node(n.op, n.target, fx.node.map_arg(n.args, lookup),
                                       fx.node.map_arg(n.kwargs, lookup), name=f"{n.name}_here")
            env[n].meta = {**n.meta, "fxpipe": {**(n.meta.get("fxpipe") or {}),
                                                 "made_here": True}}
        else:
            env[n] = graph.node_copy(n, lookup)
    graph.output(tuple(lookup(n) for n in outs))
    graph.lint()
    return fx.GraphModule(gm, graph, class_name=f"Stage{k}")
