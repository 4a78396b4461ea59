"""Draw a plan with graphviz, at a glance (:func:`draw_overview`) or op by op (:func:`draw_plan`).

The overview shows stages, replicas, time, memory and the bytes into each; the node view folds
``get_attr`` nodes into consumers and, past :data:`MAX_DETAIL` operations, draws a box per module.
"""
from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Any, Mapping, Sequence

import graphviz
import torch.fx as fx

from fxpipe.errors import ConfigError
from fxpipe.units import format_bytes, format_seconds

from fxpipe.passes.plan import Plan

from .split import MODEL, StageSpec

log = logging.getLogger(__name__)

CUT_COLOR = "red"
MAX_DETAIL = 250  # operations drawn one by one; more are grouped by module ...
MAX_BOXES = 64  # ... into at most this many boxes (graphviz lays out clusters slowly)
_FORMATS = {".svg": "svg", ".png": "png", ".dot": "dot", ".gv": "dot"}


def _node_label(node: fx.Node) -> str:
    """A short, readable label: module path and type, or the operator's short name."""
    if node.op == "call_module":
        sub = node.graph.owning_module.get_submodule(str(node.target)) \
            if node.graph.owning_module is not None else None
        kind = type(sub).__name__ if sub is not None else "module"
        text = f"{node.target}\\n{kind}"
    elif node.op == "call_method":
        text = f"{node.name}\\n.{node.target}()"
    elif node.op == "call_function":
        target = node.target
        name = getattr(target, "__name__", str(target))
        if hasattr(target, "_schema"):  # an OpOverload: aten.linear.default -> aten.linear
            name = str(target).removesuffix(".default")
        text = f"{node.name}\\n{name}" if name != node.name else name
    else:
        text = node.name
    shape = (node.meta.get("fxpipe") or {}).get("shape")
    if isinstance(shape, tuple):
        text += f"\\n{list(shape)}"
    return text


def _bytes_of(node: fx.Node) -> str:
    n = (node.meta.get("fxpipe") or {}).get("bytes")
    return format_bytes(float(n)) if isinstance(n, (int, float)) and n > 0 else ""


def _stage_label(k: int, info: Mapping[str, Any] | None) -> str:
    parts = [f"stage {k}"]
    if info:
        if "replicas" in info:
            parts.append(f"x{info['replicas']} replicas")
        for key, what in (("compute_s", "compute"), ("comm_s", "comm"), ("time_s", "time")):
            if isinstance(info.get(key), (int, float)):
                parts.append(f"{what} {format_seconds(float(info[key]))}")
        if isinstance(info.get("memory_bytes"), (int, float)):
            parts.append(f"mem {format_bytes(float(info['memory_bytes']))}")
    return " | ".join(parts)


EXPORT_NO_MODULE = "_empty_nn_module_stack"


def module_path(node: fx.Node) -> str:
    """The module a node belongs to: a ``call_module``'s target, else the innermost entry of
    the ``nn_module_stack`` the tracer recorded ("" at the top level)."""
    if node.op == "call_module":
        return str(node.target)
    stack = node.meta.get("nn_module_stack")
    if stack:
        path = str(list(stack.values())[-1][0])
        # torch.export's placeholder for nodes it made outside any module (the batch size it
        # reads from an input): no module of the user's
        return "" if path.startswith(EXPORT_NO_MODULE) else path
    return ""


def module_span(gm: fx.GraphModule, depth: int = 3) -> str:
    """``"model.layers.3..model.layers.7"``: the first and last module (cut at ``depth``) a
    stage's own operations belong to (not the values it makes again from the model's inputs);
    "" when the tracer recorded none."""
    paths = [_truncate(module_path(n), depth) for n in gm.graph.nodes
             if n.op in ("call_function", "call_method", "call_module")
             and not (n.meta.get("fxpipe") or {}).get("made_here")]  # an earlier stage's work
    paths = [p for p in paths if p]
    if not paths:
        return ""
    return paths[0] if paths[0] == paths[-1] else f"{paths[0]}..{paths[-1]}"


