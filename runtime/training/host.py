"""The trainer as the parts that drive it see it: ``schedule="auto"``'s pilots and the re-planner.

They adopt candidates, train segments, save and load replica states on a running trainer, so
they need one; :class:`TrainingHost` names exactly what they use of it, and
:class:`~.trainer.Trainer` provides it (a test holds that). Parts that only decide take plain
values instead."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Protocol, runtime_checkable

from ..pricing.replan import StageTimes
from ..replica.stage import StageReplica
from ..replica.step_options import StepOptions

Exchange = Callable[[Any, str], list[Any]]  # (this rank's object, what) -> every rank's, in order


@runtime_checkable
class Backend(Protocol):
    """The collectives a trainer's ranks agree through (every rank calls each, in one order)."""

    index: int
    world: int

    def exchange(self, obj: Any, what: str) -> list[Any]: ...

    def broadcast(self, obj: Any, what: str) -> Any: ...

    def all_sum(self, values: list[float], what: str) -> list[float]: ...


@runtime_checkable
class TrainingHost(Protocol):
    """What auto's pilots (:mod:`.auto_resolve`, :mod:`.auto_pipeline`, :mod:`.auto_look`) and
    the re-planner (:mod:`.trainer_switch`) use of a running trainer."""

    # the pipeline and what this rank holds of it
    stages: list[Any]
    replicas: list[int]
    local: dict[tuple[int, int], StageReplica]
    backend: Backend
    index: int
    # the recipe
    optimizer: Any
    loss_fn: Any
    user_loss_fn: Any
    options: StepOptions
    stashing: bool
    schedulers: dict[tuple[int, int], Any]
    lr_interval: str
    _lr_scheduler: Callable[..., Any] | None
    # the schedule and how fit reads the data
    kind: str
    schedule_name: str
    microbatches: int | None
    split: int
    segment: int
    seed: int
    model_args: Any
    need_inputs: bool
    need_targets: bool
    prefetch: int
    cut_spec: Any
    loss_rule: Any
    auto_options: Any
    checkpoint_dir: str | Path | None
    # what fit has measured and summed so far
    metrics: Any
    harm: str | None
    harm_ratio: float | None
    _acc: list[float]

    def measured_stage_times(self, skip: int = 0) -> list[StageTimes]: ...

    def adopt(self, schedule: str, split: int = 1) -> None: ...

    def drain(self, epoch: int) -> tuple[dict[int, float], dict[int, float]]: ...

    def _noam(self, kind: str | None = None) -> int | None: ...

    def _per_update(self) -> int | None: ...

    def _check_first(self, first: Any) -> None: ...

    def _segment_at(self, pos: int) -> int: ...

    def _lead(self, it: Any, n: int, what: str, wire: bool = True, split: bool = True
              ) -> tuple[list[Any], int]: ...

    def _train_segment(self, parts: list[Any], epoch: int, pos: int, n: int, final: bool
                       ) -> tuple[dict[int, float], dict[int, float]]: ...

    def _stage_state(self, rank: tuple[int, int], epoch: int, pos: int) -> dict[str, Any]: ...

    def _load_stage(self, rank: tuple[int, int], w: StageReplica,
                    state: dict[str, Any]) -> None: ...

