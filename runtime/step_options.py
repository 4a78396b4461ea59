"""What every stage replica does beyond plain forward/backward/update, given once to an executor:
gradient clipping (:mod:`fxpipe.runtime.clipping`), precision (:mod:`fxpipe.runtime.precision`)
and activation recomputation per stage (:class:`fxpipe.runtime.stage.StageReplica`).

Both executors take the same :class:`StepOptions`, so the reference stays the oracle of the
distributed runtime with any of them on.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .clipping import check_max_norm, clip_scope
from .errors import RuntimeConfigError
from .precision import check_precision


@dataclass(frozen=True)
class StepOptions:
    """``clip_grad_norm``: max gradient norm or None. ``precision``: "fp32" or "bf16".
    ``recompute``: the stages that recompute their activations in the backward."""

    clip_grad_norm: float | None = None
    precision: str = "fp32"
    recompute: tuple[int, ...] = ()

    @classmethod
    def make(cls, num_stages: int, *, clip_grad_norm: float | None = None,
             precision: str = "fp32",
             recompute: bool | Sequence[bool] | None = None) -> StepOptions:
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
        return cls(check_max_norm(clip_grad_norm), check_precision(precision), stages)

    def scope(self, kind: str) -> str | None:
        """None (no clipping), "global" or "stage" for a schedule kind."""
        return None if self.clip_grad_norm is None else clip_scope(kind)

    def global_clip(self, kind: str) -> bool:
        return self.scope(kind) == "global"

    def sync(self, kind: str, num_stages: int, sync: Sequence[tuple[int, ...]]
             ) -> list[tuple[int, ...]]:
        """The stages whose updates happen together: with the global norm, all of them (one
        all-reduce of the squared norms at every update), else the tied sets ``sync``."""
        if self.global_clip(kind) and num_stages > 1:
            return [tuple(range(num_stages))]
        return list(sync)

    def replica_kwargs(self, stage: int) -> dict[str, object]:
        return {"precision": self.precision, "recompute": stage in self.recompute}


DEFAULT = StepOptions()
