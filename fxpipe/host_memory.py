"""Keep freed host memory in the process (glibc), so each step does not page-fault its buffers.

Why: every backward returns fresh gradient tensors (``torch.autograd.grad``) of the stage's
weight sizes, and every update frees them. With glibc's defaults, blocks of a few MB are
``mmap``-ed and returned to the kernel on free, so the next step touches brand-new pages: on a
3.7M-parameter MLP the backward took about 9 ms instead of 4.6 ms, the update 5.7 ms instead of
4.5 ms (measured in one process, one thread). Raising the mmap threshold to its maximum and the
trim threshold high keeps those blocks in the heap for reuse, as a caching allocator would.

The price is memory that is free but not returned: over thousands of steps the heap fragments
(blocks of one step's sizes end up between blocks still in use), and what the process keeps
grows with the run, up to twice what it uses (issue 23's benchmark: a 20,000-minibatch run held
1.8 GB of which 0.7 GB was in use). So :func:`release_freed_memory` hands the free pages back
(glibc's ``malloc_trim``) at every segment end: a few milliseconds per segment, and the next
steps refill from the heap as before.

Every rank keeps freed memory (``run_distributed``'s workers and a torchrun rank's
``Trainer``), so the profiler measures under the same setting
(``fxpipe.costmodel.profiler.profile_graph``): a profile taken with glibc's defaults priced page
faults that no rank pays. On this project's 2-core machine the whole training step of the
cluster benchmark's VGG16 (channels / 4, batch 32, one thread) took 34.9 and 36.2 ms of
backward with the defaults and 28.5 and 28.9 ms with the thresholds raised (two compiles each;
forward, backward and update 61.6 and 56.3 ms against 49.4 and 49.0): its plans priced the
model's compute 14-25% above what a rank pays. A shared leaf (it imports nothing of fxpipe)
because the cost model and the runtime both call it. No-ops where glibc is absent.
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
    """Return the heap's free pages to the kernel (see the module doc); returns whether glibc
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
