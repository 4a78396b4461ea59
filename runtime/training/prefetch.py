"""Reading the loader ahead in a background thread with a bounded queue (``prefetch=N``).

While a segment trains, up to N minibatches of the next are fetched, so the loader's work overlaps
compute. The first item is fetched in the caller's thread; later ones must not draw from torch's
global RNG, which training uses too (give random transforms their own ``torch.Generator``)."""
from __future__ import annotations

import queue
import threading
from typing import Any, Iterator

from ..errors import RuntimeConfigError

_END = object()


class Prefetcher:
    """An iterator over ``inner`` that keeps up to ``depth`` items ready (docs/design-notes.md)."""

    def __init__(self, inner: Iterator[Any], depth: int) -> None:
        if not isinstance(depth, int) or isinstance(depth, bool) or depth < 1:
            raise RuntimeConfigError(f"prefetch={depth!r}", "use a positive number of "
                                     "minibatches, or 0 for no prefetching")
        self._q: queue.Queue[Any] = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._first: list[Any] = []
        try:
            self._first.append(next(inner))  # in the caller's thread: see docs/design-notes.md
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