def _truncate(path: str, depth: int) -> str:
    return ".".join(path.split(".")[:depth]) if path else ""


def _ops(st: StageSpec) -> list[fx.Node]:
    return [n for n in st.gm.graph.nodes if n.op in ("call_function", "call_method", "call_module")]


def group_ops(stages: Sequence[StageSpec], max_detail: int = MAX_DETAIL,
              max_boxes: int = MAX_BOXES) -> dict[str, str]:
    """Operation name -> box name: itself when the graph has at most ``max_detail`` operations,
    else ``s<k>__<module path>#<i>`` for runs of consecutive operations of one stage in one
    module, the path cut at the deepest level that still gives at most ``max_boxes`` boxes."""
    ops = [(st.index, n) for st in stages for n in _ops(st)]
    if len(ops) <= max_detail:
        return {n.name: n.name for _, n in ops}
    paths = [(k, n, module_path(n)) for k, n in ops]
    deepest = max((p.count(".") + 1 for _, _, p in paths if p), default=1)
    best: dict[str, str] = {}
    for depth in range(1, deepest + 1):
        groups: dict[str, str] = {}
        boxes, last = 0, None
        for k, n, p in paths:
            key = (k, _truncate(p, depth))
            if key != last:
                boxes, last = boxes + 1, key
            groups[n.name] = f"s{k}__{key[1] or '(top)'}#{boxes}"
        if boxes > max_boxes and best:
            break
        best = groups
    return best


def plan_graph(stages: Sequence[StageSpec],
               stage_info: Sequence[Mapping[str, Any]] | None = None) -> graphviz.Digraph:
    """Build the graphviz Digraph of ``stages`` (no rendering; needs no ``dot`` binary)."""
    if stage_info is not None and len(stage_info) != len(stages):
        raise ConfigError(f"stage_info has {len(stage_info)} entries for {len(stages)} stages")
    box = group_ops(stages)
    if any(box[n] != n for n in box):
        return _grouped_graph(stages, stage_info, box)
    total = sum(len(st.gm.graph.nodes) for st in stages)
    dot = graphviz.Digraph("fxpipe_plan")
    dot.attr(rankdir="LR" if total > 60 else "TB", newrank="true", compound="true",
             fontname="Helvetica", nodesep="0.25", ranksep="0.35")
    dot.attr("node", shape="box", style="rounded,filled", fillcolor="white", fontname="Helvetica",
             fontsize="10")
    dot.attr("edge", fontname="Helvetica", fontsize="9")
    producer: dict[str, str] = {}  # value name -> graphviz node id
    model_inputs: dict[str, fx.Node] = {}
    for st in stages:
        for name, src, node in zip(st.inputs, st.sources, _placeholders(st)):
            if src == MODEL and name not in model_inputs:
                model_inputs[name] = node
    for name, node in model_inputs.items():
        producer[name] = f"in__{name}"
        dot.node(f"in__{name}", f"input {name}" + _shape_suffix(node), shape="ellipse",
                 fillcolor="lightgrey")
    for st in stages:
        with dot.subgraph(name=f"cluster_{st.index}") as sub:
            info = stage_info[st.index] if stage_info is not None else None
            sub.attr(label=_stage_label(st.index, info), style="rounded,filled",
                     fillcolor="#eef3fb" if st.index % 2 == 0 else "#f6f1e7", fontsize="12")
            for node in st.gm.graph.nodes:
                if node.op in ("call_function", "call_method", "call_module"):
                    nid = f"s{st.index}__{node.name}"
                    producer[node.name] = nid
                    sub.node(nid, _node_label(node))
    for st in stages:
        received = dict(zip(st.inputs, st.sources))
        for node in st.gm.graph.nodes:
            if node.op not in ("call_function", "call_method", "call_module"):
                continue
            for inp in node.all_input_nodes:
                if inp.op == "get_attr" or inp.name not in producer:
                    continue
                cut = inp.op == "placeholder" and received.get(inp.name, MODEL) != MODEL
                attrs = {"color": CUT_COLOR, "penwidth": "2.5", "fontcolor": CUT_COLOR,
                         "style": "bold"} if cut else {}
                dot.edge(producer[inp.name], f"s{st.index}__{node.name}", label=_bytes_of(inp),
                         **attrs)
    dot.node("output", "output", shape="ellipse", fillcolor="lightgrey")
    model_out = stages[0].io.output_names() if stages and stages[0].io is not None else []
    for name in model_out:
        if name in producer:
            dot.edge(producer[name], "output", style="dashed")
    return dot


