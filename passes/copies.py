"""Copies of shared parameters, per stage, for the solver (pure numbers).

A parameter several nodes use (a tied embedding and its head, a reused layer) is owned by its
first user: the profile counts its bytes there once. A stage holding a later user but not the
owner keeps a copy of its own (weights, gradients, optimizer state and stashed versions, like
its own parameters), which the solver must price. The owner being the first user, stage
``[a, e)`` keeps a copy exactly when ``a > owner`` and the first user at or after ``a`` is below
``e``: a table per parameter of that first user answers it for any stage, scalar or vectorised,
and the copies only grow with ``e`` and only shrink, with the owner's own bytes, as ``a`` grows,
so the memory the solver searches on stays monotone in both ends.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

Shared = tuple[int, float, Sequence[int]]
"""A parameter used by several nodes: (the node owning it, its bytes, the other nodes using it)."""


class Copies:
    """Bytes of shared parameters a stage ``[a, e)`` of ``n`` nodes keeps copies of."""

    def __init__(self, shared: Sequence[Shared], n: int) -> None:
        self.firsts: list[tuple[list[int], float]] = []
        self.arrays: list[tuple[np.ndarray, float]] = []
        for owner, nbytes, users in shared:
            if not 0 <= owner < n or not all(owner < u < n for u in users):
                raise ValueError(f"shared parameter owned by node {owner}, used by "
                                 f"{list(users)}: node indices in [0, {n}), users after the "
                                 "owner")
            first, later = [n] * (n + 1), n  # n: no user below any end (or a <= owner)
            for a in range(n - 1, owner, -1):
                if a in users:
                    later = a
                first[a] = later
            self.firsts.append((first, float(nbytes)))
            self.arrays.append((np.asarray(first), float(nbytes)))

    def __bool__(self) -> bool:
        return bool(self.firsts)

    def at(self, a: int, e: int) -> float:
        """The copies' bytes of stage ``[a, e)``."""
        q = 0.0
        for first, nbytes in self.firsts:
            if first[a] < e:
                q += nbytes
        return q

    def many(self, a: np.ndarray, e: np.ndarray) -> np.ndarray:
        """Vectorised :meth:`at`: the same sums in the same order (adding 0.0 is exact)."""
        q = np.zeros(np.broadcast(a, e).shape)
        for first, nbytes in self.arrays:
            q = q + np.where(first[a] < e, nbytes, 0.0)
        return q
