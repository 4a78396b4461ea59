"""Faults for the distributed tests, injected through a run's ``hooks`` (rank index -> a
callable run before each of its actions): a rank that dies hard, as a crash does (no cleanup,
no message to its peers), or hangs, at one action. Picklable, so spawned ranks receive them."""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Die:
    """Exit at once (code 17) before action ``at``."""

    at: int

    def __call__(self, index: int, action: Any) -> None:
        if index == self.at:
            log.warning("injected fault: dying before %s", action)
            os._exit(17)


@dataclass(frozen=True)
class Hang:
    """Sleep for an hour before action ``at`` (the peers' timeouts must end the run)."""

    at: int

    def __call__(self, index: int, action: Any) -> None:
        if index == self.at:
            log.warning("injected fault: hanging before %s", action)
            time.sleep(3600)
