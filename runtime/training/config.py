"""A trainer's options in sections: typed, frozen records, one per concern (the schedule, the
data, checkpoints, precision and clipping, metrics, where and how it runs, re-planning), each a
keyword of ``Trainer`` and ``compiled.trainer``. The loop reads them as one flat set of
settings; :func:`flat_options` makes it, and takes the flat keywords of earlier releases too."""
from __future__ import annotations

import difflib
from dataclasses import dataclass, fields
from typing import Any, Callable, Mapping, Sequence

import torch

from fxpipe.tracing.batchdims import BatchDims

from ..errors import RuntimeConfigError
from .auto import AutoOptions
from .checkpoint import KEEP

__all__ = ["CheckpointConfig", "DataConfig", "LrSchedulerConfig", "MetricsConfig",
           "PrecisionConfig", "ReplanConfig", "RunConfig", "ScheduleConfig", "SECTIONS",
           "flat_options"]


@dataclass(frozen=True)
class ScheduleConfig:
    """What runs: ``kind`` (None: the caller's default, ``"auto"`` for ``compiled.trainer``,
    ``"pipedream"`` for a bare ``Trainer``; or ``"1f1b-flush"``, ``"gpipe"``, ``"2bw"``,
    ``"pipedream+predict"``, the placed kinds, see docs/schedules.md); ``microbatches`` per
    update; ``split``: microbatches each loader minibatch is cut into; ``noam``: minibatches
    in flight at the input stage of ``pipedream`` and ``2bw`` (None or "auto": the fewest that
    hide the plan's round trips; "pipedream"; or a number); ``segment``: minibatches per
    stretch of training between the loop's checks; ``vertical_sync``, ``stashing``; ``auto``:
    the pilot's options when ``kind`` is ``"auto"``; ``average_every``: LocalSGD's H (``kind``
    ``"localsgd"``: the replicas average their weights every H local updates)."""

    kind: str | None = None
    microbatches: int | None = None
    split: int | None = None
    noam: int | str | None = None
    segment: int | None = None
    vertical_sync: bool = False
    stashing: bool = True
    auto: AutoOptions | Mapping[str, Any] | None = None
    average_every: int | None = None


@dataclass(frozen=True)
class DataConfig:
    """How the loader's minibatches are read and cut: ``batch_dims=(inputs_dims, target_dims)``
    where the graph cannot say which dimension is the batch; ``prefetch``: minibatches read
    ahead by a thread; ``seed``: dropout and the loop's own randomness."""

    batch_dims: Any = None
    input_batch_dims: BatchDims | None = None
    prefetch: int = 0
    seed: int = 0


@dataclass(frozen=True)
class CheckpointConfig:
    """``dir`` (None: no checkpoints), written ``every`` minibatches (None: at each epoch's
    end), the newest ``keep`` kept (None: all); ``overwrite`` another run's checkpoints in
    ``dir`` instead of refusing; ``on_checkpoint(epoch, minibatch)`` on every rank after one is
    complete. ``fingerprint`` and ``state_keys`` are set by ``compiled.trainer`` (the model a
    checkpoint belongs to, and where each of its state_dict's keys lives)."""

    dir: str | None = None
    every: int | None = None
    keep: int | None = KEEP
    overwrite: bool = False
    on_checkpoint: Callable[[int, int], None] | None = None
    fingerprint: str | None = None
    state_keys: Mapping[str, tuple[int, str] | torch.Tensor] | None = None


@dataclass(frozen=True)
class PrecisionConfig:
    """``mode``: "fp32", "bf16" (autocast) or "fp16" (with dynamic loss scaling, ``loss_scaler``:
    GradScaler's keywords); ``master_weights`` (None: on exactly for low-precision parameters);
    ``clip_grad_norm``; ``recompute``: True, or one bool per stage (None: the plan's)."""

    mode: str = "fp32"
    master_weights: bool | None = None
    loss_scaler: Mapping[str, Any] | None = None
    clip_grad_norm: float | None = None
    recompute: bool | Sequence[bool] | None = None


@dataclass(frozen=True)
class MetricsConfig:
    """``path`` (JSON lines) every ``every`` minibatches, ``tensorboard_dir``; ``progress``: a
    bar on rank 0; ``timeline``: record each rank's forwards, backwards, messages;
    ``measure_memory``: each rank's peak bytes of live tensors; ``on_recipe(text)``: what fit
    trains."""

    path: str | None = None
    every: int = 1
    tensorboard_dir: str | None = None
    progress: bool = True
    timeline: bool = False
    measure_memory: bool = False
    on_recipe: Callable[[str], None] | None = None


@dataclass(frozen=True)
class RunConfig:
    """``executor``: "distributed" (this process is one torchrun rank) or "reference" (every
    rank in this process: the oracle); ``device``: None (``cuda:LOCAL_RANK`` where CUDA is
    available, else the CPU), "cpu", "cuda" or "cuda:N"; ``timeout_s`` bounds every pipeline
    message and collective, ``data_timeout_s`` a rank's wait while another reads its loader;
    ``shard="optimizer"``: each replicated stage's optimizer state split over its replicas
    (ZeRO-1, torch's ``ZeroRedundancyOptimizer``)."""

    executor: str = "distributed"
    device: str | None = None
    timeout_s: float = 60.0
    data_timeout_s: float = 600.0
    shard: str | None = None


