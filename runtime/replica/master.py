"""float32 master weights for low-precision parameters (the Megatron / DeepSpeed / apex rule).

Why: a model whose parameters are bfloat16 (``model.to(torch.bfloat16)``) cannot be trained by
an optimizer that steps those parameters directly: bfloat16 keeps 8 bits of mantissa, so an
update smaller than 2^-8 of a weight rounds away (a weight of 1.0 ignores every step below
0.0039), and the optimizer's state (momentum, Adam's moments) would be bfloat16 too. The rule of
every large-model trainer is to keep a float32 *master* copy of each low-precision parameter,
give the optimizer the masters (so its state is float32), step them in float32 and copy them
down (rounded to nearest) into the low-precision parameters the forwards and backwards use.

fxpipe's semantics with master weights (``master_weights=None``, the default, turns them on
exactly when some trainable parameter of a stage is float16 or bfloat16; ``True`` asks for them
(float32 parameters need none and are stepped as they are); ``False`` steps the low-precision
parameters directly, as an ablation):

* gradients of a low-precision parameter are accumulated over a round's minibatches, summed
  over replicas (all-reduced) and clipped in float32 (Megatron's
  ``accumulate_allreduce_grads_in_fp32``): each minibatch's gradient, computed in the
  parameter's dtype by autograd, is cast to float32 once and added to a float32 sum;
* the optimizer holds the masters (float32) and the float32 parameters; after its step every
  master is copied into its parameter. Weight stashing stashes the low-precision copies (what
  the forwards read); the masters exist once per replica, never per version;
* a checkpoint saves the masters beside the weights, so a resume continues from the float32
  values, not from their rounded copies (which would not reproduce the uninterrupted run).
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
    steps; ``enabled``: the option (None: automatic, see the module doc)."""

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
