"""Weight stashing (PipeDream): per stage replica, the latest weights plus older versions in use.

A version is a dict of tensors the minibatches reading it share; an update copies the weights first
(into a dropped version's spares) only while the current version is still needed, else in place.
"""
from __future__ import annotations

import logging
from collections import Counter
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch

from ..errors import StashError
from .master import MasterWeights

log = logging.getLogger(__name__)

OptimizerFactory = Callable[[list[torch.Tensor]], torch.optim.Optimizer]


class WeightStash:
    """Weight versions of one stage replica and the optimizer that produces new ones.

    ``params``: the stage's parameters by name (copied: a replica owns its weights).
    ``planned_reads``: version -> number of forwards that will read it (from the rank's action
    list). Needed when a forward may read an OLDER version than the latest (vertical sync): the
    stash then keeps that version alive. Without it only in-flight versions are kept.
    ``master_weights``: float32 masters for low-precision parameters (:mod:`.master`; None:
    automatic, on when some trainable parameter is float16 or bfloat16).
    """

    def __init__(self, params: Mapping[str, torch.Tensor], optimizer_factory: OptimizerFactory,
                 *, stashing: bool = True, planned_reads: Mapping[int, int] | None = None,
                 device: torch.device | None = None, master_weights: bool | None = None
                 ) -> None:
        self.stashing = stashing
        self._latest: dict[str, torch.Tensor] = {
            n: (p.detach().to(device, copy=True) if device is not None else p.detach().clone()
                ).requires_grad_(p.requires_grad) for n, p in params.items()}
        self.trainable: tuple[str, ...] = tuple(n for n, p in self._latest.items()
                                                if p.requires_grad)
        self.masters = MasterWeights(self._latest, self.trainable, master_weights)
        self.grad_dtypes: dict[str, torch.dtype] = {
            n: self.masters.grad_dtype(n, self._latest[n]) for n in self.trainable}
        """The dtype each trainable parameter's gradients are summed, reduced and clipped in."""
        # a stage without trainable parameters (an activation alone) has no optimizer
        self.optimizer: torch.optim.Optimizer | None = (
            optimizer_factory(self.masters.optimizer_params(self._latest, self.trainable))
            if self.trainable else None)
        self.version = 0
        self._older: dict[int, dict[str, torch.Tensor]] = {}
        self._inflight: dict[int, int] = {}  # minibatch -> version its forward read
        self._reads: Counter[int] = Counter(planned_reads or {})
        # a dropped version's own tensors, by parameter name, for the next copy-on-write (see
        # docs/design-notes.md): a parameter's versions all share its shape, dtype and device
        self._spare: dict[str, torch.Tensor] = {}
        self.peak_bytes = self.bytes_held()
        self._peak_versions = 0  # most old versions held at once (see update)

    # ------------------------------------------------------------------ reading versions
    @property
    def latest(self) -> dict[str, torch.Tensor]:
        """The newest weights (the optimizer's tensors). Do not modify in place."""
        return self._latest

    def versions_held(self) -> list[int]:
        """Version numbers currently held, oldest first (the latest is always held)."""
        return sorted(set(self._older) | {self.version})

    def get(self, version: int) -> dict[str, torch.Tensor]:
        """The weights of ``version``; :class:`StashError` if it is no longer held."""
        if version == self.version:
            return self._latest
        if version in self._older:
            return self._older[version]
        raise StashError(f"weight version {version} is not held (held: {self.versions_held()})",
                         "the schedule reads a version that was dropped: pass planned_reads")

    def acquire(self, minibatch: int, version: int | None) -> dict[str, torch.Tensor]:
        """Weights for the forward of ``minibatch`` (``version`` None = latest); remembers them
        for its backward when stashing."""
        v = self.version if version is None else version
        if v > self.version:
            raise StashError(f"forward of minibatch {minibatch} reads version {v} but only "
                             f"{self.version} updates happened", "check the schedule's versions")
        if minibatch in self._inflight:
            raise StashError(f"minibatch {minibatch} is already in flight",
                             "each minibatch has one forward per stage replica")
        weights = self.get(v)
        if self._reads[v] > 0:
            self._reads[v] -= 1
        if self.stashing:
            self._inflight[minibatch] = v
        return weights

    def for_backward(self, minibatch: int) -> tuple[int, dict[str, torch.Tensor]]:
        """(version, weights) the backward of ``minibatch`` must use: the forward's when
        stashing, else the latest."""
        if not self.stashing:
            return self.version, self._latest
        if minibatch not in self._inflight:
            raise StashError(f"backward of minibatch {minibatch} without its forward",
                             "run F<k> before B<k> on the same replica")
        v = self._inflight[minibatch]
        return v, self.get(v)

    def release(self, minibatch: int) -> None:
        """The backward of ``minibatch`` is done: its version may be dropped."""
        self._inflight.pop(minibatch, None)
        self._collect()

    # ------------------------------------------------------------------ updating
    def update(self, grads: Mapping[str, torch.Tensor | None]) -> int:
        """Apply one optimizer step with ``grads`` (by name, every trainable param) to the latest
        weights; returns the new version number. A None gradient leaves that parameter exactly
        in place (the optimizer sees ``grad=None`` and skips it, as torch.optim does for a
        parameter that got no gradient: no weight decay, no momentum); all None skips the
        step, but the version still advances."""
        copied = False
        if self.optimizer is None:
            if self._needed(self.version):  # nothing trainable: every version is the same dict
                self._older[self.version] = self._latest
        else:
            if self._needed(self.version):
                self._copy_on_write()
                copied = True
            else:  # in place: nobody reads the current version; spares would only sit idle
                self._spare.clear()
            # None: this parameter takes no step now (all None: a skipped step, no call at all)
            self.masters.set_grads(self._latest, {n: grads[n] for n in self.trainable})
            if any(grads[n] is not None for n in self.trainable):
                self.optimizer.step()
            self.masters.clear_grads(self._latest, self.trainable)
            self.masters.copy_down(self._latest)
        self.version += 1
        self._collect()
        if copied and len(self._older) > self._peak_versions:
            # every copy-on-write version holds the same trainable tensors' bytes, so the bytes
            # held only reach a new peak with a new largest number of versions (a pipedream input
            # stage copies on every update; summing its storages each time cost ~0.05 ms)
            self._peak_versions = len(self._older)
            self.peak_bytes = max(self.peak_bytes, self.bytes_held())
        return self.version

    def rebase(self) -> None:
        """Call the latest weights version 0 again (a new schedule starts counting from 0)."""
        if self._inflight:
            raise StashError(f"rebase with minibatches {sorted(self._inflight)} in flight",
                             "finish every backward before starting a new schedule")
        self._older.clear()
        self._spare.clear()
        self.version = 0

    def set_planned_reads(self, planned_reads: Mapping[int, int]) -> None:
        """Declare the forwards of the next schedule (see the class doc)."""
        self._reads = Counter(planned_reads)

    def _copy_on_write(self) -> None:
        """Keep the current tensors as an old version; give the optimizer copies (written into
        spares of a dropped version when there are some, else fresh clones). The spares are
        written in one ``torch._foreach_copy_`` call: in steady state every tensor has a spare,
        and a per-tensor ``copy_`` loop cost more than the copy itself on a stage of many small
        tensors (the zoo's GPT mini's first half, 74 tensors: a pipedream update of its input
        stage took 0.80 ms with the loop, 0.57 ms with one call and the peak re-summed less)."""
        old = self._latest
        new = dict(old)
        dsts: list[torch.Tensor] = []
        srcs: list[torch.Tensor] = []
        spare = self._spare
        for n in self.trainable:
            free = spare.get(n)
            if free is not None:
                new[n] = free
                dsts.append(free)
                srcs.append(old[n])
            else:
                new[n] = old[n].detach().clone().requires_grad_(True)
        if dsts:
            with torch.no_grad():
                torch._foreach_copy_(dsts, srcs)
        self._spare.clear()
        swap = {id(old[n]): new[n] for n in self.trainable}
        assert self.optimizer is not None
        for group in self.optimizer.param_groups:
            group["params"] = [swap.get(id(p), p) for p in group["params"]]
        state = self.optimizer.state
        for n in self.trainable:
            st = state.pop(old[n], None)
            if st is not None:
                state[new[n]] = st
        self._older[self.version] = old
        self._latest = new
        log.debug("version %d stashed (%d tensors copied, %d into spares)", self.version,
                  len(self.trainable), len(dsts))

    def _needed(self, v: int) -> bool:
        return self._reads[v] > 0 or v in self._inflight.values()

    def _collect(self) -> None:
        """Drop the old versions nobody needs; keep one version's trainable tensors as spares
        (they are the stash's own copies: no other version or the optimizer holds them, and the
        graphs of the minibatches that read them are gone)."""
        for v in [v for v in self._older if not self._needed(v)]:
            dropped = self._older.pop(v)
            if not self._spare:
                latest = self._latest
                for n in self.trainable:
                    t = dropped[n]
                    if t is not latest[n]:
                        t.grad = None
                        self._spare[n] = t

    # ------------------------------------------------------------------ accounting
    def bytes_held(self) -> int:
        """Bytes of the unique tensor storages across the latest and all stashed versions."""
        return _unique_bytes(t for d in [self._latest, *self._older.values()] for t in d.values())

    def spare_bytes(self) -> int:
        """Bytes kept for the next copy-on-write (a dropped version's tensors; not counted in
        :meth:`bytes_held`, and never more than one version's worth)."""
        return _unique_bytes(self._spare.values())


