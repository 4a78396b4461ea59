"""Feeding a pipeline: each rank takes only the part of a minibatch it needs.

Why: in a pipeline only the ranks of stages that read model inputs need the inputs, and only the
output stage needs the targets. Every rank runs the same script, so the simplest contract is that
every rank that needs data iterates the SAME deterministic loader and keeps its part:

* any iterable of ``(inputs, target)`` works (a ``torch.utils.data.DataLoader`` included) as long
  as it yields the same minibatches in the same order on every rank for a given epoch. The
  trainer seeds torch's global RNG with ``(seed, epoch)`` right before ``iter(loader)`` and calls
  ``set_epoch(epoch)`` on the loader or its sampler when they have one, so a ``DataLoader`` with
  ``shuffle=True`` and no private generator is deterministic across ranks and across restarts;
* a loader with an ``iter_parts(epoch, need_inputs, need_targets, start)`` method (such as
  :class:`ShardedDataset`) yields only what a rank asked for, and can skip to a position without
  materialising the skipped minibatches: the output stage then never loads images, the input
  stage never loads labels, and ranks of middle stages read nothing at all.
"""
from __future__ import annotations

import hashlib
import logging
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import torch

from .errors import RuntimeConfigError

log = logging.getLogger(__name__)

Part = tuple[Any, Any]
"""(inputs or None, target or None): what one rank keeps of a minibatch."""


def derive_seed(*parts: int) -> int:
    """A 63-bit seed from integers (seed, epoch, position, rank...): stable across processes and
    Python versions (unlike ``hash``), so every rank and every restart derives the same value."""
    h = hashlib.sha256(",".join(str(int(p)) for p in parts).encode()).digest()
    return int.from_bytes(h[:8], "little") & ((1 << 63) - 1)


def _set_epoch(loader: Any, epoch: int) -> None:
    """Call ``set_epoch`` where a loader (or its sampler) offers it, as DistributedSampler does."""
    for obj in (loader, getattr(loader, "sampler", None), getattr(loader, "batch_sampler", None),
                getattr(getattr(loader, "batch_sampler", None), "sampler", None)):
        fn = getattr(obj, "set_epoch", None)
        if callable(fn):
            fn(epoch)
            return


def iter_parts(loader: Iterable[Any], epoch: int, seed: int, *, need_inputs: bool,
               need_targets: bool, start: int = 0) -> Iterator[Part]:
    """Yield this rank's part of every minibatch of ``epoch`` from minibatch ``start`` on.

    The global RNG is seeded from ``(seed, epoch)`` before the loader is iterated, so a shuffling
    ``DataLoader`` orders the epoch the same way on every rank and after a restart.
    """
    torch.manual_seed(derive_seed(seed, epoch, -1))
    _set_epoch(loader, epoch)
    parts = getattr(loader, "iter_parts", None)
    if callable(parts):
        yield from parts(epoch, need_inputs, need_targets, start)
        return
    for k, item in enumerate(loader):
        if k < start:
            continue
        if isinstance(item, Mapping):  # keyword inputs, labels among them (a HF collator's batch)
            yield (item if need_inputs or need_targets else None, None)
            continue
        if not (isinstance(item, (tuple, list)) and len(item) == 2):
            raise RuntimeConfigError(f"the loader yielded {type(item).__name__} at minibatch {k}",
                                     "a training loader yields (inputs, target) pairs or dicts "
                                     "of keyword inputs")
        yield (item[0] if need_inputs else None, item[1] if need_targets else None)


def batch_size_of(inputs: Any) -> int:
    """Samples in a minibatch: dim 0 of its first tensor input (0 if there is none)."""
    values = (inputs.values() if isinstance(inputs, Mapping)
              else inputs if isinstance(inputs, (tuple, list)) else (inputs,))
    for x in values:
        if isinstance(x, torch.Tensor) and x.dim() > 0:
            return int(x.shape[0])
    return 0


class ShardedDataset:
    """A deterministic minibatch loader over indexable inputs and targets that reads only the
    part a rank needs (see the module doc).

    ``inputs`` / ``targets``: tensors (or tuples of tensors for several model inputs) indexed by
    sample on dim 0, or callables ``f(indices: LongTensor) -> batch`` that load just those
    samples (e.g. from disk). The order of epoch e is a permutation seeded by ``(seed, e)`` when
    ``shuffle`` (identical on every rank and after a restart); ``drop_last`` drops a final partial
    minibatch (keeping every minibatch the same shape avoids a second wire signature).
    """

    def __init__(self, inputs: Any, targets: Any, *, batch_size: int,
                 num_samples: int | None = None,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = False) -> None:
        if batch_size < 1:
            raise RuntimeConfigError(f"batch_size={batch_size}", "use a batch size >= 1")
        n = num_samples if num_samples is not None else self._length(inputs, targets)
        if n is None:
            raise RuntimeConfigError("cannot tell how many samples the dataset has",
                                     "pass num_samples= when inputs and targets are callables")
        self.inputs, self.targets, self.num_samples = inputs, targets, int(n)
        self.batch_size, self.shuffle = batch_size, shuffle
        self.seed, self.drop_last = seed, drop_last

    @staticmethod
    def _length(*sources: Any) -> int | None:
        for src in sources:
            first = src[0] if isinstance(src, (tuple, list)) and src else src
            if isinstance(first, torch.Tensor):
                return int(first.shape[0])
        return None

    def __len__(self) -> int:
        full, rest = divmod(self.num_samples, self.batch_size)
        return full + (1 if rest and not self.drop_last else 0)

    def order(self, epoch: int) -> torch.Tensor:
        """Sample indices of ``epoch`` in the order they are served."""
        if not self.shuffle:
            return torch.arange(self.num_samples)
        g = torch.Generator().manual_seed(derive_seed(self.seed, epoch))
        return torch.randperm(self.num_samples, generator=g)

    @staticmethod
    def _take(src: Any, idx: torch.Tensor) -> Any:
        if callable(src) and not isinstance(src, torch.Tensor):
            return src(idx)
        if isinstance(src, (tuple, list)):
            return tuple(t[idx] for t in src)
        return src[idx]

    def iter_parts(self, epoch: int, need_inputs: bool, need_targets: bool,
                   start: int = 0) -> Iterator[Part]:
        """This rank's part of minibatches ``start..`` of ``epoch``; skipped ones are not read."""
        order = self.order(epoch)
        for k in range(start, len(self)):
            idx = order[k * self.batch_size:(k + 1) * self.batch_size]
            yield (self._take(self.inputs, idx) if need_inputs else None,
                   self._take(self.targets, idx) if need_targets else None)

    def __iter__(self) -> Iterator[Part]:
        """Plain iteration (epoch 0, both parts): usable as an ordinary loader too."""
        return self.iter_parts(0, True, True)


def take(it: Iterator[Part], n: int) -> list[Part]:
    """Up to ``n`` items of ``it`` (fewer at the end of the epoch)."""
    out: list[Part] = []
    for item in it:
        out.append(item)
        if len(out) == n:
            break
    return out


def synthetic_loader(make_batch: Callable[..., Any], batch_size: int, num_batches: int,
                     seed: int = 0) -> Sequence[tuple[Any, Any]]:
    """``num_batches`` minibatches from a zoo ``ModelSpec.make_batch`` (seeded, deterministic)."""
    return [make_batch(batch_size, seed=derive_seed(seed, k) % (2**31)) for k in range(num_batches)]
