"""Delay-matched Nesterov momentum for stale stages (``schedule="pipedream+nesterov"``).

The optimizer becomes its Nesterov form (SGD, NAdam, Muon) with momentum ``beta + d_s (0.99 - beta)
/ S`` for stage s's delay d_s of S stages (Ajanthan et al., ICML 2025); 0.99 and above is kept.
"""
from __future__ import annotations

from typing import Any

import torch

from fxpipe.errors import ConfigError

from .muon import MUON_KEY, MuonWithAdamW

BETA_MAX = 0.99
"""The authors' ceiling (main_with_runtime.py's ``--adaptive_momentum``)."""


def matched_momentum(beta: float, delay: int, depth: int, top: float = BETA_MAX) -> float:
    """``beta + delay (top - beta) / depth``; ``beta`` itself for no delay or ``beta >= top``."""
    if delay < 0 or depth < 1:
        raise ConfigError(f"delay={delay}, depth={depth}", "a delay >= 0 in a pipeline of >= 1 "
                          "stages")
    if delay == 0 or beta >= top:
        return beta
    return beta + delay * (top - beta) / depth


def _refuse(opt: torch.optim.Optimizer, required: dict[str, Any]) -> None:
    for group in opt.param_groups:
        for key, want in required.items():
            if key in group and group[key] != want:
                raise ConfigError(f"pipedream+nesterov with {type(opt).__name__}({key}="
                                  f"{group[key]!r})", f"use {key}={want!r}, or another mitigation")


def _keep(group: dict[str, Any], *keys: str) -> dict[str, Any]:
    return {k: group[k] for k in ("params", *keys) if k in group}


def _sgd(opt: torch.optim.Optimizer, delay: int, depth: int, top: float) -> torch.optim.Optimizer:
    _refuse(opt, {"dampening": 0, "maximize": False})
    groups = []
    for g in opt.param_groups:
        beta = matched_momentum(g["momentum"], delay, depth, top)
        groups.append({**_keep(g, "lr", "weight_decay"), "momentum": beta, "nesterov": beta > 0})
    return torch.optim.SGD(groups)


def _nadam_groups(opt: torch.optim.Optimizer, groups: list[dict[str, Any]], delay: int,
                  depth: int, top: float) -> list[dict[str, Any]]:
    _refuse(opt, {"amsgrad": False, "maximize": False})
    out = []
    for g in groups:
        b1, b2 = g["betas"]
        out.append({**_keep(g, "lr", "eps", "weight_decay"),
                    "betas": (matched_momentum(b1, delay, depth, top), b2)})
    return out


def _decoupled(opt: torch.optim.Optimizer) -> bool:
    return isinstance(opt, torch.optim.AdamW) or any(
        g.get("decoupled_weight_decay", False) for g in opt.param_groups)


def _muon_groups(groups: list[dict[str, Any]], delay: int, depth: int,
                 top: float) -> list[dict[str, Any]]:
    return [{**{k: v for k, v in g.items() if k != MUON_KEY},
             "momentum": matched_momentum(g["momentum"], delay, depth, top), "nesterov": True}
            for g in groups]


def nesterov_form(opt: torch.optim.Optimizer, delay: int, depth: int,
                  top: float = BETA_MAX) -> torch.optim.Optimizer:
    """A new optimizer over ``opt``'s groups: its Nesterov form with the delay-matched momentum
    (docs/design-notes.md). ``opt`` must be fresh (no state yet): the replica calls this as it
    builds it."""
    if any(opt.state.values()):
        raise ConfigError("pipedream+nesterov on an optimizer that has stepped",
                          "a bug: the mitigation applies as the replica builds its optimizer")
    kind = type(opt)
    if kind is torch.optim.SGD:
        return _sgd(opt, delay, depth, top)
    if kind in (torch.optim.Adam, torch.optim.AdamW):
        return torch.optim.NAdam(_nadam_groups(opt, opt.param_groups, delay, depth, top),
                                 decoupled_weight_decay=_decoupled(opt))
    if kind is torch.optim.Muon:
        return torch.optim.Muon(_muon_groups(opt.param_groups, delay, depth, top))
    if kind is MuonWithAdamW:
        muon, other = opt.inner()
        if other is not None and type(other) not in (torch.optim.Adam, torch.optim.AdamW):
            raise ConfigError(f"pipedream+nesterov with MuonWithAdamW(other="
                              f"{type(other).__name__})", "its element-wise part must be Adam "
                              "or AdamW")
        rest = (_nadam_groups(other, other.param_groups, delay, depth, top)
                if other is not None else [])
        return MuonWithAdamW(_muon_groups(muon.param_groups, delay, depth, top) if muon else [],
                             rest, other=torch.optim.NAdam,
                             rest={"decoupled_weight_decay": other is None or _decoupled(other)})
    raise ConfigError(f"pipedream+nesterov with {kind.__name__}",
                      "it is written for torch.optim.SGD, Adam, AdamW, Muon and MuonWithAdamW; "
                      "write your own in the optimizer factory (it receives stage= and delay=)")