def _unique_bytes(tensors: Iterable[torch.Tensor]) -> int:
    seen: dict[tuple[int, int], int] = {}
    for t in tensors:
        key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        seen[key] = t.untyped_storage().nbytes()
    return sum(seen.values())


_Slots = list[tuple[str, list[tuple[dict, str]]]]


def tensor_slots(gm: torch.nn.Module) -> _Slots | None:
    """Where each parameter and buffer of ``gm`` lives: name (the first name of that tensor, as
    ``named_parameters()`` / ``named_buffers()`` give it) -> every (``_parameters`` or
    ``_buffers`` dict, key) holding it (a tensor shared under several names gets the same value
    at each, as ``functional_call`` unties them). None (use ``functional_call``) for modules with
    parametrizations, which need its re-parametrisation machinery."""
    from torch.nn.utils import parametrize
    if any(parametrize.is_parametrized(m) for m in gm.modules()):
        return None
    first: dict[int, str] = {}
    slots: dict[str, list[tuple[dict, str]]] = {}
    for mname, mod in gm.named_modules(remove_duplicate=False):
        for store in (mod._parameters, mod._buffers):
            for attr, t in store.items():
                if t is None:
                    continue
                name = first.setdefault(id(t), f"{mname}.{attr}" if mname else attr)
                slots.setdefault(name, []).append((store, attr))
    return list(slots.items())


def swapped_call(gm: torch.nn.Module, slots: _Slots,
                  values: tuple[Mapping[str, torch.Tensor], ...], inputs: Sequence[Any]) -> Any:
    """``functional_call(gm, {**values[0], **values[1]}, inputs)`` without its per-call set-up:
    the tensors are put straight into the modules' parameter/buffer dicts (found once by
    :func:`tensor_slots`) and the originals put back afterwards, whatever happens."""
    saved: list[tuple[dict, str, Any]] = []
    try:
        for name, places in slots:
            t = values[1].get(name)
            if t is None:
                t = values[0].get(name)
            if t is None:  # not given: the module's own tensor, as functional_call (strict=False)
                continue
            for store, attr in places:
                saved.append((store, attr, store[attr]))
                store[attr] = t
        return gm(*inputs)
    finally:
        for store, attr, old in reversed(saved):
            store[attr] = old
