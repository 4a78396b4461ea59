"""The rank processes keep freed host memory (glibc malloc thresholds raised)."""
import platform

import pytest

from fxpipe.host_memory import keep_freed_memory


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="only glibc's malloc is tuned")
def test_glibc_thresholds_are_raised() -> None:
    assert keep_freed_memory() is True
    assert keep_freed_memory() is True  # idempotent


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="only glibc's malloc is tuned")
def test_freed_memory_goes_back_when_asked() -> None:
    """Freed heap blocks kept by the raised thresholds are handed back by release_freed_memory:
    the resident set drops by most of what was freed."""
    import torch

    from fxpipe.host_memory import release_freed_memory

    def rss_kib() -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))

    keep_freed_memory()
    blocks = [torch.ones(2 * 1024 * 1024) for _ in range(16)]  # 16 x 8 MiB, below mmap's
    keep = [b.clone() for b in blocks[1::2]]  # threshold: from the heap, interleaved
    del blocks
    held = rss_kib()
    assert release_freed_memory() is True
    assert held - rss_kib() > 32 * 1024  # at least half of the 64 MiB freed went back
    del keep
