"""The update all stages take together under a flushing schedule: fp16 unscaling, then the clip.

The found-inf flag and the squared norm travel in ONE all-reduce of two float64 numbers
(:func:`step_hook`; :func:`reference_step` in rank order): unscale, clip, then step or skip.
"""
from __future__ import annotations

from typing import Callable, Mapping, Sequence

import torch

from ..schedules.schedule import Rank
from .clipping import coefficient, counted, grad_dtype, scaled, squared_norm
from .stage import StageReplica, TiedParameter

Grads = dict[str, torch.Tensor | None]


def reference_step(grads: Mapping[Rank, Grads], workers: Mapping[Rank, StageReplica],
                   tied: Sequence[TiedParameter], max_norm: float | None) -> dict[Rank, Grads]:
    """The final gradients of every rank's update (all None: the step is skipped), from each
    rank's mean gradients ``grads``; updates every rank's loss scaler."""
    ranks = sorted(grads)
    out = {r: dict(grads[r]) for r in ranks}
    if any(workers[r].scaler is not None for r in ranks):
        found = False
        for r in ranks:
            out[r], flag = workers[r].scaler.unscale(out[r])  # type: ignore[union-attr]
            found = found or bool(flag)
        for r in ranks:
            workers[r].scaler.update(found)  # type: ignore[union-attr]
        if found:
            return {r: {n: None for n in out[r]} for r in ranks}
    if max_norm is None:
        return out
    parts = [squared_norm(out[r], counted(r, workers[r].stash.trainable, tied))
             for r in ranks if r[1] == 0]
    total_sq = parts[0]
    for p in parts[1:]:  # rank order, as the distributed runtime's sum
        total_sq = total_sq + p
    return {r: scaled(out[r], list(out[r]), coefficient(total_sq, max_norm, grad_dtype(out[r])))
            for r in ranks}


def step_hook(replica: StageReplica, names: Sequence[str], max_norm: float | None,
              all_reduce: Callable[[torch.Tensor, str], None]
              ) -> Callable[[Grads], Grads]:
    """The distributed executor's version for one rank: ``replica.clip`` is set to it.
    ``names``: the parameters this rank counts in the norm; ``all_reduce(t, what)`` sums ``t``
    over every rank of the pipeline in place (with the runtime's timeout)."""
    scaler = replica.scaler

    def hook(grads: Grads) -> Grads:
        found = None
        if scaler is not None:
            grads, found = scaler.unscale(grads)
        dev = next((g.device for g in grads.values() if g is not None), torch.device("cpu"))
        sq = (squared_norm(grads, names) if max_norm is not None
              else torch.zeros((), dtype=torch.float64, device=dev))
        flag = found.to(sq.device, torch.float64) if found is not None else torch.zeros_like(sq)
        both = torch.stack([sq.reshape(()), flag.reshape(())])
        all_reduce(both, f"gradient norm and overflow U{replica.stash.version}")
        if scaler is not None:
            overflow = bool(both[1] > 0)
            scaler.update(overflow)
            if overflow:
                return {n: None for n in grads}
        if max_norm is None:
            return grads
        return scaled(grads, list(grads), coefficient(both[0], max_norm, grad_dtype(grads)))

    return hook
