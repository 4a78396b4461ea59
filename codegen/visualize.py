"""Draw a partitioned graph with graphviz: one cluster per stage, cut edges in red.

The picture answers the questions a user has about a plan: what runs where, how many replicas
each stage has and how long it takes, and which activations cross the network (the red, bold cut
edges, labelled with their size). ``get_attr`` nodes are folded into their consumers so that big
models stay legible.
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

from .split import MODEL, StageSpec

log = logging.getLogger(__name__)

CUT_COLOR = "red"
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


def plan_graph(stages: Sequence[StageSpec],
               stage_info: Sequence[Mapping[str, Any]] | None = None) -> graphviz.Digraph:
    """Build the graphviz Digraph of ``stages`` (no rendering; needs no ``dot`` binary)."""
    if stage_info is not None and len(stage_info) != len(stages):
        raise ConfigError(f"stage_info has {len(stage_info)} entries for {len(stages)} stages")
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


def _placeholders(st: StageSpec) -> list[fx.Node]:
    return [n for n in st.gm.graph.nodes if n.op == "placeholder"]


def _shape_suffix(node: fx.Node) -> str:
    shape = (node.meta.get("fxpipe") or {}).get("shape")
    return f"\\n{list(shape)}" if isinstance(shape, tuple) else ""


def draw_plan(stages: Sequence[StageSpec], path: str | os.PathLike[str],
              stage_info: Sequence[Mapping[str, Any]] | None = None) -> Path:
    """Draw ``stages`` to ``path``; the format follows the suffix (.svg, .png, .dot)."""
    path = Path(path)
    fmt = _FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise ConfigError(f"cannot draw to {path}: unknown suffix {path.suffix!r}",
                          hint="use .svg, .png or .dot")
    dot = plan_graph(stages, stage_info)
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
    log.info("drew %d stages to %s", len(stages), path)
    return path
