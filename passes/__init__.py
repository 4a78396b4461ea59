"""The passes phase: ``partition`` puts a Profile on a Cluster as a ``plan`` (pure numbers).

The exact ``solver`` checks with ``feasibility``, ``exact_stages`` and ``recompute``; ``cuts``,
``made_here``, ``copies``, ``memory_rule`` and ``overhead_pricing`` price; ``reference_dp`` checks.
"""
from .cuts import all_crossing_values, crossing_values, cut_bytes
from .partition import SYNC_MODELS, coefficients, partition, plan_for
from .plan import PLAN_FORMAT, Plan, StagePlan
from .solver import Solution, evaluate, minimum_memory, solve

__all__ = ["partition", "plan_for", "Plan", "StagePlan", "solve", "Solution", "evaluate", "minimum_memory",
           "cut_bytes", "crossing_values", "all_crossing_values", "coefficients", "SYNC_MODELS",
           "PLAN_FORMAT"]