@dataclass(frozen=True)
class LrSchedulerConfig:
    """``make(optimizer)`` -> a torch LR scheduler, stepped every update (``interval="step"``)
    or at each epoch's end (``"epoch"``). A bare callable means ``interval="step"``."""

    make: Callable[[torch.optim.Optimizer], Any]
    interval: str = "step"


@dataclass(frozen=True)
class ReplanConfig:
    """Re-plan while training (``compiled.trainer`` only): ``mode`` "auto"; switch when the
    measured stage times predict a plan ``threshold`` faster, after ``after`` segments, at most
    ``max`` times; ``measure(trainer)``: the per-stage times (default: the ranks' timelines)."""

    mode: str = "auto"
    threshold: float = 0.05
    after: int = 1
    max: int = 3
    measure: Callable[[Any], Any] | None = None


# section keyword -> (its type, {field: the flat option it sets})
SECTIONS: dict[str, tuple[type, dict[str, str]]] = {
    "schedule": (ScheduleConfig, {"kind": "schedule", "microbatches": "microbatches",
                                  "split": "split", "noam": "noam", "segment": "segment",
                                  "vertical_sync": "vertical_sync", "stashing": "stashing",
                                  "auto": "auto_options", "average_every": "average_every"}),
    "data": (DataConfig, {"batch_dims": "batch_dims", "input_batch_dims": "input_batch_dims",
                          "prefetch": "prefetch", "seed": "seed"}),
    "checkpoint": (CheckpointConfig, {"dir": "checkpoint_dir", "every": "checkpoint_every",
                                      "keep": "keep_checkpoints",
                                      "overwrite": "overwrite_checkpoints",
                                      "on_checkpoint": "on_checkpoint",
                                      "fingerprint": "fingerprint", "state_keys": "state_keys"}),
    "precision": (PrecisionConfig, {"mode": "precision", "master_weights": "master_weights",
                                    "loss_scaler": "loss_scaler",
                                    "clip_grad_norm": "clip_grad_norm",
                                    "recompute": "recompute"}),
    "metrics": (MetricsConfig, {"path": "metrics_path", "every": "metrics_every",
                                "tensorboard_dir": "tensorboard_dir", "progress": "progress",
                                "timeline": "timeline", "measure_memory": "measure_memory",
                                "on_recipe": "on_recipe"}),
    "run": (RunConfig, {"executor": "executor", "device": "device", "timeout_s": "timeout_s",
                        "data_timeout_s": "data_timeout_s", "shard": "shard"}),
    "lr_scheduler": (LrSchedulerConfig, {"make": "lr_scheduler",
                                         "interval": "lr_scheduler_interval"}),
    "replan": (ReplanConfig, {"mode": "replan", "threshold": "replan_threshold",
                              "after": "replan_after", "max": "replan_max",
                              "measure": "replan_measure"}),
}
# a section given as a plain value: the field it stands for ("1f1b-flush", "bf16", a callable)
_SHORTHAND = {"schedule": "kind", "precision": "mode", "lr_scheduler": "make", "replan": "mode"}
FLAT = {flat: (section, name) for section, (_, m) in SECTIONS.items() for name, flat in m.items()}


def _flatten(section: str, value: Any) -> dict[str, Any]:
    """The flat options a section sets: every field that differs from its default (a default
    is the loop's own, or the caller's where the caller has one)."""
    cls, names = SECTIONS[section]
    if not isinstance(value, cls):
        if section in _SHORTHAND and not isinstance(value, (dict, tuple, list)):
            return {names[_SHORTHAND[section]]: value}
        raise RuntimeConfigError(f"{section}={value!r}",
                                 f"pass an fxpipe {cls.__name__}(...)"
                                 + (f" or the {_SHORTHAND[section]} itself"
                                    if section in _SHORTHAND else ""))
    return {names[f.name]: getattr(value, f.name) for f in fields(cls)
            if getattr(value, f.name) is not f.default}


def flat_options(sections: Mapping[str, Any], aliases: Mapping[str, Any]) -> dict[str, Any]:
    """The flat options (the loop's settings) of ``sections`` (keyword -> a section, a
    shorthand, or None) and of ``aliases``, the flat keywords of earlier releases
    (``checkpoint_dir=``, ``executor=`` ...). Raises :class:`RuntimeConfigError` naming an
    unknown keyword (and the nearest known one), or a setting given both ways."""
    out: dict[str, Any] = {}
    for section, value in sections.items():
        if value is not None:
            out.update(_flatten(section, value))
    for name, value in aliases.items():
        if name not in FLAT:
            near = difflib.get_close_matches(name, [*FLAT, *SECTIONS], n=1)
            raise RuntimeConfigError(
                f"unknown trainer option {name!r}",
                (f"did you mean {near[0]!r}? " if near else "")
                + "options come in sections: " + ", ".join(
                    f"{s}={SECTIONS[s][0].__name__}(...)" for s in SECTIONS))
        section, field_name = FLAT[name]
        if name in out and out[name] is not value:
            raise RuntimeConfigError(
                f"{name}={value!r} and {section}={SECTIONS[section][0].__name__}"
                f"({field_name}=...) both given", "give it once, in the section")
        out[name] = value
    return out