def _grouped_graph(stages: Sequence[StageSpec], stage_info: Sequence[Mapping[str, Any]] | None,
                   box: Mapping[str, str]) -> graphviz.Digraph:
    """One box per module run (see :func:`group_ops`); an edge per pair of boxes, labelled with
    the bytes of the values it carries, red where they cross a stage boundary."""
    dot = graphviz.Digraph("fxpipe_plan")
    dot.attr(rankdir="TB", newrank="true", fontname="Helvetica", nodesep="0.2", ranksep="0.25")
    dot.attr("node", shape="box", style="rounded,filled", fillcolor="white", fontname="Helvetica",
             fontsize="10")
    dot.attr("edge", fontname="Helvetica", fontsize="9")
    counts: dict[str, int] = {}
    for st in stages:
        for n in _ops(st):
            counts[box[n.name]] = counts.get(box[n.name], 0) + 1
    producer: dict[str, tuple[int, str]] = {}  # value name -> (stage, box)
    for st in stages:
        with dot.subgraph(name=f"cluster_{st.index}") as sub:
            info = stage_info[st.index] if stage_info is not None else None
            sub.attr(label=_stage_label(st.index, info), style="rounded,filled",
                     fillcolor="#eef3fb" if st.index % 2 == 0 else "#f6f1e7", fontsize="12")
            for n in _ops(st):
                b = box[n.name]
                if b not in producer.values() and all(v[1] != b for v in producer.values()):
                    path = b.split("__", 1)[1].rsplit("#", 1)[0]
                    sub.node(b, f"{path}\n{counts[b]} ops")
                producer[n.name] = (st.index, b)
    edges: dict[tuple[str, str], tuple[float, bool]] = {}
    for st in stages:
        for n in _ops(st):
            for inp in n.all_input_nodes:
                src = producer.get(inp.name)
                if src is None or src[1] == box[n.name]:
                    continue
                size = float((inp.meta.get("fxpipe") or {}).get("bytes") or 0)
                key = (src[1], box[n.name])
                old = edges.get(key, (0.0, False))
                edges[key] = (old[0] + size, old[1] or src[0] != st.index)
    for (a, b), (size, cut) in edges.items():
        attrs = {"color": CUT_COLOR, "penwidth": "2.5", "fontcolor": CUT_COLOR,
                 "style": "bold"} if cut else {}
        dot.edge(a, b, label=format_bytes(size) if size > 0 else "", **attrs)
    return dot


def _placeholders(st: StageSpec) -> list[fx.Node]:
    return [n for n in st.gm.graph.nodes if n.op == "placeholder"]


def _shape_suffix(node: fx.Node) -> str:
    shape = (node.meta.get("fxpipe") or {}).get("shape")
    return f"\\n{list(shape)}" if isinstance(shape, tuple) else ""


