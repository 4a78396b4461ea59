"""Muon for a stage's hidden matrices and an element-wise optimizer for the rest, as ONE optimizer.

:class:`MuonWithAdamW` steps ``torch.optim.Muon`` and AdamW (or NAdam) whose param groups and state
ARE its own, so state dicts, LR schedulers and checkpoints are torch's.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from fxpipe.errors import ConfigError

MUON_KEY = "muon"
"""A param group of :class:`MuonWithAdamW` carries ``group["muon"]``: True for Muon's groups."""


class MuonWithAdamW(torch.optim.Optimizer):
    """``torch.optim.Muon(muon_groups, **muon)`` and ``other(other_groups, **rest)`` as one
    optimizer (docs/design-notes.md). Either list may be empty (a stage holding only biases and
    norms has no Muon group). ``other`` is any torch optimizer class taking groups and
    keywords."""

    def __init__(self, muon_groups: Sequence[dict[str, Any]],
                 other_groups: Sequence[dict[str, Any]], *, muon: dict[str, Any] | None = None,
                 other: Callable[..., torch.optim.Optimizer] = torch.optim.AdamW,
                 rest: dict[str, Any] | None = None) -> None:
        # params as lists (a generator would be spent by the emptiness test)
        muon_groups = [dict(g, params=list(g["params"]), **{MUON_KEY: True}) for g in muon_groups]
        other_groups = [dict(g, params=list(g["params"]), **{MUON_KEY: False})
                        for g in other_groups]
        muon_groups = [g for g in muon_groups if g["params"]]
        other_groups = [g for g in other_groups if g["params"]]
        if not muon_groups and not other_groups:
            raise ConfigError("MuonWithAdamW with no parameters", "give it at least one tensor")
        bad = [tuple(p.shape) for g in muon_groups for p in g["params"] if p.dim() != 2]
        if bad:
            raise ConfigError(f"Muon given a tensor of shape {bad[0]}",
                              "Muon steps 2-D matrices only: put other tensors in the "
                              "other optimizer's groups (param_names.muon_groups does)")
        self.muon_options, self.other_kind, self.rest_options = dict(muon or {}), other, dict(
            rest or {})
        self._muon = torch.optim.Muon(muon_groups, **self.muon_options) if muon_groups else None
        self._other = other(other_groups, **self.rest_options) if other_groups else None
        groups = [g for o in (self._muon, self._other) if o is not None for g in o.param_groups]
        super().__init__(groups, {})
        self._link()

    def _link(self) -> None:
        """Point the two inner optimizers at this one's groups and state: after __init__, and
        after ``__setstate__`` (a copy, an unpickling, and torch's ``load_state_dict``, which
        replaces the group dicts through it)."""
        n = len(self._muon.param_groups) if self._muon is not None else 0
        if self._muon is not None:
            self._muon.param_groups, self._muon.state = self.param_groups[:n], self.state
        if self._other is not None:
            self._other.param_groups, self._other.state = self.param_groups[n:], self.state

    def __getstate__(self) -> dict[str, Any]:  # torch's keeps groups and state only
        return {**super().__getstate__(), "_muon": self._muon, "_other": self._other,
                "muon_options": self.muon_options, "other_kind": self.other_kind,
                "rest_options": self.rest_options}

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._link()

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for inner in (self._muon, self._other):
            if inner is not None:
                inner.step()
        return loss

    def inner(self) -> tuple[torch.optim.Optimizer | None, torch.optim.Optimizer | None]:
        """The Muon optimizer and the other one (None where it has no parameters)."""
        return self._muon, self._other
