"""Session-wide test settings.

The runtime's overheads (:mod:`fxpipe.costmodel.overheads`) are measured on the machine the
tests run on, so with them a plan depends on that machine's load: every test compiles with them
off (``FXPIPE_OVERHEADS=off``, the nodes' times alone) unless it asks for them, and nothing
reads or writes the user's cache (``FXPIPE_CACHE_DIR``). The tests of the overheads themselves
(tests/passes/test_overhead_pricing.py,
tests/runtime/execution/test_runtime_overhead_probe.py) set their own values.
"""
from __future__ import annotations

import os
import tempfile

os.environ.setdefault("FXPIPE_OVERHEADS", "off")
os.environ.setdefault("FXPIPE_CACHE_DIR", tempfile.mkdtemp(prefix="fxpipe-test-cache-"))
