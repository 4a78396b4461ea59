"""fxpipe.runtime: schedules as data, one stage replica's computation, executing and training.

Five packages, each importing only those before it (tests/test_layering.py checks it)::

    schedules  (data, no torch)       what every rank does
    pricing    (imports schedules)     what a plan costs; choosing and re-choosing one
    replica    (imports schedules)     one stage replica's computation (torch, no distributed)
    execution  (replica, schedules)    carrying schedules out; the only user of torch.distributed
    training   (all four)              the training loop a user drives; nothing imports it

plus the shared leaves ``errors`` and ``timeline``. Exports are lazy (PEP 562) so that importing
the pure-Python ``fxpipe.runtime.schedules`` does not import torch or torch.distributed.
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
