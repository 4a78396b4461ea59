"""Reading the loader ahead of the training, in a background thread with a bounded queue
(``Trainer(prefetch=N)``): while a segment trains, up to N minibatches of the next are fetched
and collated, so a loader doing real work (tokenising, decoding, collating in the main process)
overlaps the compute instead of stalling the pipeline between segments.

Determinism: the first item is fetched in the caller's thread (a shuffling DataLoader draws its
epoch order from torch's global RNG on its first item, right after the trainer seeded it, on
every rank alike). Later items must not draw from torch's GLOBAL generator (the training thread
uses it too, e.g. for dropout, so the interleaving would differ between runs): give random
transforms their own ``torch.Generator``, or keep ``prefetch=0`` (the default). Memory stays
bounded: at most N items wait in the queue (plus one being made).
"""
from __future__ import annotations

import queue
import threading
from typing import Any, Iterator

from ..errors import RuntimeConfigError

_END = object()


class Prefetcher:
    """An iterator over ``inner`` that keeps up to ``depth`` items ready (see the module doc)."""

    def __init__(self, inner: Iterator[Any], depth: int) -> None:
        if not isinstance(depth, int) or isinstance(depth, bool) or depth < 1:
            raise RuntimeConfigError(f"prefetch={depth!r}", "use a positive number of "
                                     "minibatches, or 0 for no prefetching")
        self._q: queue.Queue[Any] = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._first: list[Any] = []
        try:
            self._first.append(next(inner))  # in the caller's thread: see the module doc
        except StopIteration:
            self._q.put(_END)
            self._thread: threading.Thread | None = None
            return
        self._thread = threading.Thread(target=self._run, args=(inner,), daemon=True,
                                        name="fxpipe-prefetch")
        self._thread.start()

    def _put(self, item: Any) -> bool:
        while not self._stop.is_set():
            try:
                self._q.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _run(self, inner: Iterator[Any]) -> None:
        try:
            for item in inner:
                if not self._put(item):
                    return
            self._put(_END)
        except BaseException as err:  # noqa: BLE001 - raised in the consumer's thread
            self._put(err)

    def __iter__(self) -> Prefetcher:
        return self

    def __next__(self) -> Any:
        if self._first:
            return self._first.pop()
        item = self._q.get()
        if item is _END:
            self._q.put(_END)  # stays exhausted
            raise StopIteration
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self) -> None:
        """Stop the thread (an epoch left early); idempotent."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
