"""The pilot's minibatches as a stream, re-read from the loader for every candidate.

Read a training segment at a time, so deciding holds no more minibatches than training does.
Each pass is seeded as training seeds its epochs (:class:`~.data.PartStream`), keeps the
loader's RNG apart from the candidates', and must give an earlier pass's fingerprints."""
from __future__ import annotations

from typing import Any, Iterable, Iterator, Sequence

import torch

from ..errors import RuntimeConfigError
from ..execution.contract import Batch
from .data import PartStream, take


def loader_length(loader: Any) -> int | None:
    """``len(loader)``, or None where it has none (a ``DataLoader`` over an iterable dataset
    raises ``TypeError`` from ``__len__``)."""
    try:
        return len(loader)
    except TypeError:
        return None


def reread_error(got: int, before: int, where: str = "") -> RuntimeConfigError:
    """The error for a loader that gave ``got`` minibatches when auto's pilot read it again
    (``where``: from which position), ``before`` on an earlier pass: a stream read once."""
    return RuntimeConfigError(
        f"the loader gave {got} minibatches{where} when auto's pilot read it again, {before} "
        "before", "auto trains every candidate on the same minibatches, reading the loader "
        "once per candidate: give a loader that yields the same minibatches each time it is "
        "iterated (a list, a DataLoader; not a stream that can be read once), or name a "
        "schedule")


class PilotData:
    """The first ``minibatches`` of a loader, or minibatches held in a list (:meth:`held`: the
    callers that already have them), read in chunks of at most ``chunk`` (None: one chunk).
    ``seed``: the trainer's, which seeds each epoch's order (docs/design-notes.md)."""

    def __init__(self, loader: Iterable[Any] | None, minibatches: int, *,
                 chunk: int | None = None, seed: int = 0,
                 held: Sequence[Batch] | None = None, expects: Sequence[str] = ()) -> None:
        if chunk is not None and chunk < 1:
            raise RuntimeConfigError(f"a pilot chunk of {chunk} minibatches",
                                     "use a positive chunk (a training segment)")
        self.loader, self.minibatches, self.chunk, self.seed = loader, minibatches, chunk, seed
        self._held, self.expects = held, tuple(expects)
        self._count: int | None = None if held is None else min(len(held), minibatches)
        # shared with every view of these minibatches (:meth:`limited`): the fingerprints of
        # the longest complete pass so far, and the most minibatches a pass has read
        self._shared: dict[str, Any] = {"marks": None, "read": None}

    @classmethod
    def held(cls, batches: Sequence[Batch], chunk: int | None = None) -> PilotData:
        """Minibatches already in memory (a list): no loader is read."""
        return cls(None, len(batches), chunk=chunk, held=batches)

    def limited(self, n: int) -> PilotData:
        """The first ``n`` of these minibatches (the same loader, chunks and seed)."""
        if n >= self.minibatches:
            return self
        out = PilotData(self.loader, n, chunk=self.chunk, seed=self.seed, held=self._held,
                        expects=self.expects)
        out._shared = self._shared  # every candidate's pass is checked against the others'
        if self._count is not None:
            out._count = min(self._count, n)
        return out

    def count(self) -> int:
        """How many minibatches a pass gives: ``minibatches`` where the loader has a length (it
        is read over as many epochs as it takes), else what one pass, a chunk at a time,
        reads (the loader may end sooner)."""
        if self._count is None:
            n = loader_length(self.loader)
            if n is not None:
                self._count = self.minibatches if n > 0 else 0
            else:
                self._count = sum(len(c) for c in self.read())
        return self._count

    def first(self, n: int) -> list[Batch]:
        """The first ``n`` minibatches (what the probe times), read on their own."""
        if self._held is not None:
            return list(self._held[:min(n, self.minibatches)])
        return next(self.limited(n)._chunks(None, record=False), [])

    def read(self) -> Iterator[list[Batch]]:
        """One pass, in chunks of at most :attr:`chunk` minibatches. The caller drops each
        chunk before asking for the next: nothing here keeps one."""
        if self._held is not None:
            step = self.chunk or max(self.minibatches, 1)
            for i in range(0, self.minibatches, step):
                yield list(self._held[i:min(i + step, self.minibatches)])
            return
        yield from self._chunks(self.chunk, record=True)

    # ------------------------------------------------------------------ a pass over the loader
    def _chunks(self, chunk: int | None, *, record: bool) -> Iterator[list[Batch]]:
        marks: list[str | None] = []
        streams: list[PartStream] = []
        it = self._parts(marks, streams)
        loader_rng: torch.Tensor | None = None  # the loader's RNG state between reads
        got = 0
        while got < self.minibatches:
            mine = torch.get_rng_state()
            if loader_rng is not None:
                torch.set_rng_state(loader_rng)
            try:
                out = take(it, min(chunk or self.minibatches, self.minibatches - got))
                if streams:
                    marks.append(streams[-1].digest())
            finally:
                loader_rng = torch.get_rng_state()
                torch.set_rng_state(mine)
            if record:
                self._check(marks)
            if not out:
                break
            got += len(out)
            yield out
            out = []  # the caller's chunk is dropped before the next read
        if record:
            self._complete(marks, got)

    def _parts(self, marks: list[str | None], streams: list[PartStream]) -> Iterator[Batch]:
        """The pass's minibatches over as many epochs as it takes (docs/design-notes.md); an
        epoch's fingerprint goes to ``marks`` when it ends inside a chunk."""
        n = 0
        for epoch in range(max(self.minibatches, 1)):
            stream = PartStream(self.loader, epoch, self.seed, need_inputs=True,
                                need_targets=True, expects=self.expects)
            streams[:] = [stream]
            start = n
            try:
                for part in stream:
                    n += 1
                    yield part
                    if n == self.minibatches:
                        return
            finally:
                stream.close()
            marks.append(stream.digest())
            if n == start:  # an empty epoch: the loader has nothing more to give
                return

    def _complete(self, marks: list[str | None], got: int) -> None:
        """A pass ended after ``got`` minibatches: fewer than an earlier pass read (up to this
        view's length) means the loader gives less when it is iterated again (a stream read
        once): an error, not a short pilot. The longest pass's fingerprints are kept."""
        shared = self._shared
        before = shared["read"]
        if before is not None and got < min(before, self.minibatches):
            raise reread_error(got, min(before, self.minibatches))
        if shared["marks"] is None or len(marks) > len(shared["marks"]):
            shared["marks"] = marks
        shared["read"] = max(before or 0, got)
        self._count = got if self._count is None else self._count

    def _check(self, marks: Sequence[str | None]) -> None:
        """Compare this pass's fingerprints so far with the longest complete pass's (those of
        chunks of the same length: a shorter pass's last chunk may end early)."""
        kept = self._shared["marks"]
        if kept is None:
            return
        for i, (a, b) in enumerate(zip(marks, kept)):
            if a is not None and b is not None and a.split(":")[0] != b.split(":")[0]:
                continue  # a chunk cut short by this pass's (or that pass's) length
            if a != b:
                raise RuntimeConfigError(
                    f"the loader gave different minibatches when auto's pilot read it again "
                    f"(chunk {i}: fingerprint {a} vs {b})", "auto trains every candidate on the "
                    "same minibatches, read once per candidate: give a loader that yields the "
                    "same minibatches each time it is iterated for an epoch (fxpipe seeds a "
                    "shuffling DataLoader alike every time), or name a schedule")
