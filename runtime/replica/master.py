"""float32 master weights for low-precision parameters (the Megatron / DeepSpeed / apex rule).

The optimizer steps float32 masters, copied down into the float16/bfloat16 parameters, whose
gradients are summed in float32. ``master_weights=None`` (default): on where a stage has one.
"""
from __future__ import annotations

from typing import Mapping, Sequence

import torch

from ..errors import RuntimeConfigError

LOW_PRECISION = (torch.float16, torch.bfloat16)
MASTER_DTYPE = torch.float32


def check_master_weights(master_weights: object) -> bool | None:
    """The option as given (None, True or False), or a clear error."""
    if master_weights is not None and not isinstance(master_weights, bool):
        raise RuntimeConfigError(f"master_weights={master_weights!r}",
                                 "use None (automatic: on for float16/bfloat16 parameters), "
                                 "True or False")
    return master_weights


class MasterWeights:
    """The float32 masters of one stage replica's low-precision trainable parameters.

    ``latest``: the replica's newest weights by name; ``trainable``: the names the optimizer
    steps; ``enabled``: the option (None: automatic, see docs/design-notes.md)."""

    def __init__(self, latest: Mapping[str, torch.Tensor], trainable: Sequence[str],
                 enabled: bool | None) -> None:
        low = [n for n in trainable if latest[n].dtype in LOW_PRECISION]
        on = bool(low) if enabled is None else enabled
        self.master: dict[str, torch.Tensor] = {
            n: latest[n].detach().to(MASTER_DTYPE, copy=True).requires_grad_(True)
            for n in (low if on else [])}

    def grad_dtype(self, name: str, param: torch.Tensor) -> torch.dtype:
        """The dtype ``name``'s gradients are accumulated, reduced and clipped in."""
        return MASTER_DTYPE if name in self.master else param.dtype

    def optimizer_params(self, latest: Mapping[str, torch.Tensor],
                         trainable: Sequence[str]) -> list[torch.Tensor]:
        """What the optimizer steps, in ``trainable`` order: the master of a low-precision
        parameter, else the parameter itself."""
        return [self.master.get(n, latest[n]) for n in trainable]

    def set_grads(self, latest: Mapping[str, torch.Tensor],
                  grads: Mapping[str, torch.Tensor | None]) -> None:
        """Give the optimizer's tensors their gradients (None: no step for that one)."""
        for n, g in grads.items():
            target = self.master.get(n, latest[n])
            target.grad = g if g is None or g.dtype == target.dtype else g.to(target.dtype)

    def clear_grads(self, latest: Mapping[str, torch.Tensor], names: Sequence[str]) -> None:
        for n in names:
            self.master.get(n, latest[n]).grad = None

    @torch.no_grad()
    def copy_down(self, latest: Mapping[str, torch.Tensor]) -> None:
        """Round every master into its low-precision parameter (after a step)."""
        for n, m in self.master.items():
            latest[n].copy_(m)

    @torch.no_grad()
    def load(self, masters: Mapping[str, torch.Tensor] | None,
             latest: Mapping[str, torch.Tensor]) -> None:
        """Restore the masters from a checkpoint (in place: the optimizer holds these tensors);
        a checkpoint without them (saved with master weights off) restarts them from the
        loaded weights."""
        for n, m in self.master.items():
            src = (masters or {}).get(n)
            m.copy_(src if src is not None else latest[n])

    def state(self) -> dict[str, torch.Tensor]:
        """The masters for a checkpoint (CPU copies)."""
        return {n: m.detach().cpu().clone() for n, m in self.master.items()}
