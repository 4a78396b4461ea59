"""What every stage replica does beyond plain forward/backward/update, given once to an executor.

Clipping, precision, master weights, fp16 loss scaling and recomputation: both executors take the
same :class:`StepOptions`, so the reference stays the distributed runtime's oracle.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from ..errors import RuntimeConfigError
from ..schedules.spec import AUTO
from .clipping import check_max_norm, clip_scope
from .loss_scale import ScalerConfig, check_kind
from .master import check_master_weights
from .precision import check_precision


SHARD_OPTIONS = (None, "never", "optimizer")
"""``shard``: None or "never" (every replica holds the whole optimizer state; a compiled
model's trainer reads None as the plan's choice) or ``"optimizer"`` (ZeRO-1,
:mod:`fxpipe.runtime.execution.sharding`)."""


def check_shard(shard: str | None) -> str | None:
    """``shard`` as the run keeps it: "optimizer" or None."""
    if shard not in SHARD_OPTIONS:
        raise RuntimeConfigError(f"shard={shard!r}", "use 'optimizer' (a replicated stage's "
                                 "optimizer state split over its replicas) or 'never'")
    return None if shard == "never" else shard


@dataclass(frozen=True)
class StepOptions:
    """``clip_grad_norm``: max gradient norm or None. ``precision``: "fp32", "bf16" or "fp16".
    ``recompute``: the stages that recompute their activations in the backward.
    ``master_weights``: float32 masters for low-precision parameters (None: automatic).
    ``scaler``: the loss scaler's settings (used with ``precision="fp16"``).
    ``shard``: ``"optimizer"``: a replicated stage's optimizer state split over its replicas
    (:mod:`fxpipe.runtime.execution.sharding`; the distributed executor's, the reference holds
    it whole: the same numbers)."""

    clip_grad_norm: float | None = None
    precision: str = "fp32"
    recompute: tuple[int, ...] = ()
    master_weights: bool | None = None
    scaler: ScalerConfig = ScalerConfig()
    shard: str | None = None

    @classmethod
    def make(cls, num_stages: int, *, clip_grad_norm: float | None = None,
             precision: str = "fp32",
             recompute: bool | Sequence[bool] | None = None,
             master_weights: bool | None = None,
             loss_scaler: Mapping[str, Any] | None = None,
             shard: str | None = None) -> StepOptions:
        """Checked options; ``recompute``: True (every stage), False/None, or one bool per
        stage."""
        if recompute is None or recompute is False:
            stages: tuple[int, ...] = ()
        elif recompute is True:
            stages = tuple(range(num_stages))
        else:
            flags = list(recompute)
            if len(flags) != num_stages or not all(isinstance(f, bool) for f in flags):
                raise RuntimeConfigError(f"recompute={recompute!r} for {num_stages} stages",
                                         "pass True, False, or one bool per stage")
            stages = tuple(s for s, f in enumerate(flags) if f)
        return cls(check_max_norm(clip_grad_norm), check_precision(precision), stages,
                   check_master_weights(master_weights), ScalerConfig.make(loss_scaler),
                   check_shard(shard))

    def scope(self, kind: str) -> str | None:
        """None (no clipping), "global" or "stage" for a schedule kind."""
        return None if self.clip_grad_norm is None else clip_scope(kind)

    def global_clip(self, kind: str) -> bool:
        return self.scope(kind) == "global"

    @property
    def scaling(self) -> bool:
        """fp16: dynamic loss scaling (:mod:`fxpipe.runtime.replica.loss_scale`)."""
        return self.precision == "fp16"

    def global_step(self, kind: str) -> bool:
        """Every stage's update needs one number from all ranks (the global norm, or the
        loss scaler's found-inf flag): they all update together. Refuses fp16 with an
        asynchronous ``kind``."""
        check_kind(self.precision, kind)
        return self.global_clip(kind) or self.scaling

    def check_kind(self, kind: str) -> None:
        """Before anything runs: fp16 needs a flushing schedule, named (not ``auto``)."""
        if self.scaling and kind == AUTO:
            raise RuntimeConfigError("precision='fp16' with schedule='auto'",
                                     "name a flushing schedule: schedule='1f1b-flush'")
        check_kind(self.precision, kind)

    @property
    def global_group(self) -> bool:
        """Whether the all-rank process group (clipping.GROUP) is needed."""
        return self.clip_grad_norm is not None or self.scaling

    def sync(self, kind: str, num_stages: int, sync: Sequence[tuple[int, ...]]
             ) -> list[tuple[int, ...]]:
        """The stages whose updates happen together: with the global norm or fp16 loss
        scaling, all of them (one all-reduce at every update), else the tied sets ``sync``."""
        if self.global_step(kind) and num_stages > 1:
            return [tuple(range(num_stages))]
        return list(sync)

    def replica_kwargs(self, stage: int) -> dict[str, object]:
        return {"precision": self.precision, "recompute": stage in self.recompute,
                "master_weights": self.master_weights,
                "scaler": self.scaler if self.scaling else None}


DEFAULT = StepOptions()
