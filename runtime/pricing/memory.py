"""Memory per stage under the schedule that runs, not PipeDream's rule for every schedule.

State ``P (2 + opt)`` + the kind's stashed versions + activations times the most minibatches its
action list holds; also a kind's rule for the planner and a check against measured peaks.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from fxpipe.errors import ConfigError
from fxpipe.passes.memory_rule import MemoryRule
from fxpipe.passes.plan import Plan, StagePlan

from ..schedules.schedule import SCHEDULE_KINDS

SHAPES = {  # kind -> (stashed versions, activation sets held) in MemoryRule's terms
    "pipedream": ("window", "window"),
    "2bw": ("one", "window"),              # one shadow version; 1F1B's window, no flush
    "1f1b-flush": ("none", "window-batch"),  # a replica gets ceil(m / r) of an update's m
    "zb-h1": ("none", "window-batch"),     # 1F1B's windows until W
    "gpipe": ("none", "batch"),            # every forward of an update before any backward
    "zb-h2": ("none", "batch"),            # at most 2 x the input stage's window - 1 until W,
}                                          # and never more than the replica's share of m


SPLIT_BACKWARD = ("zb-h1", "zb-h2")
"""Kinds whose backward is split (B input gradients, W weight gradients later): a recomputing
stage's B recomputes the forward and W needs that graph, so each minibatch between its B and
its W holds a full set (measured: zb-h2 with recomputation held 5x its one-set prediction on
GPT's last stage, benchmarks/memory-check.md)."""


def memory_rule(kind: str, microbatches: int | None = None, split: int = 1) -> MemoryRule:
    """The planner's memory rule for plans trained with ``kind``: what a replica holds besides
    its state as a function of its window and replicas (tests/runtime/pricing/
    test_runtime_schedule_memory.py holds it against the generated schedules' own action
    lists: exact for every kind but ``zb-h2``, an upper bound there). ``microbatches``: m per update (None: the runtime's
    default, the workers); ``split``: each loader minibatch cut into that many."""
    if kind not in SHAPES:
        raise ConfigError(f"no memory rule for schedule {kind!r}",
                          f"plan for one of {', '.join(SCHEDULE_KINDS)}")
    versions, held = SHAPES[kind]
    return MemoryRule(kind, versions, held, None if kind in ("pipedream", "2bw") else microbatches,
                      split, recomputed="held" if kind in SPLIT_BACKWARD else "one")


def placed_memory_rule(kind: str, processes: int, microbatches: int | None = None,
                       chunks: int = 2) -> MemoryRule:
    """The planner's memory rule for a placed kind (several stages per process) on a straight
    pipeline of its v x ``processes`` stages: no stashed versions (they flush, as 1f1b-flush),
    and each stage's activation sets as many as the kind's own order holds at once
    (``held="listed"``, read off the generated schedule at ``microbatches`` per update of one
    pipeline copy, default 2 x ``processes``; until W where the backward is split). A stage
    that recomputes keeps a full set from each B that recomputes it until its W: as many as its
    order has Bs awaiting their W at once, the running B included (``recomputed="listed"``;
    one where every W follows its B, as without a split)."""
    from ..schedules.placement import make_placed_schedule
    from .sim_measure import peak_in_flight

    m = microbatches if microbatches is not None else 2 * processes
    placed = make_placed_schedule(kind, processes, 2 * m, chunks=chunks, microbatches=m)
    sched = placed.schedule
    listed = tuple(peak_in_flight(sched.actions[(s, 0)]) for s in range(sched.num_stages))
    full = tuple(_full_sets(sched.actions[(s, 0)]) for s in range(sched.num_stages))
    return MemoryRule(kind, "none", "listed", m, recomputed="listed", listed=listed,
                      listed_full=full)


def _full_sets(actions: Sequence[Any]) -> int:
    """Most recomputed sets a stage's list keeps at once: each B makes one, its W (or the B
    itself, without a split) frees it."""
    split = any(a.kind == "W" for a in actions)
    waiting = peak = 0
    for a in actions:
        if a.kind == "B":
            peak = max(peak, waiting + 1)
            waiting += 1 if split else 0
        elif a.kind == "W":
            waiting -= 1
    return peak


def stashed_versions(kind: str, in_flight: int) -> int:
    """Weight versions a replica keeps besides the live one under ``kind`` (none under the
    kinds that have no rule here: the placed ones)."""
    if kind not in SHAPES:
        return 0
    return int(memory_rule(kind).stashed(max(in_flight, 1)))


def held_parameters(sp: StagePlan) -> float:
    """The parameter bytes a replica of ``sp`` keeps: its own and its copies of parameters
    another stage owns (a tied weight's other holder keeps, steps and stashes a copy)."""
    return sp.parameter_bytes + sp.copy_bytes


def state_bytes(sp: StagePlan) -> float:
    """``P (2 + opt)``: recorded by the planner; for plans saved before it was, recovered from
    the plan's own memory figure by its rule (exact where the stage does not recompute; a
    recomputing stage's is taken as SGD with momentum's 3 P)."""
    if sp.state_bytes is not None:
        return sp.state_bytes
    if sp.recompute:
        return 3.0 * sp.parameter_bytes
    v = max(sp.in_flight, 1)
    return sp.memory_bytes - (v - 1) * held_parameters(sp) - v * sp.activation_bytes


def activation_memory(sp: StagePlan, in_flight: int, scale: float = 1.0,
                      kind: str | None = None) -> float:
    """Activations held at the peak with ``in_flight`` minibatches (each ``scale`` of the
    profiled minibatch's activations: a microbatch of a cut minibatch holds its share); a
    recomputing stage under a split-backward ``kind`` holds a full set per minibatch in flight
    (:data:`SPLIT_BACKWARD`), else one."""
    if not sp.recompute:
        return in_flight * sp.activation_bytes * scale
    full = in_flight if kind in SPLIT_BACKWARD else 1
    return (in_flight * kept_inputs(sp) + full * sp.activation_bytes) * scale


def kept_inputs(sp: StagePlan) -> float:
    """What a recomputing stage keeps per minibatch in flight, its inputs (X + H): recorded by
    the planner; for plans saved before it was, recovered from the plan's memory figure by
    PipeDream's rule, ``v (X + H) + A``."""
    if sp.kept_input_bytes is not None:
        return sp.kept_input_bytes
    v = max(sp.in_flight, 1)
    return max((sp.memory_bytes - state_bytes(sp) - (v - 1) * held_parameters(sp)
                - sp.activation_bytes) / v, 0.0)


def schedule_memory(stages: Sequence[StagePlan], kind: str, in_flight: Sequence[int],
                    scale: float = 1.0) -> tuple[float, ...]:
    """Per stage, bytes a replica holds at its peak under ``kind`` with ``in_flight`` (the
    simulated schedule's peak minibatches held per stage)."""
    if len(in_flight) != len(stages):
        raise ValueError(f"{len(in_flight)} in-flight counts for {len(stages)} stages")
    return tuple(state_bytes(sp) + stashed_versions(kind, v) * held_parameters(sp)
                 + activation_memory(sp, v, scale, kind)
                 for sp, v in zip(stages, in_flight))


@dataclass(frozen=True)
class MemoryCheck:
    """One stage's predicted memory per replica (the plan's ``memory_bytes``, split into its
    rule's terms) against the largest peak of live tensor bytes measured among its replicas
    (``Trainer(measure_memory=True)``). ``parts``: the measured peak by what made each
    tensor (held at the start, forwards ``F``, backwards ``B``/``W``, updates ``U``, receives
    and sends ``comm``), where known (the rank that measured it)."""

    stage: int
    state: float
    versions: float
    activations: float
    measured: int
    parts: Mapping[str, int] = field(default_factory=dict)
    # The peak walked through the schedule's action list (:mod:`.memory_walk`: the rule's terms
    # plus the buffers and working sets live during an action) and its parts; None: not walked.
    walked: float | None = None
    walked_parts: Mapping[str, float] = field(default_factory=dict)

    @property
    def predicted(self) -> float:
        return self.state + self.versions + self.activations

    @property
    def ratio(self) -> float:
        """Measured over predicted (1.0: exact; above: the plan under-predicts)."""
        return self.measured / self.predicted if self.predicted > 0 else float("inf")

    @property
    def walked_ratio(self) -> float | None:
        """Measured over the walked peak (None where not walked)."""
        if self.walked is None:
            return None
        return self.measured / self.walked if self.walked > 0 else float("inf")


def check_memory(plan: Plan, measured: Sequence[int],
                 parts: Mapping[int, Mapping[str, int]] | None = None,
                 walked: Sequence[Any] | None = None) -> tuple[MemoryCheck, ...]:
    """The plan's memory per stage, by its rule's terms (state ``P (2 + opt)``, stashed
    versions, activations: the rest of ``memory_bytes``, i.e. the in-flight sets, or a
    recomputing stage's kept inputs and its one recomputed set), next to ``measured`` (bytes per
    stage). ``parts``: per stage, the measured peak's parts (:class:`MemoryCheck`); ``walked``:
    per stage, the :class:`~.memory_walk.StagePeak` of the schedule that ran."""
    if len(measured) != len(plan.stages):
        raise ValueError(f"{len(measured)} measured stages for a plan of {len(plan.stages)}")
    rows = []
    for sp, got in zip(plan.stages, measured):
        state = state_bytes(sp)
        versions = plan.memory_rule.stashed(max(sp.in_flight, 1)) * held_parameters(sp)
        w = walked[sp.index] if walked is not None else None
        rows.append(MemoryCheck(sp.index, state, versions,
                                sp.memory_bytes - state - versions, int(got),
                                dict((parts or {}).get(sp.index, {})),
                                None if w is None else w.peak,
                                {} if w is None else dict(w.parts)))
    return tuple(rows)


def memory_table(rows: Sequence[MemoryCheck]) -> str:
    """A Markdown table of :func:`check_memory`'s rows (MiB, and measured / predicted)."""
    mib = 1 << 20
    walk = any(r.walked is not None for r in rows)
    lines = ["| stage | predicted | state | versions | activations | measured | measured / "
             "predicted |" + (" walked peak | measured / walked |" if walk else ""),
             "|---|---|---|---|---|---|---|" + ("---|---|" if walk else "")]
    for r in rows:
        line = (f"| {r.stage} | {r.predicted / mib:.2f} | {r.state / mib:.2f} | "
                f"{r.versions / mib:.2f} | {r.activations / mib:.2f} | "
                f"{r.measured / mib:.2f} | {r.ratio:.2f} |")
        if walk:
            line += (" - | - |" if r.walked is None else
                     f" {r.walked / mib:.2f} | {r.walked_ratio:.2f} |")
        lines.append(line)
    return "\n".join(lines)
