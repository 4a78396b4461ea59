"""Gradient buckets: a replicated stage's all-reduce overlapped with its last backward, as in DDP.

Hooks of the last backward before ``U`` fill fixed buckets (reverse order of use) and launch them in
index order on every replica; the last bucket also carries presence flags and the minibatch count.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch

DEFAULT_BUCKET_BYTES = 25 * 2**20
"""DDP's default ``bucket_cap_mb`` (25 MiB)."""

Launch = Callable[[int, torch.Tensor], Any]
"""(bucket index, buffer) -> a pending all-reduce (posted through Comm, summing in place)."""


@dataclass(frozen=True)
class Slot:
    """Where one parameter's gradient sum lives: bucket ``bucket``, elements [offset, +numel)."""

    bucket: int
    offset: int
    numel: int


@dataclass(frozen=True)
class BucketLayout:
    """The fixed assignment of a replica's trainable parameters to buckets (docs/design-notes.md).

    ``names``: trainable parameter names in the replica's own (forward) order; ``buckets[i]``:
    the names in bucket i (reverse order of use); ``sizes[i]``: its number of elements (the last
    one has one more: the minibatch count, and with ``flags`` one more per name: the presence
    flags, in ``names`` order, just before the count); ``dtypes[i]``: its dtype (a bucket holds
    one dtype).
    """

    names: tuple[str, ...]
    slots: Mapping[str, Slot]
    buckets: tuple[tuple[str, ...], ...]
    sizes: tuple[int, ...]
    dtypes: tuple[torch.dtype, ...]
    flags: bool = False

    @classmethod
    def build(cls, params: Mapping[str, torch.Tensor], names: Sequence[str],
              cap_bytes: int = DEFAULT_BUCKET_BYTES,
              count_dtype: torch.dtype = torch.float32, flags: bool = False) -> BucketLayout:
        """Greedy packing of ``names`` (reversed) into buckets of at most ``cap_bytes`` (a larger
        parameter gets a bucket of its own; a dtype change starts a new bucket); ``flags``: room
        for the presence flags in the last bucket (docs/design-notes.md)."""
        buckets: list[list[str]] = []
        sizes: list[int] = []
        dtypes: list[torch.dtype] = []
        slots: dict[str, Slot] = {}
        used = 0
        for n in reversed(list(names)):
            p = params[n]
            nbytes = p.numel() * p.element_size()
            if not buckets or dtypes[-1] != p.dtype or (used + nbytes > cap_bytes and used > 0):
                buckets.append([])
                sizes.append(0)
                dtypes.append(p.dtype)
                used = 0
            slots[n] = Slot(len(buckets) - 1, sizes[-1], p.numel())
            buckets[-1].append(n)
            sizes[-1] += p.numel()
            used += nbytes
        if not buckets:  # no trainable parameters: the count alone is still summed
            buckets.append([])
            sizes.append(0)
            dtypes.append(count_dtype)
        sizes[-1] += 1 + (len(names) if flags else 0)
        return cls(tuple(names), slots, tuple(map(tuple, buckets)), tuple(sizes), tuple(dtypes),
                   flags)

    def __len__(self) -> int:
        return len(self.buckets)

    @property
    def tail(self) -> int:
        """Elements at the end of the last bucket that are not gradient sums: the presence
        flags (with ``flags``) and the count."""
        return 1 + (len(self.names) if self.flags else 0)


