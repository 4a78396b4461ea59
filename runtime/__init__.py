"""fxpipe.runtime: schedules as data, weight stashing, the reference and distributed executors.

Exports are lazy (PEP 562) so that importing the pure-Python ``fxpipe.runtime.schedule`` does not
import torch or torch.distributed.
"""
from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Action": "schedule", "Schedule": "schedule", "make_schedule": "schedule",
    "simulate": "simulate", "WeightStash": "stash", "StageReplica": "stage",
    "ReferenceExecutor": "reference", "RunResult": "reference",
    "run_distributed": "launch", "make_wire_plan": "wire",
    "PeerError": "errors", "StashError": "errors", "RuntimeConfigError": "errors",
    "WorkerFailedError": "errors",
    "TiedParameter": "stage", "tied_parameters": "stage",
    "write_chrome_trace": "timeline", "busy_fraction": "timeline", "TimelineEvent": "timeline",
    "Trainer": "trainer", "make_trainer": "trainer", "ShardedDataset": "data",
    "simulate_plan": "plansim", "PlanSimulation": "plansim",
    "choose_by_simulation": "plan_choice", "SimulatedChoice": "plan_choice",
    "weight_decay_groups": "param_names", "StepOptions": "step_options",
    "OptimizerRecipe": "recipes", "WarmupCosine": "recipes", "SchedulerRecipe": "recipes",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
