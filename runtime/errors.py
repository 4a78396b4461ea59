"""The runtime's exceptions, on :mod:`fxpipe.errors`' base, split by how a caller reacts.

:class:`RuntimeConfigError`: the pipeline was assembled wrong (fix the call); :class:`StashError`:
a broken weight-version invariant (a bug); :class:`PeerError`: another rank died or hung.
"""
from __future__ import annotations

from fxpipe.errors import ConfigError, FxpipeError


class RuntimeConfigError(ConfigError):
    """The stages, schedule, replicas or batches given to an executor do not fit together."""


class LossFunctionError(RuntimeConfigError):
    """``loss_fn`` cannot train the model: it is not a loss (a class, not an instance), it fails
    on the model's output and the loader's target, or it returns more than one number."""


class StashError(FxpipeError):
    """A weight version was asked for that the stash no longer (or never) held."""


class PeerError(FxpipeError):
    """A communication with another rank failed or timed out; the message names both ranks."""


class WorkerFailedError(FxpipeError):
    """A distributed run ended with at least one rank exiting non-zero; carries every rank's
    exit code and error message."""

    def __init__(self, message: str, hint: str | None, exitcodes: dict[int, int | None],
                 errors: dict[int, str]) -> None:
        super().__init__(message, hint)
        self.exitcodes = exitcodes
        self.errors = errors
