"""fxpipe: automatic PipeDream-style pipeline parallelism for unmodified PyTorch models.

A lazy facade (PEP 562; every ``import fxpipe.<phase>`` runs it). ``api`` holds ``compile``
(measuring, then planning with ``runtime.pricing.choose``); ``cli``, ``cli_args``, ``cli_simulate``, ``cli_train`` and
``cli_elastic`` are the command; ``errors``, ``units``, ``jsonio``, ``host_memory`` shared leaves.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from fxpipe.errors import (ConfigError, CostingError, FxpipeError, InfeasiblePlanError,
                           InputMismatchError, PlanFormatError, ProfileFormatError, TracingError)

__version__ = "0.1.0"

_LAZY = {
    "compile": "fxpipe.api", "CompiledModel": "fxpipe.api", "load": "fxpipe.api",
    "choose_plan": "fxpipe.api",
    "Cluster": "fxpipe.costmodel.hardware", "Profile": "fxpipe.costmodel.profile",
    "Overheads": "fxpipe.costmodel.overheads",
    "Plan": "fxpipe.passes.plan", "partition": "fxpipe.passes.partition",
    "trace": "fxpipe.tracing",
    **{name: "fxpipe.runtime.training.config" for name in (
        "CheckpointConfig", "DataConfig", "LrSchedulerConfig", "MetricsConfig", "PrecisionConfig",
        "ReplanConfig", "RunConfig", "ScheduleConfig")},
}

__all__ = sorted([*_LAZY, "ConfigError", "CostingError", "FxpipeError", "InfeasiblePlanError",
                  "InputMismatchError", "PlanFormatError", "ProfileFormatError", "TracingError"])

if TYPE_CHECKING:
    from fxpipe.api import CompiledModel, choose_plan, compile, load
    from fxpipe.costmodel.hardware import Cluster
    from fxpipe.costmodel.overheads import Overheads
    from fxpipe.costmodel.profile import Profile
    from fxpipe.passes.partition import partition
    from fxpipe.passes.plan import Plan
    from fxpipe.runtime.training.config import (CheckpointConfig, DataConfig, LrSchedulerConfig,
                                                MetricsConfig, PrecisionConfig, ReplanConfig,
                                                RunConfig, ScheduleConfig)
    from fxpipe.tracing import trace


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'fxpipe' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
