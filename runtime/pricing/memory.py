"""Memory per stage for the schedule that runs, not PipeDream's rule for every schedule.

The planner fits plans with PipeDream's rule (``passes/solver.py``): per replica of stage s,
``P (2 + opt) + (v - 1) P + v A``, v weight versions stashed and v minibatches' activations held,
v = the plan's in-flight count. What a replica really holds depends on the schedule:

- weights, gradients and optimizer state, ``P (2 + opt)`` (``StagePlan.state_bytes``), always;
- stashed weight versions besides the live one: ``pipedream`` keeps one per minibatch in flight
  (v' - 1), ``2bw`` one shadow version, the flushing kinds (``1f1b-flush``, ``gpipe``, ``zb-*``)
  and the placed ones none;
- activations: what backward keeps per minibatch (``StagePlan.activation_bytes``) times the most
  minibatches the schedule's own action list holds at once (v' = ``peak_in_flight``, from F
  until B, or until W where the backward is split, so zero-bubble's held inputs count); a
  recomputing stage keeps its inputs per minibatch in flight and one full set while it
  recomputes.

v' comes from the simulated schedule (:class:`~.core.PlanSimulation.in_flight`), so a
``gpipe`` update of 8 microbatches holds 8 sets where ``1f1b-flush`` holds at most S - s.
"""
from __future__ import annotations

from collections.abc import Sequence

from fxpipe.passes.plan import StagePlan

STASHING_KINDS = {"pipedream": None, "2bw": 1}
"""Weight versions kept besides the live one: None = one per minibatch in flight, less one."""


def stashed_versions(kind: str, in_flight: int) -> int:
    """Weight versions a replica keeps besides the live one under ``kind``."""
    if kind not in STASHING_KINDS:
        return 0
    fixed = STASHING_KINDS[kind]
    return max(in_flight - 1, 0) if fixed is None else fixed


def state_bytes(sp: StagePlan) -> float:
    """``P (2 + opt)``: recorded by the planner; for plans saved before it was, recovered from
    the plan's own memory figure by its rule (exact where the stage does not recompute; a
    recomputing stage's is taken as SGD with momentum's 3 P)."""
    if sp.state_bytes is not None:
        return sp.state_bytes
    if sp.recompute:
        return 3.0 * sp.parameter_bytes
    v = max(sp.in_flight, 1)
    return sp.memory_bytes - (v - 1) * sp.parameter_bytes - v * sp.activation_bytes


def activation_memory(sp: StagePlan, in_flight: int, scale: float = 1.0) -> float:
    """Activations held at the peak with ``in_flight`` minibatches (each ``scale`` of the
    profiled minibatch's activations: a microbatch of a cut minibatch holds its share)."""
    if not sp.recompute:
        return in_flight * sp.activation_bytes * scale
    # the planner's rule held v (X + H) + A: per minibatch in flight, its inputs
    v = max(sp.in_flight, 1)
    inputs = (sp.memory_bytes - state_bytes(sp) - (v - 1) * sp.parameter_bytes
              - sp.activation_bytes) / v
    return (in_flight * max(inputs, 0.0) + sp.activation_bytes) * scale


def schedule_memory(stages: Sequence[StagePlan], kind: str, in_flight: Sequence[int],
                    scale: float = 1.0) -> tuple[float, ...]:
    """Per stage, bytes a replica holds at its peak under ``kind`` with ``in_flight`` (the
    simulated schedule's peak minibatches held per stage)."""
    if len(in_flight) != len(stages):
        raise ValueError(f"{len(in_flight)} in-flight counts for {len(stages)} stages")
    return tuple(state_bytes(sp) + stashed_versions(kind, v) * sp.parameter_bytes
                 + activation_memory(sp, v, scale)
                 for sp, v in zip(stages, in_flight))
