"""Which schedule a Trainer runs, and how an epoch is cut into segments of it.

A mixin of :class:`~.trainer.Trainer`: segment lengths, each segment's schedule, a check that tied
weights update with one cadence, and :meth:`adopt` (auto's pick). An asynchronous kind's segments
are windows of one stretch, drained only at an epoch's end, a checkpoint or a switch of plans."""
from __future__ import annotations

import logging
import math
import time
from typing import Any, Callable

import torch

from fxpipe.errors import InfeasiblePlanError

from ..errors import RuntimeConfigError
from ..execution.contract import check_schedule
from ..replica.stage import StageReplica, tied_parameters
from ..schedules.kinds import make_schedule
from ..schedules.localsgd import (DEFAULT_AVERAGE_EVERY, LOCALSGD,
                                 make_localsgd_schedule)
from ..schedules.placement import PLACED_KINDS, make_placed_schedule
from ..schedules.schedule import Schedule, sync_sets, tie_delay
from ..schedules.spec import AUTO, parse_schedule
from ..schedules.staleness import own_delays
from ..schedules.stream import STREAM_KINDS, ScheduleStream, Window
from .data import derive_seed

DEFAULT_SEGMENT = 256
"""Minibatches per segment when neither ``segment`` nor ``checkpoint_every`` is given: bounds the
memory of an epoch of any length, for a drain of (stages - 1) slots per 256 minibatches (about
1% on 4 stages). The first segments of an epoch ramp up (8, 16, 32, ... 256 minibatches: a
segment as long as everything before it plus 8), so training starts once 8 minibatches are read
even from a slow loader; boundaries depend only on the position, so a resume replays them. All
are rounded up to whole update groups (m minibatches for the batched kinds, lcm(replicas) for
pipedream), so a boundary never cuts a batch in two."""
FIRST_SEGMENT = 8
PROFILE_MARGIN = 0.05
"""How much slower than the profile's whole steps a segment must be before the harm verdict
counts one worker as faster by the profile (the profile's error: within 3% of a plain loop on
this machine's models, issue 26's runtime_prediction; it can err either way)."""
HARM_SEGMENTS = 2
"""Segments in a row that must each be slower than one worker before the harm verdict."""

log = logging.getLogger(__name__)


PIPEDREAM_NOAM = "pipedream"
"""``noam="pipedream"``: PipeDream's NOAM, ``ceil(workers / input-stage replicas)``, whatever
the links (the default admits more where the plan's round trips need them)."""


def check_noam(noam: int | str | None, kind: str) -> int | str | None:
    """``noam``: the minibatches in flight at the input stage of an asynchronous schedule
    (``pipedream`` and its variants, ``2bw``): None (the default) or "auto", the fewest that
    hide the plan's communication round trips within its memory (:func:`fxpipe.runtime.pricing.
    plansim.noam_for`: each one more costs a stashed version and an update of staleness at the
    input stage; PipeDream's NOAM for a Trainer without a plan); "pipedream" for PipeDream's
    NOAM; or a number."""
    if noam is None or noam in ("auto", PIPEDREAM_NOAM):
        return noam
    if isinstance(noam, bool) or not isinstance(noam, int) or noam < 1:
        raise RuntimeConfigError(f"noam={noam!r}", "use None or 'auto' (the fewest that hide "
                                 "the plan's round trips), 'pipedream' (PipeDream's NOAM), or "
                                 "a positive number of minibatches in flight")
    if kind not in STREAM_KINDS + (AUTO,):
        raise RuntimeConfigError(f"noam={noam} with schedule {kind!r}",
                                 "noam sets an asynchronous schedule's window (pipedream, 2bw); "
                                 "a flushing schedule's is its microbatches")
    return noam