@dataclass
class GradBuckets:
    """One replica's buckets, reused round after round: fill, launch in order, wait, read back.

    ``launch`` posts one bucket's all-reduce (see :data:`Launch`); ``pending`` holds what it
    returned for each launched bucket of the open round, in bucket order."""

    layout: BucketLayout
    device: torch.device
    launch: Launch
    bufs: list[torch.Tensor] = field(init=False)
    pending: list[Any] = field(init=False, default_factory=list)
    active: bool = field(init=False, default=False)
    _missing: list[int] = field(init=False, default_factory=list)
    _filled: set[str] = field(init=False, default_factory=set)
    _present: set[str] = field(init=False, default_factory=set)
    _views: dict[str, torch.Tensor] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        self.bufs = [torch.zeros(n, dtype=d, device=self.device)
                     for n, d in zip(self.layout.sizes, self.layout.dtypes)]
        # each slot as a flat view, made once: the buffers live as long as the buckets, and
        # slicing 2x per parameter per round is a visible cost on small stages
        self._views = {n: self.bufs[sl.bucket][sl.offset:sl.offset + sl.numel]
                       for n, sl in self.layout.slots.items()}

    def start(self) -> None:
        """Open a round: from now on :meth:`ready` fills slots and launches full buckets."""
        if self.active:
            raise RuntimeError("gradient buckets: a round is already open (missing wait at U)")
        self.active = True
        self.pending, self._filled, self._present = [], set(), set()
        self._missing = [len(names) for names in self.layout.buckets]
        self._missing[-1] += 1  # the count

    def ready(self, name: str, grad_sum: torch.Tensor) -> None:
        """Parameter ``name``'s gradient sum of this round is final (called from a hook in the
        middle of the backward): copy it into its slot; launch every bucket now complete."""
        if name in self._filled:  # a second hook call would double count in the bucket
            raise RuntimeError(f"gradient of {name!r} reported twice in one round")
        self._views[name].copy_(grad_sum.reshape(-1))
        self._filled.add(name)
        self._present.add(name)
        self._missing[self.layout.slots[name].bucket] -= 1
        self._launch_complete()

    def finish(self, grad_sums: Mapping[str, torch.Tensor], count: int) -> None:
        """The backward ended: fill the slots no hook filled (their sum of the round, or zeros),
        the presence flags (with ``layout.flags``) and the count, and launch the remaining
        buckets, in order."""
        dst: list[torch.Tensor] = []
        src: list[torch.Tensor] = []
        for n in self.layout.names:
            if n not in self._filled:
                g = grad_sums.get(n)
                if g is None:
                    self._views[n].zero_()
                else:
                    dst.append(self._views[n])
                    src.append(g.reshape(-1))
                    self._present.add(n)
                self._filled.add(n)
                self._missing[self.layout.slots[n].bucket] -= 1
        if dst:  # one dispatch for all of them (the usual case: no hooks, one bucket)
            torch._foreach_copy_(dst, src)
        last = self.bufs[-1]
        if self.layout.flags:  # one host-to-device copy for flags and count together
            tail = [1.0 if n in self._present else 0.0 for n in self.layout.names]
            last[-self.layout.tail:].copy_(torch.tensor(tail + [float(count)], dtype=last.dtype))
        else:
            last[-1:].fill_(float(count))
        self._missing[-1] -= 1
        self._launch_complete()
        assert len(self.pending) == len(self.bufs), "every bucket must be launched"

    def _launch_complete(self) -> None:
        """Launch, in index order, the buckets whose slots are all filled (DDP's rule: bucket i
        waits for i-1, so every replica posts the same collectives in the same order)."""
        i = len(self.pending)
        while i < len(self.bufs) and self._missing[i] == 0:
            self.pending.append(self.launch(i, self.bufs[i]))
            i += 1

    @property
    def early(self) -> frozenset[str]:
        """Names whose hook may launch a bucket before the backward ends: those outside the
        last bucket. The last one also holds the count, so it launches from :meth:`finish`
        only; hooking its parameters would cost a Python call each and gain nothing (with one
        bucket, as on a small model, no parameter needs a hook at all)."""
        return frozenset(self.layout.names) - frozenset(self.layout.buckets[-1])

    def grads(self, params: Mapping[str, torch.Tensor]
              ) -> tuple[dict[str, torch.Tensor | None], float]:
        """The mean gradients (each bucket divided in place by the summed count, once per
        bucket rather than once per parameter; count 0: the sums as they are) as views into
        the buckets, shaped like ``params[name]`` (with ``layout.flags``: None for a parameter
        no replica had a gradient for, so it takes no step), and the summed count (closes the
        round; call after every bucket's all-reduce was waited for). Why views: the optimizer
        takes them as they are, which saves the pass over gradient memory :meth:`flat` costs;
        the buckets are refilled completely next round, so writing into them is harmless. The
        division is elementwise, so the values equal dividing each parameter's sum on its
        own."""
        lay = self.layout
        last = self.bufs[-1]
        if lay.flags:  # one device-to-host read for the flags and the count
            *present, count = last[-lay.tail:].tolist()
        else:
            count, present = float(last[-1]), [1.0] * len(lay.names)
        if count > 0 and count != 1:
            for i, b in enumerate(self.bufs):
                (b[:-lay.tail] if i == len(self.bufs) - 1 else b).div_(count)
        out: dict[str, torch.Tensor | None] = {
            n: self._views[n].view(params[n].shape) if f > 0 else None
            for n, f in zip(lay.names, present)}
        self.active = False
        return out, count

    def flat(self) -> torch.Tensor:
        """The summed buckets in :meth:`StageReplica.local_gradient`'s layout (closes the
        round; call after every bucket's all-reduce was waited for)."""
        parts = [self._views[n] for n in self.layout.names]
        self.active = False
        return torch.cat([*parts, self.bufs[-1][-self.layout.tail:].to(_flat_dtype(self.bufs))])


def _flat_dtype(bufs: Sequence[torch.Tensor]) -> torch.dtype:
    out = bufs[0].dtype
    for b in bufs[1:]:
        out = torch.promote_types(out, b.dtype)
    return out


def last_backwards(kinds: Sequence[str]) -> dict[int, int]:
    """For an action list given as its kinds (e.g. ``"FFBUFBU"``): index of the last ``B``
    before each ``U`` -> index of that ``U``. After that backward the round's gradient sums are
    final, so its hooks may launch the buckets (earlier backwards of the round may not: a later
    one still adds to the sums). In a list with ``W`` actions (split backwards) the weight
    gradients come from the W's, so the last ``W`` before each ``U`` counts instead."""
    grads = "W" if "W" in kinds else "B"
    out: dict[int, int] = {}
    last: int | None = None
    for i, k in enumerate(kinds):
        if k == grads:
            last = i
        elif k == "U":
            if last is not None:
                out[last] = i
            last = None
    return out
