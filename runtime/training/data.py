"""Feeding a pipeline: every rank iterates the SAME loader and keeps only the part it needs.

Minibatch k's inputs and targets meet only if all ranks read the same minibatch k, so a loader
that shards by rank (``DistributedSampler``) is refused and plain loaders are fingerprinted
(:class:`PartStream`); ``iter_parts`` loaders (:class:`ShardedDataset`) read only a rank's part."""
from __future__ import annotations

import hashlib
import logging
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import torch

from ..errors import RuntimeConfigError
from ..execution.contract import Batch

log = logging.getLogger(__name__)


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


_SHARDING_HINT = ("fxpipe pairs minibatch k's inputs and targets across stages itself (it goes to "
                  "replica k % r of each stage): give every rank the SAME loader over the whole "
                  "dataset, e.g. DataLoader(dataset, batch_size=..., shuffle=True) (fxpipe seeds "
                  "the shuffle identically on every rank), or fxpipe.runtime.ShardedDataset")


def check_loader(loader: Any) -> None:
    """Refuse a loader that gives each rank a different share of the data (docs/design-notes.md):
    a ``DistributedSampler``, or any sampler with ``num_replicas > 1``, on the loader or its
    batch sampler (one replica is a plain sampler: allowed)."""
    batch_sampler = getattr(loader, "batch_sampler", None)
    for obj in (getattr(loader, "sampler", None), batch_sampler,
                getattr(batch_sampler, "sampler", None)):
        replicas = getattr(obj, "num_replicas", None)
        if isinstance(replicas, int) and not isinstance(replicas, bool) and replicas > 1:
            raise RuntimeConfigError(
                f"the loader's {type(obj).__name__} shards the data by rank (num_replicas="
                f"{replicas}, rank={getattr(obj, 'rank', '?')}): the input stage would train "
                "on one shard's inputs with another shard's targets", _SHARDING_HINT)


class PartStream:
    """This rank's parts of an epoch's minibatches (an iterator), plus, for a plain loader, a
    fingerprint of every minibatch it read (inputs AND targets, before keeping its part):
    :meth:`digest` returns the fingerprint of the minibatches read since the last call, which
    every rank reading the loader computes alike if, and only if, they read the same data.
    None for a loader with ``iter_parts`` (it serves parts, not whole minibatches; its pairing
    is by construction: one seeded order for all ranks)."""

    def __init__(self, loader: Iterable[Any], epoch: int, seed: int, *, need_inputs: bool,
                 need_targets: bool, start: int = 0, prefetch: int = 0,
                 expects: Sequence[str] = ()) -> None:
        check_loader(loader)
        torch.manual_seed(derive_seed(seed, epoch, -1))
        _set_epoch(loader, epoch)
        parts = getattr(loader, "iter_parts", None)
        self.checked = not callable(parts)
        self._hash = hashlib.blake2b(digest_size=16) if self.checked else None
        self._count = 0
        self._first: Batch | None = None  # the first whole minibatch read (plain loaders)
        self._source = (loader, epoch, start)
        self._expects = tuple(expects)  # the model's argument names, for a clear error
        self._it: Iterator[tuple[Batch, Any]] = (
            ((p, None) for p in parts(epoch, need_inputs, need_targets, start)) if callable(parts)
            else self._plain(loader, need_inputs, need_targets, start))
        self._prefetcher: Any = None
        if prefetch:  # a thread reads ahead (fxpipe.runtime.training.prefetch); hashing stays here
            from .prefetch import Prefetcher

            self._it = self._prefetcher = Prefetcher(self._it, prefetch)

    def _plain(self, loader: Iterable[Any], need_inputs: bool, need_targets: bool,
               start: int) -> Iterator[tuple[Batch, Any]]:
        """(this rank's part, what to fingerprint: hashed when CONSUMED, in :meth:`__next__`,
        so that reading ahead does not change a segment's digest)."""
        for k, item in enumerate(loader):
            if k < start:
                continue
            if isinstance(item, Mapping):  # keyword inputs, labels among them (a HF batch)
                yield (item if need_inputs or need_targets else None, None), dict(item)
                continue
            if not (isinstance(item, (tuple, list)) and len(item) == 2):
                raise not_a_pair(item, k, self._expects)
            yield (item[0] if need_inputs else None, item[1] if need_targets else None), item

    def __iter__(self) -> PartStream:
        return self

    def __next__(self) -> Batch:
        part, raw = next(self._it)
        if self._hash is not None:
            _feed(self._hash, raw)
            if self._first is None:
                self._first = (raw, None) if isinstance(raw, Mapping) else (raw[0], raw[1])
        self._count += 1
        return part

    def first_whole(self) -> Batch | None:
        """The first minibatch this stream read, whole (inputs AND target, whatever this rank
        keeps): what the trainer tests its cut on (:mod:`.trainer_cut`). A loader with
        ``iter_parts`` serves parts: its first minibatch is read again, whole."""
        if self._first is None and not self.checked:
            loader, epoch, start = self._source
            self._first = next(iter(loader.iter_parts(epoch, True, True, start)), None)
        return self._first

    def close(self) -> None:
        """Stop reading ahead (the epoch ends or is left early)."""
        if self._prefetcher is not None:
            self._prefetcher.close()

    def digest(self) -> str | None:
        """Fingerprint of the minibatches read since the previous call (None: not checked)."""
        if self._hash is None:
            return None
        out = f"{self._count}:{self._hash.hexdigest()}"
        self._hash, self._count = hashlib.blake2b(digest_size=16), 0
        return out


