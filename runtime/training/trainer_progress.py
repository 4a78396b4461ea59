"""A progress display for one epoch: a tqdm bar, else a log line every few seconds.

Only rank 0 shows it: every rank runs the same script, so N bars would interleave on one terminal.
"""
from __future__ import annotations

import logging
import sys
import time
from typing import Any

log = logging.getLogger("fxpipe.runtime.training.trainer")


class Progress:
    """``update(n, loss, samples_per_s)`` after each segment; ``close()`` at the epoch end."""

    def __init__(self, desc: str, total: int | None, done: int = 0, *,
                 enabled: bool = True) -> None:
        self.desc, self.total, self.done, self.enabled = desc, total, done, enabled
        self._bar: Any = None
        self._last_log = 0.0
        if not enabled:
            return
        try:
            from tqdm.auto import tqdm
        except ImportError:
            return
        self._bar = tqdm(total=total, initial=done, desc=desc, unit=" minibatches", file=sys.stderr,
                         dynamic_ncols=True, leave=True)

    def update(self, n: int, loss: float, samples_per_s: float) -> None:
        if not self.enabled:
            return
        self.done += n
        text = f"loss {loss:.4f}, {samples_per_s:.1f} samples/s"
        if self._bar is not None:
            self._bar.set_postfix_str(text, refresh=False)
            self._bar.update(n)
        elif time.monotonic() - self._last_log > 5:
            self._last_log = time.monotonic()
            log.info("%s: %d/%s minibatches, %s", self.desc, self.done, self.total or "?", text)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        self._bar = None
