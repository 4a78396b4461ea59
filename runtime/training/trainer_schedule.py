"""Which schedule a Trainer runs, and how an epoch is cut into segments of it.

A mixin of :class:`~fxpipe.runtime.training.trainer.Trainer`, kept apart so the training loop reads
on its own: the segment lengths (each segment is one complete, validated schedule; checkpoints
happen only at segment ends), the check that tied weights update with one cadence on every stage
that holds them (a clear error before any process group, not a hang), and :meth:`adopt`, the switch
to the schedule ``schedule="auto"`` chose.
"""
from __future__ import annotations

import math
from typing import Any, Callable

import torch

from ..errors import RuntimeConfigError
from ..execution.contract import check_schedule
from ..replica.stage import StageReplica, tied_parameters
from ..schedules.kinds import make_schedule
from ..schedules.placement import PLACED_KINDS, make_placed_schedule
from ..schedules.schedule import Schedule
from ..schedules.spec import AUTO, parse_schedule
from ..schedules.staleness import own_delays

DEFAULT_SEGMENT = 256
"""Minibatches per segment when neither ``segment`` nor ``checkpoint_every`` is given: bounds the
memory of an epoch of any length, for a drain of (stages - 1) slots per 256 minibatches (about
1% on 4 stages). The first segments of an epoch ramp up (8, 16, 32, ... 256 minibatches: a
segment as long as everything before it plus 8), so training starts once 8 minibatches are read
even from a slow loader; boundaries depend only on the position, so a resume replays them. All
are rounded up to whole update groups (m minibatches for the batched kinds, lcm(replicas) for
pipedream), so a boundary never cuts a batch in two."""
FIRST_SEGMENT = 8


def check_placed_executor(kind: str, executor: str) -> None:
    """The Trainer's distributed backend runs one stage per process: a placed kind (several
    per process) trains with the reference executor there (the same numbers)."""
    if kind in PLACED_KINDS and executor != "reference":
        raise RuntimeConfigError(f"schedule {kind!r} with executor={executor!r}",
                                 "the Trainer's distributed backend runs one stage per process; "
                                 "train a placed kind with executor='reference' (same numbers), "
                                 "or on processes with fxpipe.runtime.execution.launch.run_placed")


