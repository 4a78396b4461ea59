"""fxpipe's exception hierarchy (a shared leaf: imports nothing of the phases).

Every error a user can cause derives from :class:`FxpipeError`, carries the offending value in its
message and ends with a hint saying what to do. The CLI catches ``FxpipeError`` and prints the
message alone, without a traceback.
"""
from __future__ import annotations


class FxpipeError(Exception):
    """Base class of every error fxpipe raises on purpose."""

    def __init__(self, message: str, hint: str | None = None) -> None:
        self.message = message
        self.hint = hint
        super().__init__(message if hint is None else f"{message}\n  hint: {hint}")


class ConfigError(FxpipeError, ValueError):
    """A bad argument: zero workers, a negative bandwidth, an unknown device name, ..."""


class TracingError(FxpipeError):
    """Neither torch.fx.symbolic_trace nor torch.export could capture the model."""


class InputMismatchError(FxpipeError, ValueError):
    """The example inputs do not fit the model (wrong arity, shape or dtype)."""


class CostingError(FxpipeError):
    """A graph node ran on the example inputs but could not be timed or estimated in isolation
    (its forward with gradients on, as training runs it)."""


class ProfileFormatError(FxpipeError, ValueError):
    """A profile file (fxpipe JSON or PipeDream graph.txt) is malformed."""


class PlanFormatError(FxpipeError, ValueError):
    """A plan.json is malformed, or was made for a different model."""


class InfeasiblePlanError(FxpipeError):
    """No partition satisfies the constraints (memory, number of stages, cuttable points)."""
