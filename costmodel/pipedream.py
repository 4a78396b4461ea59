"""Import PipeDream's ``graph.txt`` profiles (torch-free).

PipeDream publishes per-layer GPU profiles of real models; reading them lets fxpipe plan those
models for clusters we do not have. The preprocessing mirrors PipeDream's optimizer
(``optimizer_graph_hierarchical.py``); nodes come out topologically, ties by numeric node id.
"""
from __future__ import annotations

import logging
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import networkx as nx

from fxpipe.errors import ProfileFormatError

log = logging.getLogger(__name__)

_FIELDS = ("forward_compute_time", "backward_compute_time", "activation_size", "parameter_size")
_NODE_ID = re.compile(r"[A-Za-z_]*(\d+)")
# Image sides used by PipeDream's image-classification profiles (224 for most, 299 inception,
# 331 nasnetalarge); the batch size is input_bytes / (3 * side^2 * 4 bytes).
_IMAGE_SIDES = (224, 299, 331)
# Profiling batch sizes listed in the profiles' README.
_KNOWN_BATCHES = (16, 64, 128, 256)


@dataclass(frozen=True)
class PipeDreamGraph:
    """A parsed ``graph.txt``: each node's ProfileNode fields, in topological order."""

    nodes: tuple[dict[str, Any], ...]
    batch_size: int | None
    source: str
    dropped_sinks: list[str]


@dataclass
class _RawNode:
    node_id: str
    desc: str
    forward_ms: float
    backward_ms: float
    activation: float
    parameters: float
    multi_output: bool
    line: int


def _fail(path: str, lineno: int, text: str, why: str) -> ProfileFormatError:
    return ProfileFormatError(f"{path}:{lineno}: {why}: {text.strip()!r}",
                              "pass an unmodified PipeDream profiler graph.txt")


def _number(path: str, lineno: int, text: str, key: str, raw: str) -> tuple[float, bool]:
    """Parse one field value; ``[a; b]`` (multi-output) is summed. Returns (value, multi)."""
    raw = raw.strip()
    multi = raw.startswith("[")
    parts = raw.strip("[]").split(";") if multi else [raw]
    try:
        vals = [float(p) for p in parts]
    except ValueError:
        raise _fail(path, lineno, text, f"bad number for {key}={raw!r}") from None
    if not all(math.isfinite(v) and v >= 0 for v in vals) or (multi and not raw.endswith("]")):
        raise _fail(path, lineno, text, f"bad number for {key}={raw!r}")
    return float(sum(vals)), multi


def _parse_node(path: str, lineno: int, line: str) -> _RawNode:
    parts = line.split(" -- ")
    if len(parts) < 3:
        raise _fail(path, lineno, line, "expected 'nodeID -- description -- key=value, ...'")
    node_id, desc, metrics = parts[0].strip(), " -- ".join(parts[1:-1]).strip(), parts[-1]
    if not _NODE_ID.fullmatch(node_id):
        raise _fail(path, lineno, line, f"bad node id {node_id!r}")
    found: dict[str, str] = {}
    for m in re.finditer(r"(\w+)=(\[[^\]]*\]|[^,\s]+)", metrics):
        found[m.group(1)] = m.group(2)
    missing = [k for k in _FIELDS if k not in found]
    if missing:
        raise _fail(path, lineno, line, f"missing field(s) {', '.join(missing)}")
    fwd, _ = _number(path, lineno, line, _FIELDS[0], found[_FIELDS[0]])
    bwd, _ = _number(path, lineno, line, _FIELDS[1], found[_FIELDS[1]])
    act, multi = _number(path, lineno, line, _FIELDS[2], found[_FIELDS[2]])
    par, _ = _number(path, lineno, line, _FIELDS[3], found[_FIELDS[3]])
    return _RawNode(node_id, desc, fwd, bwd, act, par, multi, lineno)


def _numeric_id(node_id: str) -> int:
    m = _NODE_ID.fullmatch(node_id)
    return int(m.group(1)) if m else 0


def _batch_size(input_bytes: float) -> int | None:
    """Batch size implied by an image input's bytes, if it is one of the README's batch sizes."""
    for side in _IMAGE_SIDES:
        per_sample = 3 * side * side * 4
        b = input_bytes / per_sample
        if b == int(b) and int(b) in _KNOWN_BATCHES:
            return int(b)
    return None


