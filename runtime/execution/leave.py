"""Closes, at interpreter exit, every backend owning a process group that the script left open.

Left to the interpreter's finalisation, gloo's teardown can abort the process; after an uncaught
exception the hook leaves without the closing barrier, since the peers may be gone.
"""
from __future__ import annotations

import atexit
import logging
import sys
import weakref
from types import TracebackType
from typing import Protocol

log = logging.getLogger(__name__)


class Closable(Protocol):
    def close(self, barrier: bool = True) -> None: ...


_OPEN: "weakref.WeakSet[Closable]" = weakref.WeakSet()
_STATE = {"failed": False, "hooked": False}


def close_at_exit(backend: Closable) -> None:
    """Close ``backend`` at interpreter exit unless it was closed before (closing is idempotent)."""
    _OPEN.add(backend)
    if not _STATE["hooked"]:
        _STATE["hooked"] = True
        previous = sys.excepthook

        def note_failure(kind: type[BaseException], err: BaseException,
                         tb: TracebackType | None) -> None:
            _STATE["failed"] = True
            previous(kind, err, tb)

        sys.excepthook = note_failure
        atexit.register(leave_all)


def leave_all() -> None:
    """The ``atexit`` hook: close every open backend (with the barrier after a clean run)."""
    for backend in list(_OPEN):
        try:
            backend.close(barrier=not _STATE["failed"])
        except Exception as err:  # noqa: BLE001 - at exit, report and go on leaving
            log.warning("leaving the job at exit failed: %s", err)
    _OPEN.clear()