def overview_graph(plan: Plan, spans: Sequence[str] | None = None) -> graphviz.Digraph:
    """The plan at a glance (no rendering): its stages left to right, each with the modules it
    holds, its replicas, time and memory per minibatch as :meth:`Plan.summary` states them, and
    between stages the bytes each minibatch sends into the next (its comm time)."""
    dot = graphviz.Digraph("fxpipe_plan_overview")
    dot.attr(rankdir="LR", fontname="Helvetica", nodesep="0.3", ranksep="0.5")
    dot.attr("node", shape="box", style="rounded,filled", fontname="Helvetica", fontsize="11")
    dot.attr("edge", fontname="Helvetica", fontsize="10")
    dot.node("input", "input", shape="ellipse", fillcolor="lightgrey")
    previous = "input"
    for st in plan.stages:
        what = spans[st.index] if spans is not None and spans[st.index] else (
            f"{st.nodes[0]}..{st.nodes[-1]}" if len(st.nodes) > 1 else
            (st.nodes[0] if st.nodes else "(empty)"))
        lines = [f"stage {st.index}", f"{what} ({len(st.nodes)} nodes)",
                 f"{st.replicas} replica{'s' if st.replicas > 1 else ''}",
                 f"compute {format_seconds(st.compute_s + st.sync_s)}",
                 f"memory {format_bytes(st.memory_bytes)}"
                 + (f" (peak {format_bytes(st.peak_bytes)})" if st.peak_bytes is not None
                    else "")]
        dot.node(f"stage{st.index}", "\n".join(lines),
                 fillcolor="#eef3fb" if st.index % 2 == 0 else "#f6f1e7",
                 peripheries="2" if st.replicas > 1 else "1")
        label = (f"{format_bytes(st.input_bytes)} each way\n{format_seconds(st.comm_s)}"
                 if st.index > 0 else "")
        attrs = {"color": CUT_COLOR, "penwidth": "2.5", "fontcolor": CUT_COLOR,
                 "style": "bold"} if st.index > 0 else {}
        dot.edge(previous, f"stage{st.index}", label=label, **attrs)
        previous = f"stage{st.index}"
    dot.node("output", "output", shape="ellipse", fillcolor="lightgrey")
    dot.edge(previous, "output")
    workers = plan.cluster.get("workers")
    dot.attr(label=f"{format_seconds(plan.time_per_minibatch)} per minibatch on "
                   f"{plan.workers_used} of {workers} workers; "
                   f"{plan.speedup_over_data_parallel:.2f}x over data parallelism"
                   + (f", {plan.speedup_over_one_worker:.2f}x over one worker"
                      if plan.speedup_over_one_worker is not None else ""),
             labelloc="b", fontsize="11")
    return dot


def draw_overview(plan: Plan, path: str | os.PathLike[str],
                  spans: Sequence[str] | None = None) -> Path:
    """Draw :func:`overview_graph` to ``path`` (.svg, .png or .dot by suffix)."""
    return _render(overview_graph(plan, spans), path, f"{len(plan.stages)} stages")


def draw_plan(stages: Sequence[StageSpec], path: str | os.PathLike[str],
              stage_info: Sequence[Mapping[str, Any]] | None = None) -> Path:
    """Draw ``stages`` node by node to ``path``; the format follows the suffix (.svg, .png,
    .dot)."""
    return _render(plan_graph(stages, stage_info), path, f"{len(stages)} stages, node by node")


def _render(dot: graphviz.Digraph, path: str | os.PathLike[str], what: str) -> Path:
    path = Path(path)
    fmt = _FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise ConfigError(f"cannot draw to {path}: unknown suffix {path.suffix!r}",
                          hint="use .svg, .png or .dot")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    if fmt == "dot":
        tmp.write_text(dot.source)
    else:
        if shutil.which("dot") is None:
            raise ConfigError(f"drawing {path} needs the graphviz 'dot' program, which is not "
                              "installed", hint="apt-get install graphviz, or draw to a .dot file")
        try:
            tmp.write_bytes(dot.pipe(format=fmt))
        except graphviz.ExecutableNotFound as exc:
            raise ConfigError("the graphviz 'dot' program is not installed",
                              hint="apt-get install graphviz, or draw to a .dot file") from exc
        except graphviz.CalledProcessError as exc:
            raise ConfigError(f"graphviz failed to render {path}: {exc}",
                              hint="draw to a .dot file and inspect it") from exc
    os.replace(tmp, path)
    log.info("drew %s to %s", what, path)
    return path
