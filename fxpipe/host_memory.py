"""Keep freed host memory in the process (glibc), so each step does not page-fault its buffers.

:func:`keep_freed_memory` raises malloc's mmap and trim thresholds so each step's new gradient
buffers come from the heap; :func:`release_freed_memory` (``malloc_trim``) returns the free pages
at every segment end. Every rank and the profiler run so; a no-op where glibc is absent.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import sys

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD_MAX = 32 * 1024 * 1024   # glibc's upper limit on 64-bit
_TRIM_THRESHOLD = 1 << 30


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """The C library, found once per process: ``find_library`` runs ``ldconfig`` in a
    subprocess, which :func:`release_freed_memory` must not pay at every segment end."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def release_freed_memory() -> bool:
    """Return the heap's free pages to the kernel (docs/design-notes.md); returns whether glibc
    did it."""
    libc = _libc()
    trim = getattr(libc, "malloc_trim", None) if libc is not None else None
    if trim is None:  # musl or another libc
        return False
    trim(0)
    return True


def keep_freed_memory() -> bool:
    """Tune glibc's malloc for this process; returns whether it applied."""
    libc = _libc()
    mallopt = getattr(libc, "mallopt", None) if libc is not None else None
    if mallopt is None:  # musl or another libc: nothing to tune
        return False
    ok = bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX)) and bool(
        mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD))
    log.debug("glibc malloc thresholds %s", "raised" if ok else "unchanged")
    return ok