def check_local_sgd(kind: str, replicas: list[int], average_every: int | None,
                    clip_grad_norm: float | None, precision: str,
                    microbatches: int | None = None, split: int | None = None,
                    shard: str | None = None) -> int | None:
    """LocalSGD's H (``average_every``; the default for ``schedule="localsgd"``, None for every
    other kind, which refuses it), after checking that the plan is R copies of the whole
    pipeline (the same R >= 2 on every stage) and the recipe is one LocalSGD defines."""
    if kind != LOCALSGD:
        if average_every is not None:
            raise RuntimeConfigError(f"average_every={average_every!r} with schedule {kind!r}",
                                     "average_every is LocalSGD's: use schedule='localsgd', or "
                                     "leave it out")
        return None
    h = DEFAULT_AVERAGE_EVERY if average_every is None else average_every
    if isinstance(h, bool) or not isinstance(h, int) or h < 1:
        raise RuntimeConfigError(f"average_every={h!r}", "use a positive number of local "
                                 "updates between two averages of the replicas")
    if len(set(replicas)) != 1 or replicas[0] < 2:
        raise RuntimeConfigError(f"schedule 'localsgd' with replicas {replicas}",
                                 "LocalSGD trains R copies of the whole pipeline: give every "
                                 "stage the same number R >= 2 of replicas, e.g. "
                                 f"{[2] * len(replicas)}")
    if microbatches is not None or split not in (None, 1):
        raise RuntimeConfigError(f"microbatches={microbatches}, split={split} with schedule "
                                 "'localsgd'", "each LocalSGD copy updates after every "
                                 "minibatch: leave microbatches and split out")
    if clip_grad_norm is not None or precision == "fp16":
        what = ("clip_grad_norm" if clip_grad_norm is not None else "precision='fp16'")
        raise RuntimeConfigError(f"{what} with schedule 'localsgd'",
                                 "each copy of the pipeline would need its own global norm or "
                                 "loss scale, which fxpipe does not compute: train LocalSGD "
                                 "without them (bf16 is fine), or use another schedule")
    if shard is not None:
        raise RuntimeConfigError(f"shard={shard!r} with schedule 'localsgd'",
                                 "a LocalSGD copy keeps its own optimizer state: train "
                                 "LocalSGD without shard")
    return h


