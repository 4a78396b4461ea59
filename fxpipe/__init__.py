"""fxpipe: automatic PipeDream-style pipeline parallelism for unmodified PyTorch models.

A thin facade of re-exports; the work happens in the phases ``fxpipe.tracing``,
``fxpipe.costmodel``, ``fxpipe.passes``, ``fxpipe.codegen`` and ``fxpipe.runtime``.
"""
from fxpipe.errors import (ConfigError, FxpipeError, InfeasiblePlanError, InputMismatchError,
                           PlanFormatError, ProfileFormatError, TracingError)

__version__ = "0.1.0"
