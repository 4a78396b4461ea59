"""What ``Trainer(schedule=...)`` accepts: a kind, optionally with staleness mitigations, or auto.

    "pipedream"                     PipeDream's asynchronous 1F1B with weight stashing
    "pipedream+predict+lr_scale"    the same with mitigations (fxpipe.runtime.mitigation)
    "1f1b-flush", "gpipe", "2bw"    the other kinds (fxpipe.runtime.schedule)
    "interleaved-1f1b", "zb-v"      several stages per process (fxpipe.runtime.placement;
                                    the Trainer runs them with executor="reference")
    "auto"                          chosen per run (fxpipe.runtime.auto)

Kept apart from the trainer so the spelling is parsed, validated and printed in one place.
"""
from __future__ import annotations

from dataclasses import dataclass

from .errors import RuntimeConfigError
from .mitigation import MITIGATIONS, Mitigation
from .placement import PLACED_KINDS
from .schedule import SCHEDULE_KINDS

AUTO = "auto"


@dataclass(frozen=True)
class ScheduleSpec:
    """A parsed schedule: ``kind`` (one of SCHEDULE_KINDS, or "auto") and its mitigation."""

    kind: str
    mitigation: Mitigation | None = None

    @property
    def name(self) -> str:
        return self.kind + (f"+{self.mitigation.name}" if self.mitigation else "")


def parse_schedule(spec: str) -> ScheduleSpec:
    """``"pipedream+predict"`` -> ScheduleSpec("pipedream", Mitigation(predict=True))."""
    if not isinstance(spec, str):
        raise RuntimeConfigError(f"schedule={spec!r} is not a string",
                                 f"use 'auto' or one of {SCHEDULE_KINDS}")
    kind, _, rest = spec.partition("+")
    if kind == "localsgd":
        raise RuntimeConfigError("schedule 'localsgd' in the Trainer",
                                 "LocalSGD runs on the reference executor only: "
                                 "fxpipe.runtime.localsgd_executor.LocalSGDExecutor with "
                                 "fxpipe.runtime.localsgd.make_localsgd_schedule")
    if kind not in SCHEDULE_KINDS + PLACED_KINDS + (AUTO,):
        raise RuntimeConfigError(f"unknown schedule {spec!r}",
                                 f"use 'auto', one of {SCHEDULE_KINDS + PLACED_KINDS}, or "
                                 "'pipedream+<mitigation>'"
                                 f" with mitigations {', '.join(MITIGATIONS)}")
    mitigation = Mitigation.parse(rest) if rest else None
    if mitigation is not None and kind != "pipedream":
        raise RuntimeConfigError(f"schedule {spec!r}: mitigations are options of the asynchronous "
                                 "schedule", f"use 'pipedream+{mitigation.name}'")
    return ScheduleSpec(kind, mitigation)