class ScheduleMixin:
    """Schedule and segment methods of the Trainer (it provides the attributes declared here)."""

    stages: list[Any]
    replicas: list[int]
    microbatches: int | None
    split: int
    kind: str
    schedule_name: str
    mitigation: Any
    vertical_sync: bool
    optimizer: Any
    stashing: bool
    backend: Any
    local: dict[tuple[int, int], StageReplica]
    schedulers: dict[tuple[int, int], Any]
    lr_interval: str
    _lr_scheduler: Callable[[torch.optim.Optimizer], Any] | None
    _schedules: dict[int, Schedule]
    _segment_args: tuple[int | None, int | None]
    _ramp: bool
    _first: int
    segment: int

    def _check_tied_cadence(self) -> None:
        """Stages sharing a tied weight must update equally often, or their tied all-reduces
        never pair up (a hang until the timeout): check on a short schedule of the same kind."""
        if not tied_parameters(self.stages) or self.kind == AUTO:  # auto: checked in adopt()
            return
        m = self.microbatches or sum(self.replicas)
        n = 2 * math.lcm(*self.replicas) * (1 if self.kind == "pipedream" else m)
        try:
            probe = self._schedule(n)
        except RuntimeConfigError:
            raise
        except Exception as err:  # noqa: BLE001 - a kind that cannot run this shape says why
            raise RuntimeConfigError(f"schedule {self.kind!r} with replicas {self.replicas}: "
                                     f"{err}", None) from err
        del self._schedules[probe.num_minibatches]

    def _set_segments(self, kind: str) -> None:
        """Segment lengths for ``kind``. Default segments are whole update groups (m minibatches
        for the batched kinds, a round of every replica for pipedream), so a boundary never
        splits a batch; ``auto`` (before it chooses) takes a length whole for every candidate."""
        segment, checkpoint_every = self._segment_args
        kinds = ("pipedream", "1f1b-flush") if kind == AUTO else (kind,)
        group = math.lcm(*(math.lcm(*self.replicas) if k == "pipedream"
                           else 1 if self.split > 1  # one minibatch, cut into an update
                           else self.microbatches or sum(self.replicas) for k in kinds))
        self._ramp = segment is None and checkpoint_every is None
        self._first = group * math.ceil(FIRST_SEGMENT / group)
        self.segment = segment or checkpoint_every or group * math.ceil(DEFAULT_SEGMENT / group)
        if checkpoint_every and checkpoint_every % self.segment:
            raise RuntimeConfigError(f"checkpoint_every={checkpoint_every} is not a multiple of "
                                     f"segment={self.segment}", "checkpoints happen only at "
                                     "segment ends (where the pipeline is drained)")

    def adopt(self, schedule: str, split: int = 1) -> None:
        """Switch to ``schedule`` before training (what ``schedule="auto"`` chose): new stage
        replicas with the same initial weights, optimizers made for the new schedule's delays.
        ``split``: microbatches each loader minibatch is cut into (one update per minibatch;
        :mod:`fxpipe.runtime.training.trainer_cut`)."""
        spec = parse_schedule(schedule)
        if split > 1 and (spec.kind == "pipedream" or self.microbatches is not None):
            raise RuntimeConfigError(f"split={split} with schedule {schedule!r} and "
                                     f"microbatches={self.microbatches}", "split only a "
                                     "microbatched schedule's minibatches, when the user gave "
                                     "no microbatches")
        self.kind, self.schedule_name, self.mitigation = spec.kind, spec.name, spec.mitigation
        self.split = split
        self._schedules.clear()
        self._set_segments(spec.kind)  # the same segments as a run that named this schedule
        self._check_tied_cadence()
        self.backend.rebuild(self.optimizer, stashing=self.stashing, mitigation=spec.mitigation,
                             delays=own_delays(spec.kind, self.replicas,
                                               vertical_sync=self.vertical_sync,
                                               microbatches=self._per_update()))
        self.local = self.backend.local
        self.schedulers = {r: self._lr_scheduler(w.stash.optimizer) for r, w in self.local.items()
                           if self._lr_scheduler is not None and w.stash.optimizer is not None}
        if self.lr_interval == "step":
            for r, sch in self.schedulers.items():
                self.local[r].on_update = sch.step

    def _per_update(self) -> int | None:
        """Microbatches per update of the batched kinds (None: the schedule's default)."""
        return self.split if self.split > 1 else self.microbatches

    def _schedule(self, n: int) -> Schedule:
        """The (validated) schedule of a segment of ``n`` microbatches (``n`` minibatches
        unless they are split, :meth:`adopt`), made once per length:
        every full segment of every epoch has the same one. Checked against the stages too
        (tied weights need one update cadence on every stage holding them)."""
        sched = self._schedules.get(n)
        if sched is None and self.kind in PLACED_KINDS:
            sched = self._placed(n)
        elif sched is None:
            sched = make_schedule(self.kind, self.replicas, n, microbatches=self._per_update())
            sched = sched.with_vertical_sync() if self.vertical_sync else sched
            check_schedule(self.stages, self.replicas, sched)
            self._schedules[n] = sched
        return sched

    def _placed(self, n: int) -> Schedule:
        """A placed kind's per-stage lists (the reference executor runs them; their order is
        the placement's, see :mod:`fxpipe.runtime.schedules.placement`): zb-v on S / 2 processes,
        interleaved-1f1b with 2 stages per process (round robin); equal replicas: copies of the
        whole placed pipeline."""
        if len(set(self.replicas)) > 1:
            raise RuntimeConfigError(f"schedule {self.kind!r} with replicas {self.replicas}",
                                     "the placed kinds replicate the whole pipeline: give every "
                                     "stage the same number of replicas")
        S, R = len(self.replicas), self.replicas[0]
        placed = make_placed_schedule(self.kind, math.ceil(S / 2), n, num_stages=S,
                                      microbatches=self.microbatches or sum(self.replicas),
                                      replicas=R)
        return placed.schedule

    def _segment_at(self, pos: int) -> int:
        """Minibatches in the segment starting at epoch position ``pos`` (see DEFAULT_SEGMENT)."""
        return min(self.segment, pos + self._first) if self._ramp else self.segment
