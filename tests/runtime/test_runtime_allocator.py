"""The rank processes keep freed host memory (glibc malloc thresholds raised)."""
import platform

import pytest

from fxpipe.runtime.execution.allocator import keep_freed_memory


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="only glibc's malloc is tuned")
def test_glibc_thresholds_are_raised() -> None:
    assert keep_freed_memory() is True
    assert keep_freed_memory() is True  # idempotent
