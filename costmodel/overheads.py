"""What the runtime pays per stage that no node's time contains (plain numbers, no torch).

A stage replica pays per minibatch for its F, B and U calls, its parameter tensors, its messages,
its tied all-reduces and, under a stashing schedule, a copy of its weights. :class:`Overheads`
keeps them in ``Profile.meta["overheads"]`` (absent: zero) for ``passes/overhead_pricing.py``.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Mapping

from fxpipe.errors import ProfileFormatError

META_KEY = "overheads"


@dataclass(frozen=True)
class Overheads:
    """Seconds the runtime spends beyond the nodes' times (docs/design-notes.md).

    Per minibatch and stage replica: ``action_s``, its F, B and U calls and the executor between
    them; ``tensor_s`` per parameter tensor it holds (swapped into the stage's module for every
    call, its gradient summed); ``message_s`` per point-to-point message it posts or takes;
    ``tie_s`` per set of stages it shares a parameter with (their gradient all-reduce, posted and
    waited for); where its schedule stashes versions, ``stash_copy_s`` (one copy of ALL the
    model's trainable weights) times its share of the parameter bytes, plus ``stash_tensor_s``
    per parameter tensor (the new version's bookkeeping: spares, the optimizer's tensors and
    state handed over). ``value_s``: per message of each value beyond the first across the same
    cut (None: priced as ``message_s``, the model before it; older caches and profiles).
    ``source``: where the numbers come from (shown in plan summaries)."""

    action_s: float = 0.0
    tensor_s: float = 0.0
    message_s: float = 0.0
    tie_s: float = 0.0
    stash_copy_s: float = 0.0
    stash_tensor_s: float = 0.0
    source: str = "none"
    value_s: float | None = None

    def __post_init__(self) -> None:
        for name in ("action_s", "message_s", "stash_copy_s", "tensor_s", "stash_tensor_s",
                     "tie_s", "value_s"):
            v = getattr(self, name)
            if name == "value_s" and v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
                    or v < 0:
                raise ProfileFormatError(f"overheads: {name}={v!r}",
                                         "seconds must be finite and non-negative")

    @property
    def zero(self) -> bool:
        return not (self.action_s or self.message_s or self.stash_copy_s or self.tensor_s
                    or self.stash_tensor_s or self.tie_s or self.value_s)

    @property
    def further_s(self) -> float:
        """Seconds per message of a value beyond the first across a cut (``value_s``, else
        ``message_s``)."""
        return self.message_s if self.value_s is None else self.value_s

    def stage_s(self, messages: int, tensors: int, parameter_share: float,
                stashes: bool, ties: int = 0, further: int = 0) -> float:
        """Seconds per minibatch a stage replica pays beyond its nodes: the fixed action cost,
        ``tensors`` parameter tensors, ``messages`` messages of the first value across each of
        its cuts and ``further`` of the others (posted and taken, per minibatch), ``ties`` tied
        all-reduces, and where ``stashes``, a copy of ``parameter_share`` (its fraction of the
        model's parameter bytes) of the weights."""
        stash = self.stash_copy_s * parameter_share + self.stash_tensor_s * tensors
        return (self.action_s + self.tensor_s * tensors + self.message_s * messages
                + self.further_s * further + self.tie_s * ties + (stash if stashes else 0.0))

    def in_measured_stages(self, ties: bool = False) -> Overheads:
        """What is still missing from stage times MEASURED by the runtime (a re-plan's or a stage
        calibration's forward, backward and update: those already contain the calls and the
        stash's copy): the messages, and the tied all-reduces unless ``ties`` (the single-process
        reference executor sums tied gradients inside its update; the distributed one records
        them apart, as ``allreduce``)."""
        return Overheads(message_s=self.message_s, tie_s=0.0 if ties else self.tie_s,
                         value_s=self.value_s, source=f"{self.source}; messages only")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> Overheads:
        if not d:
            return cls()
        try:
            return cls(**dict(d))
        except TypeError as e:
            raise ProfileFormatError(f"malformed overheads {dict(d)!r}: {e}",
                                     "regenerate the profile with fxpipe") from None


def overheads_of(meta: Mapping[str, Any]) -> Overheads:
    """The overheads a profile's ``meta`` records (zero when it records none)."""
    return Overheads.from_dict(meta.get(META_KEY))


def with_overheads(meta: Mapping[str, Any], overheads: Overheads) -> dict[str, Any]:
    """A copy of ``meta`` recording ``overheads``."""
    return {**meta, META_KEY: overheads.to_dict()}
