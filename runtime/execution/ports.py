"""A free TCP port for a rendezvous, without importing torch.

Kept out of ``launch`` (torch): ``fxpipe train``'s launcher, alive all job long, needs only this.
"""
from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free right now on ``host`` (for the rendezvous)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