def local_sgd_replicas(stages: int, workers: int | None) -> list[int]:
    """A compiled plan's LocalSGD: as many copies of its ``stages`` stages as its cluster's
    ``workers`` hold, one stage of one copy per worker (the plan's own replicas do not apply)."""
    copies = (workers or 0) // stages
    if copies < 2:
        raise RuntimeConfigError(f"schedule 'localsgd' on a plan of {stages} stages for "
                                 f"{workers} workers", "LocalSGD needs at least 2 copies of "
                                 f"the pipeline: compile for {2 * stages} or more workers "
                                 f"(fxpipe.compile(model, {2 * stages}, stages={stages}, ...))")
    return [copies] * stages


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
    average_every: int | None
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
    _stream: ScheduleStream | None
    checkpoint_every: int | None
    need_targets: bool
    metrics: Any
    _shares: dict[int, float]
    _share: list[float]
    _wire: Any
    _samples: int
    _one_worker_profile: Any
    _harm_streak: list[float]
    _acc: list[float]
    _dt: float
    _busy: Callable[[], list[float]]
    _peak_slots: Callable[[], list[float]]
    _note_peaks: Callable[[list[float]], list[float]]
    _record: Callable[..., None]
    harm: str | None
    harm_ratio: float | None
    _harm_segments: int
    _noam_spec: int | str | None
    _noams: dict[str, int | None]
    auto_options: Any
    seed: int
    index: int

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
                           else self.replicas[0] * self.average_every if k == LOCALSGD
                           else 1 if self.split > 1  # one minibatch, cut into an update
                           else self.microbatches or sum(self.replicas) for k in kinds))
        self._ramp = segment is None and checkpoint_every is None
        self._first = group * math.ceil(FIRST_SEGMENT / group)
        self.segment = segment or checkpoint_every or group * math.ceil(DEFAULT_SEGMENT / group)
        if kind == LOCALSGD and self.segment % group:
            raise RuntimeConfigError(f"segment={self.segment} with schedule 'localsgd', "
                                     f"{self.replicas[0]} replicas, average_every="
                                     f"{self.average_every}", "a segment ends with an average: "
                                     f"use a multiple of {group} minibatches (replicas x "
                                     "average_every), or leave segment and checkpoint_every out")
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
        self._stream = None
        self._set_segments(spec.kind)  # the same segments as a run that named this schedule
        self._check_tied_cadence()
        self.local, self.schedulers = {}, {}  # no reference keeps the old replicas alive
        self.backend.rebuild(self.optimizer, stashing=self.stashing, mitigation=spec.mitigation,
                             delays=own_delays(spec.kind, self.replicas,
                                               vertical_sync=self.vertical_sync,
                                               microbatches=self._per_update(),
                                               noam=self._noam(spec.kind)))
        self.local = self.backend.local
        self.schedulers = {r: self._lr_scheduler(w.stash.optimizer) for r, w in self.local.items()
                           if self._lr_scheduler is not None and w.stash.optimizer is not None}
        if self.lr_interval == "step":
            for r, sch in self.schedulers.items():
                self.local[r].on_update = sch.step

    def _noam(self, kind: str | None = None) -> int | None:
        """Minibatches in flight at the input stage of ``kind`` (default: this trainer's): the
        user's number; by default (or "auto") the fewest that hide the plan's round trips
        within its memory (:func:`~fxpipe.runtime.pricing.plansim.noam_for`; needs the compiled
        model's plan: ``compiled.trainer``); None: PipeDream's NOAM (``noam="pipedream"``, or
        the default of a Trainer built without a plan)."""
        kind = kind or self.kind
        spec = self._noam_spec
        if kind not in STREAM_KINDS or spec == PIPEDREAM_NOAM:
            return None
        if spec is not None and spec != "auto":
            return int(spec)
        plan = self.auto_options.plan
        if plan is None:
            if spec == "auto":
                raise RuntimeConfigError("noam='auto' without a plan", "use compiled.trainer("
                                         "noam='auto'), or give the number")
            return None
        if kind not in self._noams:
            from ..pricing.plansim import noam_for
            from .memory_fit import check_schedule_memory

            profile = self.auto_options.profile
            held = None
            if plan.cluster.get("memory") is not None:  # what PipeDream's window holds, fitted
                held = check_schedule_memory(plan, profile, kind, None, None,
                                             self.auto_options.temporaries) or None
            base = plan.noam  # PipeDream's
            try:
                window = noam_for(plan, profile, schedule=kind, held=held,
                                  microbatches=self._per_update())
            except InfeasiblePlanError:  # the kind cannot train this plan: the executor says why
                window = base
            self._noams[kind] = window if window != base else None  # None: PipeDream's
            if window != base:
                log.info("%d minibatches in flight at the input stage of %s, the fewest that "
                         "hide the plan's round trips (PipeDream's NOAM: %d; noam='pipedream' "
                         "keeps it)", window, kind, base)
        return self._noams[kind]

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
        elif sched is None and self.kind == LOCALSGD:
            sched = make_localsgd_schedule(len(self.stages), self.replicas[0], n,
                                           average_every=self.average_every)
            check_schedule(self.stages, self.replicas, sched)  # tied weights: refused
            self._schedules[n] = sched
        elif sched is None:
            sched = make_schedule(self.kind, self.replicas, n, microbatches=self._per_update(),
                                  noam=self._noam())
            sched = sched.with_vertical_sync() if self.vertical_sync else sched
            check_schedule(self.stages, self.replicas, sched)
            self._schedules[n] = sched
        return sched

    def _segment_schedule(self, n: int, final: bool) -> Schedule:
        """The schedule of the next segment, ``n`` microbatches: a window of the running
        stretch for an asynchronous kind (``final``: the stretch ends with it and drains; see
        the module doc), else a complete schedule (:meth:`_schedule`)."""
        if self.kind not in STREAM_KINDS:
            return self._schedule(n)
        if self._stream is None:
            self._stream = self._new_stream()
        window = self._stream.window(n, final)
        if final:
            self._stream = None
        return window

    def _new_stream(self) -> ScheduleStream:
        """A stretch of this trainer's asynchronous schedule; the tied stages' updates follow
        the executors' rule (together, or ``d`` rounds apart under pipedream)."""
        ties = [t.stages for t in tied_parameters(self.stages)]
        stream = ScheduleStream(self.kind, self.replicas, microbatches=self._per_update(),
                                vertical_sync=self.vertical_sync, noam=self._noam())
        if not ties:
            return stream
        # the delay rule reads the schedule's name and windows: an empty window of this stream
        probe = Window(stream.name, tuple(self.replicas), 0, {r: () for r in
                       ((s, j) for s, n in enumerate(self.replicas) for j in range(n))},
                       windows=stream.windows)
        return ScheduleStream(self.kind, self.replicas, microbatches=self._per_update(),
                              vertical_sync=self.vertical_sync, noam=self._noam(),
                              sync=tuple(sync_sets(ties)), delay=tie_delay(probe, ties))

    @property
    def stretch_open(self) -> bool:
        """Whether minibatches are in flight between segments (an asynchronous stretch that
        has not drained yet)."""
        return self._stream is not None

    def _drain_due(self, pos: int) -> bool:
        """Whether the segment ending at epoch position ``pos`` must leave the pipeline drained
        (a checkpoint follows it)."""
        return bool(self.checkpoint_every) and pos % self.checkpoint_every == 0

    def _train_segment(self, parts: list[Any], epoch: int, pos: int, n: int, final: bool
                       ) -> tuple[dict[int, float], dict[int, float]]:
        """Train the segment of ``n`` minibatches (cut into ``parts``) starting at epoch
        position ``pos``, as ``fit`` and auto's pilot on the pipeline both do: dropout seeded
        from the position wherever a stretch starts (reproducible), then :meth:`_run`.
        ``final``: the pipeline drains at its end."""
        if not self.stretch_open:  # dropout reproducible from the position
            torch.manual_seed(derive_seed(self.seed, epoch, pos, self.index))
        return self._run(self._segment_schedule(len(parts), final), parts, epoch, n)

    def _run(self, sched: Schedule, parts: list[Any], epoch: int, n: int
             ) -> tuple[dict[int, float], dict[int, float]]:
        """Carry one segment out (``n`` of the loader's minibatches, cut into ``parts``) and
        account its losses: those of the minibatches that reached the last stage in it (under
        an asynchronous kind some of a segment's minibatches finish in the next one). Returns
        them and their weights in the loss, by their number in the schedule."""
        start = getattr(sched, "start", 0)
        if start == 0:  # a new schedule numbers its minibatches from 0
            self._shares = {}
        if self.need_targets:  # each minibatch's weight in the loss (trainer_cut)
            self._shares.update((start + k, v) for k, v in
                                enumerate(self._share or [1.0] * len(parts)))
        t0 = time.perf_counter()
        losses = self.backend.run_segment(sched, parts, self._wire)
        self._dt = dt = time.perf_counter() - t0
        # one exchange for the loss and the stages' busy time (metrics): every rank takes part
        # whether or not it was given a metrics path
        weights = {k: self._shares.pop(k, 1.0) for k in losses}
        got = self.backend.all_sum([sum(v * weights[k] for k, v in losses.items()),
                                    sum(weights.values()), *self._busy(), *self._peak_slots()],
                                   "loss sum")
        got = self._note_peaks(got)  # measure_memory: the ranks' peaks (trainer_results)
        acc = self._acc
        self._acc = [acc[0] + got[0], acc[1] + got[1], acc[2] + self._samples, acc[3] + dt]
        if self.metrics.enabled:
            self._record(epoch, n, got, dt, sched)
        self._check_harm(got[2:], dt, n)
        return losses, weights

    def _check_harm(self, busy: list[float], dt: float, n: int) -> None:
        """Do no harm (issue 27): after the first segment (it fills the pipeline and warms up),
        say once when :data:`HARM_SEGMENTS` segments in a row each took longer than one worker
        doing all their work would have (one slow segment may be a stall of the machine: on
        the emulated cluster a single one fell back a plan running at 0.96x one process).

        One worker's time is the least of two figures: all the stages' compute together
        (``busy``: seconds per stage, the mean over its replicas), and the compiled profile's
        measured whole training steps for the segment's samples (:meth:`_one_worker_s`), plus
        :data:`PROFILE_MARGIN`. Why both: split compute is not one worker's. A VGG whose
        minibatches were cut in two computed 1.2x a plain step in all on the emulated cluster,
        so by that figure alone no 2-worker run slower than one process by less was ever
        judged harmful. The profile errs both ways (within 3% of a plain loop for
        runtime_prediction's models; 15-21% above it for that VGG, profiled in the job). Only
        processes can tell (the reference executor runs every rank in turn); the verdict is
        :attr:`harm` and :attr:`harm_ratio`."""
        self._harm_segments += 1
        if (self.harm is not None or self._harm_segments < 2 or n == 0
                or sum(self.replicas) < 2 or getattr(self.backend, "world", 1) < 2):
            return
        total = sum(b * r for b, r in zip(busy, self.replicas))
        step = self._one_worker_s(self._samples)
        one = total if step is None else min(total, step * (1 + PROFILE_MARGIN))
        if one <= 0 or dt <= one:
            self._harm_streak = []
            return
        self._harm_streak.append(dt / one)
        if len(self._harm_streak) < HARM_SEGMENTS:  # one slow segment may be the machine's
            return
        self.harm_ratio = min(self._harm_streak)
        said = (f"their compute was {total:.3g} s in all" if step is None else
                f"one worker would take about {one:.3g} s (their compute in all: {total:.3g} s; "
                f"the profile's whole steps: {step:.3g} s, + {PROFILE_MARGIN:.0%})")
        plan = self.auto_options.plan
        predicted = ("" if plan is None or not plan.one_worker_time else
                     f"; the plan predicted {plan.time_per_minibatch * 1e3:.3g} ms per minibatch "
                     f"against one worker's {plan.one_worker_time * 1e3:.3g} ms: its costs are "
                     "not what this run meets (estimated for a device, measured on another "
                     "machine, or the ranks share cores with other processes)")
        self.harm = (f"{sum(self.replicas)} workers took {dt:.3g} s for {n} minibatches while "
                     f"{said}: one worker would have been {self.harm_ratio:.2f}x faster (the "
                     f"least over {HARM_SEGMENTS} segments in a row; the links, "
                     "the pipeline's bubbles or its per-message costs cost more than the split "
                     f"gains){predicted}")
        nxt = ("re-planning onto one worker (replan='auto')" if getattr(self, "replanner", None)
               is not None else "training goes on with this plan; pass replan='auto' to go on "
               "with one worker when this happens")
        if self.index == 0:  # every rank judges; one says it
            log.warning("this plan is slower than one worker: %s; %s", self.harm, nxt)

    def _one_worker_s(self, samples: int) -> float | None:
        """Seconds one worker takes to train ``samples`` samples by the compiled profile (its
        whole training step, measured on this machine's device and calibrated,
        ``costmodel.calibrate``, scaled to the samples); None without a measured profile or
        without samples on this rank. Always the profile the job was compiled with: a
        re-plan's rescaled profile holds the times of the run's forwards and backwards, which
        are a microbatch's under ``split=`` (on the emulated cluster's VGG, split in two, it
        put one worker at 36 ms per minibatch where a plain loop took 48)."""
        prof = self._one_worker_profile
        if (prof is None or not samples or not getattr(prof, "batch_size", None)
                or not prof.meta.get("calibration")):
            return None
        return prof.total_compute_s * samples / prof.batch_size

    def drain(self, epoch: int) -> tuple[dict[int, float], dict[int, float]]:
        """Let an asynchronous stretch's minibatches in flight finish, so the pipeline is
        drained (weights and optimizer states a consistent cut): at an epoch's end, before a
        switch of plans. Nothing to do when no stretch runs; every rank calls it. Returns the
        losses of the minibatches that finished (and their weights), as :meth:`_run`."""
        if not self.stretch_open:
            return {}, {}
        self._samples, self._share, self._wire = 0, [], None
        return self._run(self._segment_schedule(0, True), [], epoch, 0)

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
        """Minibatches in the segment starting at epoch position ``pos`` (see DEFAULT_SEGMENT).
        Fixed segments end on multiples of ``segment`` (where checkpoints fall): after auto's
        pilot or second look, ``fit`` may go on from any position, and the first segment from
        there is cut short so that the next ones line up again."""
        if self._ramp:
            return min(self.segment, pos + self._first)
        return self.segment - pos % self.segment
