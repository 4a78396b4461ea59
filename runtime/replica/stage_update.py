"""The update half of a stage replica: from its gradient sums to one optimizer step.

``U`` steps with sum / count over the replicas' minibatches since the last update; a parameter no
replica gave a gradient is not stepped (a presence flag per parameter rides in the flat buffer).
"""
from __future__ import annotations

import functools
import time
from typing import Callable, Collection, Mapping, Sequence

import torch

from .stash import WeightStash


class UpdateMixin:
    """Update methods of :class:`fxpipe.runtime.replica.stage.StageReplica` (it provides the
    attributes declared here): the flat gradient layout the all-reduces use, the mean over a round,
    clipping and the optimizer step. Kept apart so the forward/backward reads on its own."""

    stash: WeightStash
    clip: Callable[[dict[str, torch.Tensor | None]], dict[str, torch.Tensor | None]] | None
    clip_local: bool
    on_update: Callable[[], None] | None
    busy_s: float
    _grad_sum: dict[str, torch.Tensor]
    _owned: set[str]
    _count: int

    def local_gradient(self, flags: bool = False) -> torch.Tensor:
        """Flat buffer [sum of gradients of every trainable parameter..., minibatch count]; with
        ``flags``, one presence flag per trainable parameter (1: it has a gradient sum this
        round, 0: none, its part is zeros) between the sums and the count (see docs/design-notes.md:
        what lets summed replicas tell "no gradient anywhere" from "a zero gradient")."""
        names = self.stash.trainable
        dtype, device = self._tail()
        tail = [1.0 if n in self._grad_sum else 0.0 for n in names] if flags else []
        return torch.cat([*map(self._flat_part, names),
                          torch.tensor(tail + [float(self._count)], dtype=dtype, device=device)])

    def local_segment(self, names: Sequence[str]) -> torch.Tensor:
        """``segment(local_gradient(flags=True), names, flags=True)`` without building the
        stage's whole flat buffer (a copy of every gradient): what a lone replica with tied
        parameters all-reduces. Same values and dtype, bit for bit."""
        tail_dtype, device = self._tail()
        (_, dtype) = self.segment_spec(names)
        flags = [1.0 if n in self._grad_sum else 0.0 for n in names]
        return torch.cat([*(self._flat_part(n).to(dtype) for n in names),
                          torch.tensor(flags, dtype=tail_dtype, device=device).to(dtype)])

    def segment_spec(self, names: Sequence[str]) -> tuple[tuple[int], torch.dtype]:
        """Shape and dtype of :meth:`local_segment` for ``names``, known before any gradient
        (a receive of the other holder's part is posted that early)."""
        # torch.cat of the whole buffer promotes over every part: so must the segment
        dtype = functools.reduce(torch.promote_types,
                                 [self.stash.grad_dtypes[n] for n in self.stash.trainable],
                                 self._tail()[0])
        return (sum(self.stash.latest[n].numel() for n in names) + len(names),), dtype

    def _flat_part(self, name: str) -> torch.Tensor:
        """``name``'s gradient sum flattened (zeros in the gradients' dtype when it has none)."""
        g = self._grad_sum.get(name)
        if g is None:
            g = torch.zeros_like(self.stash.latest[name], dtype=self.stash.grad_dtypes[name])
        return g.reshape(-1)

    def _tail(self) -> tuple[torch.dtype, torch.device]:
        """dtype and device of the flat buffer's flags and count: the first trainable
        parameter's gradient dtype (the weights' dtype when there is none)."""
        ref = next(iter(self.stash.latest.values()), torch.zeros(()))
        return next((self.stash.grad_dtypes[n] for n in self.stash.trainable), ref.dtype), \
            ref.device

    def _offsets(self) -> dict[str, tuple[int, int]]:
        """name -> (offset, numel) in the flat buffer of :meth:`local_gradient`."""
        out, off = {}, 0
        for n in self.stash.trainable:
            out[n] = (off, self.stash.latest[n].numel())
            off += out[n][1]
        return out

    def _flag_offsets(self) -> dict[str, int]:
        """name -> index of its presence flag in a ``local_gradient(flags=True)`` buffer."""
        start = sum(self.stash.latest[n].numel() for n in self.stash.trainable)
        return {n: start + i for i, n in enumerate(self.stash.trainable)}

    def segment(self, flat: torch.Tensor, names: Sequence[str], *,
                flags: bool = False) -> torch.Tensor:
        """The parts of ``flat`` (a :meth:`local_gradient` layout) for ``names``, concatenated
        (a copy): what a tied-parameter all-reduce sends. ``flags``: ``flat`` has presence
        flags, and the segment ends with those of ``names`` (so the sum over the tie's holders
        tells whether any of them had a gradient)."""
        offs = self._offsets()
        parts = [flat[offs[n][0]:offs[n][0] + offs[n][1]] for n in names]
        if flags:
            fo = self._flag_offsets()
            parts += [flat[fo[n]:fo[n] + 1] for n in names]
        return torch.cat(parts)

    def split_segment(self, seg: torch.Tensor, names: Sequence[str], *,
                      flags: bool = False) -> dict[str, torch.Tensor | None]:
        """The parts of ``seg`` (a :meth:`segment` layout) by name, shaped like the weights;
        with ``flags``, None for a name whose flag is 0 (no holder had a gradient: no step)."""
        out: dict[str, torch.Tensor | None] = {}
        pos = 0
        for n in names:
            p = self.stash.latest[n]
            out[n] = seg[pos:pos + p.numel()].view(p.shape)
            pos += p.numel()
        if flags:
            present = seg[pos:pos + len(names)].tolist()
            out.update({n: None for n, f in zip(names, present) if not f > 0})
        return out

    def put_segment(self, flat: torch.Tensor, names: Sequence[str], seg: torch.Tensor, *,
                    flags: bool = False) -> None:
        """Write ``seg`` (the layout of :meth:`segment`, same ``flags``) back into ``flat`` in
        place."""
        offs, pos = self._offsets(), 0
        for n in names:
            off, numel = offs[n]
            flat[off:off + numel] = seg[pos:pos + numel]
            pos += numel
        if flags:
            fo = self._flag_offsets()
            for n in names:
                flat[fo[n]] = seg[pos]
                pos += 1

    def apply_update(self, total: torch.Tensor,
                     tied: Mapping[str, torch.Tensor | None] | None = None, *,
                     flags: bool = False) -> int:
        """Step the optimizer with the mean gradient in ``total`` (the sum over the stage's
        replicas of :meth:`local_gradient`, with presence flags when ``flags``); returns the new
        weight version. ``total`` is consumed: its parts are divided in place and handed to the
        optimizer as views. ``tied``: gradients (already means) used instead of ``total``'s for
        those names, None for "no step for this parameter now" (delayed tied rounds, see
        reference.tied_delay)."""
        return self.finish_update(self.update_grads(total, tied, flags=flags))

    def update_grads(self, total: torch.Tensor,
                     tied: Mapping[str, torch.Tensor | None] | None = None, *,
                     flags: bool = False) -> dict[str, torch.Tensor | None]:
        """The mean gradients :meth:`apply_update` steps with (before clipping); resets the
        round's sums. ``flags``: ``total`` carries presence flags; a parameter whose summed flag
        is 0 (no replica had a gradient) gets None, so it takes no step. The reference executor
        clips them over all stages in between."""
        count = float(total[-1])
        grads: dict[str, torch.Tensor | None] = {}
        offset = 0
        for n in self.stash.trainable:
            p = self.stash.latest[n]
            grads[n] = total[offset:offset + p.numel()].reshape(p.shape)
            offset += p.numel()
        if flags:
            present = total[offset:offset + len(self.stash.trainable)].tolist()
            grads.update({n: None for n, f in zip(self.stash.trainable, present) if not f > 0})
        fixed = dict(tied or {})
        grads.update(fixed)
        return self.mean_grads(grads, count, writable=grads, fixed=fixed)

    def apply_local_update(self, tied: Mapping[str, torch.Tensor | None] | None = None, *,
                           tied_means: bool = False) -> int:
        """The update of a lone replica (one per stage): its own gradient sums go straight to
        the optimizer, with no flat buffer; the same values as
        ``apply_update(local_gradient(flags=True), ..., flags=True)``: a parameter without a
        gradient sum gets None (not stepped, as torch.optim skips ``grad=None``). ``tied``:
        the tied parameters' gradients in place of the replica's own: sums over the tie's
        holders in tensors of the caller's (divided by the count like the rest), or, with
        ``tied_means``, means used as given (None: no step now)."""
        grads: dict[str, torch.Tensor | None] = {n: self._grad_sum.get(n)
                                                 for n in self.stash.trainable}
        grads.update(tied or {})
        fixed = set(tied or ()) if tied_means else set()
        writable = {n for n in grads if n not in fixed and (n in self._owned or n in (tied or ()))}
        return self.apply_grads(grads, float(self._count), writable=writable, fixed=fixed)

    def apply_grads(self, grads: Mapping[str, torch.Tensor | None], count: float, *,
                    writable: Collection[str], fixed: Collection[str] = ()) -> int:
        """Step the optimizer with ``grads[n] / count`` (every trainable name; ``count`` 0:
        no minibatch, the sums are used as they are; 1: nothing to divide, ``x / 1 == x``).
        Names in ``writable`` are divided in place, the others into a new tensor; names in
        ``fixed`` are used as given (None: that parameter takes no step). Resets the round's
        sums and count, clips (:attr:`clip`), calls :attr:`on_update`; returns the new weight
        version."""
        return self.finish_update(self.mean_grads(grads, count, writable=writable, fixed=fixed))

    def mean_grads(self, grads: Mapping[str, torch.Tensor | None], count: float, *,
                   writable: Collection[str], fixed: Collection[str] = ()
                   ) -> dict[str, torch.Tensor | None]:
        """``grads / count`` (see :meth:`apply_grads`); resets the round's sums and count."""
        if count > 0 and count != 1:
            grads = {n: g if n in fixed or g is None else g.div_(count) if n in writable
                     else g / count for n, g in grads.items()}
        self._grad_sum.clear()
        self._owned.clear()
        self._count = 0
        return dict(grads)

    def finish_update(self, grads: dict[str, torch.Tensor | None]) -> int:
        """Clip (:attr:`clip`) and step with the mean gradients ``grads``."""
        if self.clip is not None:
            grads = self.clip(grads)
        return self.step(grads)

    def step(self, grads: Mapping[str, torch.Tensor | None]) -> int:
        """One optimizer step with final gradients; calls :attr:`on_update`."""
        t0 = time.perf_counter()
        version = self.stash.update(grads)
        if self.on_update is not None:
            self.on_update()
        self.busy_s += time.perf_counter() - t0
        return version

    def apply_tied_only(self, tied: Mapping[str, torch.Tensor]) -> int:
        """One optimizer step of the tied parameters alone (every other parameter's gradient
        None, so it does not move): what completes the delayed tied rounds at a segment end.
        Does not call :attr:`on_update` (it finishes earlier updates, it is not a new one)."""
        grads: dict[str, torch.Tensor | None] = {n: None for n in self.stash.trainable}
        grads.update(tied)
        if self.clip is not None and self.clip_local:
            grads = self.clip(grads)
        return self.stash.update(grads)
