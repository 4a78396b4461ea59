"""Keep freed host memory in the process (glibc), so each step does not page-fault its buffers.

Why: every backward returns fresh gradient tensors (``torch.autograd.grad``) of the stage's
weight sizes, and every update frees them. With glibc's defaults, blocks of a few MB are
``mmap``-ed and returned to the kernel on free, so the next step touches brand-new pages: on a
3.7M-parameter MLP the backward took about 9 ms instead of 4.6 ms, the update 5.7 ms instead of
4.5 ms (measured in one process, one thread). Raising the mmap threshold to its maximum and the
trim threshold high keeps those blocks in the heap for reuse, as a caching allocator would.

Only the runtime's own rank processes call this; it is a no-op where glibc is absent.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD_MAX = 32 * 1024 * 1024   # glibc's upper limit on 64-bit
_TRIM_THRESHOLD = 1 << 30


def keep_freed_memory() -> bool:
    """Tune glibc's malloc for this process; returns whether it applied."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl or another libc: nothing to tune
        return False
    ok = bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX)) and bool(
        mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD))
    log.debug("glibc malloc thresholds %s", "raised" if ok else "unchanged")
    return ok
