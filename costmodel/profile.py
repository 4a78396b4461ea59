"""The profile: per-node costs of a linearisable graph, as plain numbers (no torch).

A :class:`Profile` is what the partitioner consumes: made by the profiler or the estimator, loaded
from fxpipe's JSON or imported from PipeDream's ``graph.txt``. Times are seconds per minibatch,
sizes bytes (batch included); ``compute_s`` includes ``update_s``, the node's optimizer step.
"""
from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field
from typing import Any

from fxpipe.costmodel.overheads import Overheads, overheads_of
from fxpipe.costmodel.pipedream import read_pipedream_graph
from fxpipe.errors import ProfileFormatError
from fxpipe.jsonio import read_json, write_json_atomic

PROFILE_FORMAT = "fxpipe.profile/1"


@dataclass(frozen=True)
class ProfileNode:
    """Costs of one graph node.

    ``parameter_bytes`` counts only the parameters this node *owns*: a parameter used by several
    nodes (a reused layer, tied embeddings) is owned by its first user in program order and listed
    in ``shared_params`` of the later users, so totals never double count.
    """

    name: str
    op: str
    target: str
    forward_s: float
    backward_s: float
    activation_bytes: float
    parameter_bytes: float
    inputs: tuple[str, ...] = ()
    params: tuple[str, ...] = ()
    shared_params: tuple[str, ...] = ()
    # False when the output cannot travel between stages (e.g. a tuple of tensors, an opaque
    # Python object); the partitioner never cuts while such a value is live.
    sendable: bool = True
    # Seconds per optimizer step for the parameters this node OWNS (0 for the others). Last
    # field, so positional construction keeps working; default 0.0, so older JSON files and
    # PipeDream imports (which measured no update) still load.
    update_s: float = 0.0
    # True when the value is (part of) the model's output: it travels to the last stage, where
    # the loss runs, so it is live across every cut after its producer (last field, default
    # False: older JSON files and PipeDream imports still load).
    is_output: bool = False
    # Bytes of what backward keeps, charged to this node (costmodel/saved.py: tensors autograd
    # saves, views of parameters free, each storage once). None in profiles costed before it
    # was recorded and in PipeDream imports: their output bytes stand in (``held_bytes``).
    saved_bytes: float | None = None

    @property
    def held_bytes(self) -> float:
        """Activation memory per minibatch in flight: what backward keeps where it was recorded,
        else the output bytes (PipeDream's rule)."""
        return self.activation_bytes if self.saved_bytes is None else self.saved_bytes

    @property
    def compute_s(self) -> float:
        """Forward + backward + weight update: the node's share of a stage's busy time per
        minibatch (the update runs once per minibatch in the 1F1B schedule)."""
        return self.forward_s + self.backward_s + self.update_s


@dataclass(frozen=True)
class Profile:
    """Nodes in a topological order (program order for traced graphs) plus provenance."""

    nodes: tuple[ProfileNode, ...]
    batch_size: int | None = None
    device: str = "unknown"
    source: str = "fxpipe"
    meta: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        seen: set[str] = set()
        for n in self.nodes:
            if n.name in seen:
                raise ProfileFormatError(f"duplicate node name {n.name!r} in profile")
            for i in n.inputs:
                if i not in seen:
                    raise ProfileFormatError(
                        f"node {n.name!r} consumes {i!r}, which is not an earlier node",
                        "profile nodes must be listed in a topological order")
            for v, what in ((n.forward_s, "forward_s"), (n.backward_s, "backward_s"),
                            (n.update_s, "update_s"),
                            (n.activation_bytes, "activation_bytes"), (n.held_bytes, "saved_bytes"),
                            (n.parameter_bytes, "parameter_bytes")):
                if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                    raise ProfileFormatError(f"node {n.name!r} has invalid {what}={v!r}",
                                             "times and sizes must be finite and non-negative")
            seen.add(n.name)

    # --- derived views -------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.nodes)

    @property
    def names(self) -> list[str]:
        return [n.name for n in self.nodes]

    @property
    def total_compute_s(self) -> float:
        return sum(n.compute_s for n in self.nodes)

    @property
    def total_update_s(self) -> float:
        return sum(n.update_s for n in self.nodes)

    @property
    def overheads(self) -> Overheads:
        """What the runtime pays per stage beyond the nodes (``meta["overheads"]``; zero in
        profiles that record none): see :mod:`fxpipe.costmodel.overheads`."""
        return overheads_of(self.meta)

    @property
    def total_parameter_bytes(self) -> float:
        return sum(n.parameter_bytes for n in self.nodes)

    def consumers(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {n.name: [] for n in self.nodes}
        for n in self.nodes:
            for i in n.inputs:
                out[i].append(n.name)
        return out

    # --- serialisation -------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {"format": PROFILE_FORMAT, "batch_size": self.batch_size, "device": self.device,
                "source": self.source, "meta": self.meta,
                "nodes": [asdict(n) for n in self.nodes]}

    @classmethod
    def from_dict(cls, d: Any, origin: str = "<dict>") -> Profile:
        if not isinstance(d, dict) or d.get("format") != PROFILE_FORMAT:
            raise ProfileFormatError(
                f"{origin} is not an fxpipe profile (expected format {PROFILE_FORMAT!r})",
                "save profiles with Profile.save(); import PipeDream's with Profile.from_pipedream()")
        try:
            nodes = tuple(
                ProfileNode(**{**nd, "inputs": tuple(nd.get("inputs", ())),
                               "params": tuple(nd.get("params", ())),
                               "shared_params": tuple(nd.get("shared_params", ()))})
                for nd in d["nodes"])
        except (KeyError, TypeError) as e:
            raise ProfileFormatError(f"malformed node in {origin}: {e}",
                                     "regenerate the profile with fxpipe") from None
        return cls(nodes=nodes, batch_size=d.get("batch_size"), device=d.get("device", "unknown"),
                   source=d.get("source", "fxpipe"), meta=dict(d.get("meta") or {}))

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write JSON atomically (write a temporary file, then rename)."""
        write_json_atomic(path, self.to_dict())

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Profile:
        d = read_json(path, ProfileFormatError, "profile", "pass a file written by Profile.save()")
        return cls.from_dict(d, origin=repr(str(path)))

    @classmethod
    def from_pipedream(cls, path: str | os.PathLike[str]) -> Profile:
        """Import PipeDream's ``graph.txt`` (see fxpipe.costmodel.pipedream)."""
        graph = read_pipedream_graph(path)
        return cls(nodes=tuple(ProfileNode(**n) for n in graph.nodes), batch_size=graph.batch_size,
                   device="pipedream-gpu", source=graph.source,
                   meta={"dropped_sinks": graph.dropped_sinks})
