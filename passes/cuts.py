"""Bytes and names of the values live across each cut of a profile's node order (torch-free).

A value live across a cut counts once however many stages read it; a model output stays live to
the end, a value :mod:`.made_here` crosses nothing, and a live non-``sendable`` one costs ``inf``.
"""
from __future__ import annotations

import numpy as np

from fxpipe.costmodel.profile import Profile

from .made_here import inputs_behind_in, per_graph


def _last_use(profile: Profile) -> tuple[int, ...]:
    """Index of the last consumer of each node (its own index when nothing consumes it; the last
    node's for a model output, which the last stage returns). A use of a value made from the
    inputs alone is a use of the model inputs it is made from (the consumer makes it). Once per
    graph (:func:`~.made_here.per_graph`)."""
    return per_graph(profile, "last_use", lambda: tuple(_last_use_of(profile)))


def _last_use_of(profile: Profile) -> list[int]:
    behind = inputs_behind_in(profile)
    index = {n.name: i for i, n in enumerate(profile.nodes)}
    end = len(profile.nodes) - 1
    last = [end if n.is_output else i for i, n in enumerate(profile.nodes)]
    for j, n in enumerate(profile.nodes):
        for name in n.inputs:
            for read in behind.get(name, (name,)):
                i = index[read]
                if j > last[i]:
                    last[i] = j
    return last


def cut_bytes(profile: Profile) -> np.ndarray:
    """Bytes live across each of the ``N-1`` cut positions (``out[p-1]`` for position ``p``).

    ``inf`` where a non-sendable value is live. O(N + edges) via difference arrays; once per
    graph (read-only).
    """
    return per_graph(profile, "cut_bytes", lambda: _read_only(_cut_bytes(profile)))


def _read_only(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


def _cut_bytes(profile: Profile) -> np.ndarray:
    n = len(profile.nodes)
    if n <= 1:
        return np.zeros(0)
    last = _last_use(profile)
    diff = np.zeros(n + 1)
    bad = np.zeros(n + 1, dtype=np.int64)
    for i, node in enumerate(profile.nodes):
        if last[i] > i:  # live across cut positions i+1 .. last[i]
            diff[i + 1] += node.activation_bytes
            diff[last[i] + 1] -= node.activation_bytes
            if not node.sendable:
                bad[i + 1] += 1
                bad[last[i] + 1] -= 1
    # Exact integer-valued byte counts stay exact in float64 up to 2**53 bytes.
    live = np.cumsum(diff)[1:n]
    live = np.maximum(live, 0.0)  # guard against -0.0 / rounding on non-integer sizes
    live[np.cumsum(bad)[1:n] > 0] = np.inf
    return live


def crossing_values(profile: Profile, position: int) -> tuple[str, ...]:
    """Names of the values live across cut ``position`` (1..N-1), in producer order."""
    n = len(profile.nodes)
    if not 1 <= position <= n - 1:
        raise ValueError(f"cut position must be in 1..{n - 1}, got {position}")
    last = _last_use(profile)
    return tuple(profile.nodes[i].name for i in range(position) if last[i] >= position)


def all_crossing_values(profile: Profile, positions: list[int]) -> dict[int, tuple[str, ...]]:
    """:func:`crossing_values` for several positions, sharing one pass over the graph."""
    last = np.asarray(_last_use(profile))
    idx = np.arange(len(last))
    names = profile.names
    return {p: tuple(names[i] for i in np.flatnonzero((idx < p) & (last >= p))) for p in positions}