def not_a_pair(item: Any, k: int, expects: Sequence[str]) -> RuntimeConfigError:
    """The error for a loader item that is not ``(inputs, target)``: what it is, and how the
    model's inputs (``expects``, its argument names) are passed."""
    from .first_check import describe

    many = isinstance(item, (tuple, list))
    what = (f"{len(item)} items per minibatch ({describe(item)})" if many
            else describe(item))
    if len(expects) > 1:
        how = (f"the model takes {len(expects)} inputs ({', '.join(expects)}): yield them as "
               f"one tuple, then the target: (({', '.join(expects)}), target); or a dict of "
               "keyword inputs with the labels among them")
    else:
        how = ("yield (inputs, target): the model's input, then what the loss compares its "
               "output with; or a dict of keyword inputs with the labels among them")
    return RuntimeConfigError(f"the loader yielded {what} at minibatch {k}: fxpipe takes each "
                              "minibatch as a pair (inputs, target)", how)


_SAMPLE = 4096  # elements of a tensor that go into its fingerprint (evenly strided)


def _feed(h: Any, value: Any) -> None:
    """Add ``value`` (tensors, nested tuples/lists/dicts, scalars) to the hash ``h``: type,
    shape, dtype and up to _SAMPLE evenly spaced elements of each host tensor (so the cost does
    not grow with the batch; device tensors add shape and dtype only, reading them would
    synchronise the device)."""
    if isinstance(value, torch.Tensor):
        h.update(repr((tuple(value.shape), str(value.dtype))).encode())
        if value.device.type == "cpu" and value.numel() > 0:
            flat = value.detach().reshape(-1)
            step = max(1, flat.numel() // _SAMPLE)
            sample = flat[::step][:_SAMPLE].contiguous()
            if sample.dtype == torch.bfloat16:
                sample = sample.view(torch.int16)
            h.update(sample.numpy().tobytes())
    elif isinstance(value, (tuple, list)):
        h.update(f"{type(value).__name__}{len(value)}".encode())
        for v in value:
            _feed(h, v)
    elif isinstance(value, dict):
        h.update(f"dict{len(value)}".encode())
        for k in sorted(value, key=repr):
            h.update(repr(k).encode())
            _feed(h, value[k])
    else:
        h.update(repr(value).encode())


def iter_parts(loader: Iterable[Any], epoch: int, seed: int, *, need_inputs: bool,
               need_targets: bool, start: int = 0) -> Iterator[Batch]:
    """Yield this rank's part of every minibatch of ``epoch`` from minibatch ``start`` on.

    The global RNG is seeded from ``(seed, epoch)`` before the loader is iterated, so a shuffling
    ``DataLoader`` orders the epoch the same way on every rank and after a restart.
    """
    return PartStream(loader, epoch, seed, need_inputs=need_inputs, need_targets=need_targets,
                      start=start)


def batch_size_of(inputs: Any) -> int:
    """Samples in a minibatch for throughput figures: dim 0 of its first tensor input (0 if
    there is none). Cutting minibatches never guesses so: :mod:`.minibatch` cuts along the
    batch dimensions the graph and the loss were tested for."""
    values = (inputs.values() if isinstance(inputs, Mapping)
              else inputs if isinstance(inputs, (tuple, list)) else (inputs,))
    for x in values:
        if isinstance(x, torch.Tensor) and x.dim() > 0:
            return int(x.shape[0])
    return 0


class ShardedDataset:
    """A deterministic minibatch loader over indexable inputs and targets that reads only the
    part a rank needs (docs/design-notes.md).

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
                   start: int = 0) -> Iterator[Batch]:
        """This rank's part of minibatches ``start..`` of ``epoch``; skipped ones are not read."""
        order = self.order(epoch)
        for k in range(start, len(self)):
            idx = order[k * self.batch_size:(k + 1) * self.batch_size]
            yield (self._take(self.inputs, idx) if need_inputs else None,
                   self._take(self.targets, idx) if need_targets else None)

    def __iter__(self) -> Iterator[Batch]:
        """Plain iteration (epoch 0, both parts): usable as an ordinary loader too."""
        return self.iter_parts(0, True, True)


def take(it: Iterator[Batch], n: int) -> list[Batch]:
    """Up to ``n`` items of ``it`` (fewer at the end of the epoch)."""
    out: list[Batch] = []
    for item in it:
        out.append(item)
        if len(out) == n:
            break
    return out


def synthetic_loader(make_batch: Callable[..., Any], batch_size: int, num_batches: int,
                     seed: int = 0) -> Sequence[tuple[Any, Any]]:
    """``num_batches`` minibatches from a zoo ``ModelSpec.make_batch`` (seeded, deterministic)."""
    return [make_batch(batch_size, seed=derive_seed(seed, k) % (2**31)) for k in range(num_batches)]