def read_pipedream_graph(path: str | os.PathLike[str]) -> PipeDreamGraph:
    """Parse a PipeDream ``graph.txt`` into the fields of a Profile's nodes (seconds, bytes):
    :meth:`fxpipe.costmodel.profile.Profile.from_pipedream` builds the Profile."""
    spath = str(path)
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        raise ProfileFormatError(f"PipeDream profile {spath!r} does not exist",
                                 "give the path of a graph.txt") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ProfileFormatError(f"cannot read PipeDream profile {spath!r}: {e}") from None

    nodes: dict[str, _RawNode] = {}
    edges: list[tuple[str, str, int, str]] = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        if line[0] in " \t":
            parts = [p.strip() for p in line.strip().split(" -- ")]
            if len(parts) != 2 or not all(parts):
                raise _fail(spath, lineno, line, "expected an edge '<tab>nodeA -- nodeB'")
            edges.append((parts[0], parts[1], lineno, line))
        else:
            node = _parse_node(spath, lineno, line)
            if node.node_id in nodes:
                raise _fail(spath, lineno, line, f"duplicate node {node.node_id!r}")
            nodes[node.node_id] = node
    if not nodes:
        raise ProfileFormatError(f"{spath}: no node lines found", "is this a PipeDream graph.txt?")

    succ: dict[str, list[str]] = {n: [] for n in nodes}
    pred: dict[str, list[str]] = {n: [] for n in nodes}
    for a, b, lineno, line in edges:
        for end in (a, b):
            if end not in nodes:
                raise _fail(spath, lineno, line, f"edge names unknown node {end!r}")
        if b not in succ[a]:
            succ[a].append(b)
            pred[b].append(a)

    # The batch size is read off the (single) image input before it is zeroed.
    raw_inputs = [n.activation for n in nodes.values() if not pred[n.node_id] and n.desc == "Input"]
    batch = _batch_size(raw_inputs[0]) if len(raw_inputs) == 1 else None
    # PipeDream preprocessing: zero Input sources, drop unused __getitem__ sinks (single pass).
    for n in nodes.values():
        if not pred[n.node_id] and n.desc.startswith("Input"):
            n.forward_ms = n.backward_ms = n.activation = n.parameters = 0.0
    dropped = [n for n in nodes if not succ[n] and nodes[n].desc.startswith("__getitem__")]
    for n in dropped:
        for p in pred[n]:
            succ[p].remove(n)
        del nodes[n], succ[n], pred[n]

    order = _toposort(spath, nodes, succ, pred)
    pnodes = tuple(
        dict(name=nid, op="placeholder" if not pred[nid] and nodes[nid].desc.startswith("Input")
             else "call_module",
             target=nodes[nid].desc, forward_s=nodes[nid].forward_ms / 1000.0,
             backward_s=nodes[nid].backward_ms / 1000.0,
             activation_bytes=nodes[nid].activation, parameter_bytes=nodes[nid].parameters,
             inputs=tuple(pred[nid]), sendable=not nodes[nid].multi_output)
        for nid in order)
    log.debug("loaded %d PipeDream nodes (%d __getitem__ sinks dropped) from %s",
              len(pnodes), len(dropped), spath)
    return PipeDreamGraph(nodes=pnodes, batch_size=batch, source=f"pipedream:{spath}",
                          dropped_sinks=dropped)


def _toposort(path: str, nodes: dict[str, _RawNode], succ: dict[str, list[str]],
              pred: dict[str, list[str]]) -> list[str]:
    """A topological order, ties by numeric id; a cycle raises naming a line on it (the first,
    by line, of the nodes a cycle blocks: on one, or after one)."""
    graph: nx.DiGraph = nx.DiGraph()
    graph.add_nodes_from(nodes)
    graph.add_edges_from((n, s) for n in nodes for s in succ[n])
    try:
        return list(nx.lexicographical_topological_sort(graph, key=lambda n: (_numeric_id(n), n)))
    except nx.NetworkXUnfeasible:
        cyclic = {n for c in nx.strongly_connected_components(graph) if len(c) > 1 for n in c}
        cyclic |= {n for n in nodes if graph.has_edge(n, n)}
        blocked = cyclic | {d for n in cyclic for d in nx.descendants(graph, n)}
        stuck = min(blocked, key=lambda n: nodes[n].line)
        raise ProfileFormatError(
            f"{path}:{nodes[stuck].line}: the graph has a cycle through node {stuck!r}: "
            f"{nodes[stuck].node_id} -- {nodes[stuck].desc}",
            "a PipeDream profile must be a DAG") from None
