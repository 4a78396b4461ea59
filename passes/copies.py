"""Bytes of shared parameters (tied weights, a reused layer) each stage keeps a copy of.

Owned by its first user, a parameter is copied by stage ``[a, e)`` exactly when ``a > owner`` and
its first user at or after ``a`` is below ``e``: monotone in both ends, as the solver needs.
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
