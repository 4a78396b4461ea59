"""The passes phase: partition a Profile onto a Cluster (pure numbers; no torch here).

``partition`` is the entry point; ``solve`` is the exact array-level core; ``cut_bytes`` prices
every cut of a profile's order.
"""
from .cuts import all_crossing_values, crossing_values, cut_bytes
from .partition import SYNC_MODELS, coefficients, partition, plan_for
from .plan import PLAN_FORMAT, Plan, StagePlan
from .solver import Solution, evaluate, minimum_memory, solve

__all__ = ["partition", "plan_for", "Plan", "StagePlan", "solve", "Solution", "evaluate", "minimum_memory",
           "cut_bytes", "crossing_values", "all_crossing_values", "coefficients", "SYNC_MODELS",
           "PLAN_FORMAT"]
