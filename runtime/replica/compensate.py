"""Momentum correction for stale stages: spike compensation (Kosson et al., 2020), SGD/Adam/AdamW.

For a delay D, SGD steps ``w -= lr (a v + b g)``, ``a = m^D``, ``b = (1 - m^D) / (1 - m)``, and Adam
uses ``a mt + b g``, ``a = b1^D``, ``b = 1 - b1^D``: each gradient acts as undelayed momentum's.
"""
from __future__ import annotations

import math
import types
from typing import Any

import torch

from fxpipe.errors import ConfigError


def spike_compensate(opt: torch.optim.Optimizer, delay: int) -> torch.optim.Optimizer:
    """Make ``opt`` (an SGD, Adam or AdamW instance) step with spike compensation for a
    stage ``delay`` own updates stale; returns ``opt`` itself (its ``step`` is replaced)."""
    if delay < 0:
        raise ConfigError(f"delay={delay}", "a delay counts updates: 0 or more")
    kind = type(opt)
    if kind is torch.optim.SGD:
        _refuse(opt, {"nesterov": False, "dampening": 0, "maximize": False,
                      "differentiable": False})
        step = _sgd_step
    elif kind in (torch.optim.Adam, torch.optim.AdamW):
        _refuse(opt, {"amsgrad": False, "maximize": False, "capturable": False,
                      "differentiable": False})
        step = _adam_step
    else:
        raise ConfigError(f"momentum correction for {kind.__name__}",
                          "it is written for torch.optim.SGD, Adam and AdamW; write your own "
                          "in the optimizer factory (it receives stage= and delay=)")
    if delay == 0:
        return opt
    opt._fxpipe_delay = delay  # type: ignore[attr-defined]
    opt.step = types.MethodType(step, opt)  # type: ignore[method-assign]
    return opt


def _refuse(opt: torch.optim.Optimizer, required: dict[str, Any]) -> None:
    for group in opt.param_groups:
        for key, want in required.items():
            if key in group and group[key] != want:
                raise ConfigError(f"momentum correction with {type(opt).__name__}({key}="
                                  f"{group[key]!r})", f"use {key}={want!r}, or no momentum "
                                  "correction")


@torch.no_grad()
def _sgd_step(self: torch.optim.SGD, closure: Any = None) -> Any:
    """torch.optim.SGD's step (weight decay, momentum buffer initialised to the first gradient)
    with the update direction ``a v + b g`` (docs/design-notes.md)."""
    loss = None if closure is None else closure()
    D = self._fxpipe_delay  # type: ignore[attr-defined]
    for group in self.param_groups:
        lr, m, wd = group["lr"], group["momentum"], group["weight_decay"]
        a = m ** D
        b = (1.0 - a) / (1.0 - m) if m != 1.0 else float(D)
        for p in group["params"]:
            if p.grad is None:
                continue
            g = p.grad if wd == 0 else p.grad.add(p, alpha=wd)
            if m == 0:
                p.add_(g, alpha=-lr)
                continue
            state = self.state[p]
            buf = state.get("momentum_buffer")
            if buf is None:
                buf = state["momentum_buffer"] = g.detach().clone()
            else:
                buf.mul_(m).add_(g)
            p.add_(buf, alpha=-lr * a).add_(g, alpha=-lr * b)
    return loss


@torch.no_grad()
def _adam_step(self: torch.optim.Optimizer, closure: Any = None) -> Any:
    """torch.optim.Adam / AdamW's step (bias correction, L2 or decoupled weight decay) with the
    first moment replaced by ``a exp_avg + b g`` in the update (docs/design-notes.md)."""
    loss = None if closure is None else closure()
    D = self._fxpipe_delay  # type: ignore[attr-defined]
    decoupled = isinstance(self, torch.optim.AdamW) or any(
        g.get("decoupled_weight_decay", False) for g in self.param_groups)
    for group in self.param_groups:
        lr, (b1, b2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
        a, b = b1 ** D, 1.0 - b1 ** D
        for p in group["params"]:
            if p.grad is None:
                continue
            g = p.grad
            state = self.state[p]
            if not state:
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["step"] += 1
            t = float(state["step"])
            if wd != 0:
                if decoupled:
                    p.mul_(1.0 - lr * wd)
                else:
                    g = g.add(p, alpha=wd)
            state["exp_avg"].lerp_(g, 1.0 - b1)
            state["exp_avg_sq"].mul_(b2).addcmul_(g, g, value=1.0 - b2)
            bc1, bc2 = 1.0 - b1 ** t, 1.0 - b2 ** t
            denom = (state["exp_avg_sq"].sqrt() / math.sqrt(bc2)).add_(eps)
            num = state["exp_avg"].mul(a).add_(g, alpha=b)
            p.addcdiv_(num, denom, value=-lr / bc1)
    return loss
