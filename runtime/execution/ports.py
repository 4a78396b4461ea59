"""A free TCP port for a rendezvous, without importing torch.

Kept out of :mod:`fxpipe.runtime.execution.launch` (which imports torch and torch.distributed)
because ``fxpipe train``'s launcher needs only this before it starts torchrun, and it stays alive
for the whole job.
"""
from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free right now on ``host`` (for the rendezvous)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
