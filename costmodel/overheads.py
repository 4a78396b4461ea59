"""What the runtime pays per stage that no node's time contains (plain numbers, no torch).

Why: the profile prices a stage as the sum of its nodes' forward, backward and update, each
timed as plain PyTorch runs it. A stage as the runtime runs it also pays

* fixed costs per minibatch: three calls (F, B, U) through the stage replica (weights swapped
  in, stash versions acquired and released, gradient sums kept, the timeline) and the executor
  between them, plus a little per parameter tensor it holds;
* per message: posting each send and taking each received tensor (every value that crosses a
  cut is one message forward and one back: priced as two, although a value that carries no
  gradient sends nothing back), and per set of stages sharing a tied parameter, the all-reduce
  of its gradient at every update. Most of a message's cost is the action's (its sends posted,
  its receives waited for, once per cut and direction): each value more across the same cut
  costs less (``value_s``; on this project's 2-core machine about 0.06 ms against 0.26 ms for
  the first, a probe with 3 small values more across its cut);
* under a schedule that stashes weight versions (``pipedream``, ``2bw``), a copy of the stage's
  weights at every update that finds its old version still in use, and the bookkeeping of it.

On this project's 2-core machine these were about 0.23 ms per stage and minibatch, 3 us per
parameter tensor and 0.24 ms per message (``fxpipe.runtime.execution.overhead_probe``): the zoo's
GPT mini cut in two, whose stages compute 5.2-5.5 ms each, ran at 7.6-7.75 ms per minibatch while
the plan without them said 5.2-5.5 (+42-46%); with them, 6.7-7.4 (+5-15%, BENCHMARKS
``runtime_prediction``).
:class:`Overheads` holds the measured values; the planner adds :meth:`Overheads.stage_s` to every
stage (``fxpipe.passes.overhead_pricing``), and a plan that pays message costs must beat the
one-stage plan that pays none (``fxpipe.passes.partition``).

The values travel in ``Profile.meta["overheads"]`` (so a saved profile keeps them and older
profiles load without them: zero, the cost model before them).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Mapping

from fxpipe.errors import ProfileFormatError

META_KEY = "overheads"


@dataclass(frozen=True)
class Overheads:
    """Seconds the runtime spends beyond the nodes' times (see the module doc).

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
