"""fxpipe.runtime: the schedule as data, its price, a replica's work, execution and training.

Packages ``schedules``, ``pricing``, ``replica``, ``execution`` and ``training`` import one way,
beside the leaves ``errors`` and ``timeline``; lazy exports keep ``schedules`` free of torch.
"""
from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Action": "schedules.schedule", "Schedule": "schedules.schedule",
    "make_schedule": "schedules.kinds", "simulate": "schedules.simulate",
    "WeightStash": "replica.stash", "StageReplica": "replica.stage",
    "TiedParameter": "replica.stage", "tied_parameters": "replica.stage",
    "StepOptions": "replica.step_options",
    "ReferenceExecutor": "execution.reference", "RunResult": "execution.contract",
    "run_distributed": "execution.launch", "make_wire_plan": "execution.wire",
    "PeerError": "errors", "StashError": "errors", "RuntimeConfigError": "errors",
    "WorkerFailedError": "errors",
    "write_chrome_trace": "timeline", "busy_fraction": "timeline", "TimelineEvent": "timeline",
    "simulate_plan": "pricing.plansim", "PlanSimulation": "pricing.plansim",
    "choose_by_simulation": "pricing.plan_choice", "SimulatedChoice": "pricing.plan_choice",
    "Trainer": "training.trainer", "make_trainer": "training.trainer",
    "ShardedDataset": "training.data", "load_model_state": "training.checkpoint",
    "weight_decay_groups": "training.param_names", "OptimizerRecipe": "training.recipes",
    "muon_groups": "training.param_names", "MuonWithAdamW": "replica.muon",
    "WarmupCosine": "training.recipes", "SchedulerRecipe": "training.recipes",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
