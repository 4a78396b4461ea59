"""What ``Trainer(schedule=...)`` accepts: a kind, optionally with staleness mitigations, or auto.

A kind (:mod:`.schedule`, :mod:`.placement`), ``"pipedream+predict+lr_scale"`` (mitigations:
:mod:`fxpipe.runtime.replica.mitigation`) or ``"auto"``: parsed, validated and printed in one place.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from ..errors import RuntimeConfigError
from .localsgd import LOCALSGD
from .placement import PLACED_KINDS
from .schedule import SCHEDULE_KINDS

AUTO = "auto"
AUTO_PRICED = "1f1b-flush"
"""What the default trainer (``schedule="auto"``) trains unless a pilot shows that an
asynchronous schedule reaches the loss sooner: 1F1B with a flush, each loader minibatch cut into
one microbatch per worker, one update per minibatch (the user's recipe). A plan made for "auto"
is priced for it, time and memory, so what the plan predicts is what the default runs."""
MITIGATIONS = ("lr_scale", "predict", "dc", "momentum", "nesterov")


@dataclass(frozen=True)
class Mitigation:
    """Which mitigations are on and DC-ASGD-a's constants (what each does:
    :mod:`fxpipe.runtime.replica.mitigation`, which applies them)."""

    lr_scale: bool = False
    predict: bool = False
    dc: bool = False
    momentum: bool = False
    nesterov: bool = False
    dc_lambda: float = 2.0
    dc_decay: float = 0.95
    dc_eps: float = 1e-7

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(n for n in MITIGATIONS if getattr(self, n))

    @property
    def name(self) -> str:
        return "+".join(self.names)

    @classmethod
    def parse(cls, spec: str | Iterable[str] | Mitigation | None) -> Mitigation | None:
        """``"predict+lr_scale"``, ``["dc"]``, a Mitigation or None (-> None when empty)."""
        if spec is None or isinstance(spec, Mitigation):
            return spec if spec is None or spec.names else None
        parts = [p for p in (spec.split("+") if isinstance(spec, str) else spec) if p]
        bad = [p for p in parts if p not in MITIGATIONS]
        if bad:
            raise RuntimeConfigError(f"unknown mitigation {bad[0]!r}",
                                     f"use any of {', '.join(MITIGATIONS)}, joined with '+'")
        return cls(**{p: True for p in parts}) if parts else None


@dataclass(frozen=True)
class ScheduleSpec:
    """A parsed schedule: ``kind`` (one of SCHEDULE_KINDS, or "auto") and its mitigation."""

    kind: str
    mitigation: Mitigation | None = None

    @property
    def name(self) -> str:
        return self.kind + (f"+{self.mitigation.name}" if self.mitigation else "")


def priced_kind(schedule: str) -> str:
    """The kind a plan made for ``schedule`` is priced for: :data:`AUTO_PRICED` for ``"auto"``,
    else the schedule's own kind (mitigations cost what their kind costs)."""
    kind = parse_schedule(schedule).kind
    return AUTO_PRICED if kind == AUTO else kind


def parse_schedule(spec: str) -> ScheduleSpec:
    """``"pipedream+predict"`` -> ScheduleSpec("pipedream", Mitigation(predict=True))."""
    if not isinstance(spec, str):
        raise RuntimeConfigError(f"schedule={spec!r} is not a string",
                                 f"use 'auto' or one of {SCHEDULE_KINDS}")
    kind, _, rest = spec.partition("+")
    if kind not in SCHEDULE_KINDS + PLACED_KINDS + (AUTO, LOCALSGD):
        raise RuntimeConfigError(f"unknown schedule {spec!r}",
                                 f"use 'auto', one of "
                                 f"{SCHEDULE_KINDS + PLACED_KINDS + (LOCALSGD,)}, or "
                                 "'pipedream+<mitigation>'"
                                 f" with mitigations {', '.join(MITIGATIONS)}")
    mitigation = Mitigation.parse(rest) if rest else None
    if mitigation is not None and kind != "pipedream":
        raise RuntimeConfigError(f"schedule {spec!r}: mitigations are options of the asynchronous "
                                 "schedule", f"use 'pipedream+{mitigation.name}'")
    return ScheduleSpec(kind, mitigation)
