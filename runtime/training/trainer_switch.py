"""Re-plan a running job in place: ``compiled.trainer(replan="auto")``.

At a segment boundary the ranks agree on a plan re-solved from their measured stage times
(:func:`measured_stage_times`); one predicted faster by more than ``replan_threshold`` takes
over after a drain, the state moved by name, no process restarted (flushing schedules only)."""
from __future__ import annotations

import gc
import logging
import shutil
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import torch

from fxpipe.codegen.split import StageSpec, split_graph
from fxpipe.costmodel import Cluster
from fxpipe.passes import Plan
from fxpipe.passes.partition import plan_for

from ..errors import RuntimeConfigError
from ..execution.trainer_backends import DistributedBackend
from ..pricing.replan import (Proposal, StageTimes, after_first_update, mean_times, measure,
                              propose)
from . import checkpoint as ckpt
from .auto import AutoOptions
from .data import PartStream
from .host import Exchange, TrainingHost
from .repartition import Repartition, stage_layout

log = logging.getLogger(__name__)

REPLAN_MODES = ("auto",)
REPLAN_SCHEDULES = ("1f1b-flush", "gpipe")
Measure = Callable[[TrainingHost], Sequence[StageTimes]]  # trainer -> one StageTimes per stage


@dataclass
class ReplanRecord:
    """One re-planning decision: where, what was proposed, whether it was carried out, and the
    measured seconds per minibatch of the segments before it and (once run) after it."""

    epoch: int
    position: int
    proposal: Proposal
    adopted: bool
    measured_before_s: float
    measured_after_s: float | None = None
    before_segments: list[float] = field(default_factory=list)  # s per minibatch, per segment
    after_segments: list[float] = field(default_factory=list)

    @property
    def measured_gain(self) -> float | None:
        """before / after - 1 (positive: faster), once segments of the new plan have run."""
        if self.measured_after_s is None or self.measured_after_s <= 0:
            return None
        return self.measured_before_s / self.measured_after_s - 1.0


def stage_locations(model: torch.nn.Module, specs: Sequence[StageSpec]
                    ) -> dict[str, tuple[int, str] | torch.Tensor]:
    """``model.state_dict()`` key -> (stage, name there) of the first stage holding that very
    tensor, else the tensor (what ``CompiledModel.state_locations`` gives for its own stages,
    here for another plan's)."""
    where: dict[int, tuple[int, str]] = {}
    for st in specs:
        for n, t in st.gm.state_dict(keep_vars=True).items():
            where.setdefault(id(t), (st.index, n))
    return {k: where.get(id(t), t) for k, t in model.state_dict(keep_vars=True).items()}


class Replanner:
    """What ``replan="auto"`` needs to switch plans: the compiled model (to split the stages of
    another plan), the trainer's own arguments (to build the new plan's trainer), the decision's
    settings. ``measure(trainer)``: per-stage times; default: this rank's timelines, exchanged
    (distributed executor, ``timeline=True``); the reference executor records none, so it needs
    one (tests pass a perfect timer)."""

    def __init__(self, compiled: Any, kwargs: dict[str, Any], *, mode: str = "auto",
                 threshold: float = 0.05, after: int = 1, max_decisions: int = 3,
                 measure: Measure | None = None) -> None:
        if mode not in REPLAN_MODES:
            raise RuntimeConfigError(f"replan={mode!r}", f"use one of {REPLAN_MODES} or None")
        if not isinstance(threshold, (int, float)) or not threshold >= 0:
            raise RuntimeConfigError(f"replan_threshold={threshold!r}",
                                     "a non-negative fraction, e.g. 0.05 (5% faster)")
        if isinstance(after, bool) or not isinstance(after, int) or after < 1:
            raise RuntimeConfigError(f"replan_after={after!r}",
                                     "a positive number of segments to measure first")
        if (isinstance(max_decisions, bool) or not isinstance(max_decisions, int)
                or max_decisions < 1):
            raise RuntimeConfigError(f"replan_max={max_decisions!r}",
                                     "a positive number of decisions (1: decide once)")
        self.compiled, self.kwargs = compiled, dict(kwargs)
        self.threshold, self.after, self.measure = threshold, after, measure
        self.max_decisions = max_decisions
        self.plan: Plan = compiled.plan
        self.profile = compiled.profile
        self.records: list[ReplanRecord] = []
        self._segments: list[float] = []  # s per minibatch of each segment under self.plan
        # every segment of the run: (plans adopted before it, seconds per minibatch)
        self.segment_times: list[tuple[int, float]] = []
        self.fell_back = False  # re-planned onto one worker (fall_back): the last decision

    def bind(self, trainer: TrainingHost) -> Replanner:
        """Check the trainer can be re-planned (called when it is built)."""
        if trainer.kind not in REPLAN_SCHEDULES:
            raise RuntimeConfigError(
                f"replan='auto' with schedule {trainer.schedule_name!r}",
                f"re-planning in place supports the flushing schedules {REPLAN_SCHEDULES} "
                "(the same computation under every plan); name one: schedule='1f1b-flush'")
        if self.measure is None and trainer.backend.__class__.__name__ == "ReferenceBackend":
            raise RuntimeConfigError("replan='auto' with executor='reference' and no "
                                     "replan_measure", "the reference executor records no "
                                     "timeline: pass replan_measure=(trainer -> StageTimes per "
                                     "stage), or train with executor='distributed'")
        return self

    # ------------------------------------------------------------------ the boundary hook
    def after_segment(self, trainer: TrainingHost, it: PartStream, loader: Iterable[Any],
                      epoch: int, pos: int, n: int, dt: float) -> PartStream:
        """Called by ``fit`` on every rank after each segment; returns the data stream to
        continue with (a new one after a switch, which drains the pipeline first)."""
        self._segments.append(dt / max(n, 1))
        self.segment_times.append((sum(r.adopted for r in self.records), dt / max(n, 1)))
        if self.records and self.records[-1].adopted \
                and self.records[-1].measured_after_s is None:
            rec = self.records[-1]
            rec.after_segments = list(self._segments)
            if len(self._segments) >= self.after + 1:  # the first segment warms up
                rec.measured_after_s = _mean(self._segments[1:])
                log.info("re-plan measured: %.4g -> %.4g ms per minibatch (%+.1f%%; predicted "
                         "%+.1f%%)", rec.measured_before_s * 1e3, rec.measured_after_s * 1e3,
                         100 * (rec.measured_gain or 0.0), 100 * rec.proposal.gain)
        if self.fell_back:
            return it  # one worker trains on: nothing left to re-plan
        if sum(self.plan.replicas) > 1:
            harm, ratio = trainer.backend.broadcast((trainer.harm, trainer.harm_ratio),
                                                    "do-no-harm verdict")  # rank 0's
            if harm is not None:
                return self.fall_back(trainer, it, loader, epoch, pos, harm, ratio)
        if self.records and (not self.records[-1].adopted
                             or len(self.records) >= self.max_decisions):
            return it  # the plan stopped moving, or the decisions are used up
        # after a switch the new plan's first segment warms up: it is measured but not used
        warm = 1 if self.records else 0
        if len(self._segments) < self.after + warm:
            return it
        measured = (list(self.measure(trainer)) if self.measure is not None
                    else trainer.measured_stage_times(skip=1 if self.after > 1 or warm else 0))
        cluster = Cluster.from_dict(dict(self.plan.cluster))
        proposal = propose(self.profile, self.plan, measured, cluster,
                           threshold=self.threshold, sync=self.plan.sync,
                           workers=sum(self.plan.replicas))
        before = _mean(self._segments[1:] or self._segments)
        rec = ReplanRecord(epoch, pos, proposal, proposal.adopt, before,
                           before_segments=list(self._segments))
        self.records.append(rec)
        log.info("re-plan at epoch %d minibatch %d: %s", epoch, pos, proposal.summary())
        if not proposal.adopt:
            return it
        return self._switch_at(trainer, proposal, it, loader, epoch, pos)

    def fall_back(self, trainer: TrainingHost, it: PartStream, loader: Iterable[Any],
                  epoch: int, pos: int, harm: str, ratio: float) -> PartStream:
        """Do no harm (issue 27): the segments measured slower than one worker doing every
        stage's work (``Trainer.harm``, rank 0's verdict for every rank), so the job goes on with
        one worker: rank 0 trains the whole model in its process (the reference executor, the
        same computation under a flushing schedule) and the other ranks become idle and return
        from ``fit``. The measured per-minibatch time is the evidence; the gain is what the
        verdict measured (the segment's time over the stages' compute, less 1)."""
        cluster = Cluster.from_dict({**dict(self.plan.cluster), "workers": 1})
        one = plan_for(self.profile, cluster, [0], [1], sync=self.plan.sync)
        proposal = Proposal(self.plan, one, ratio - 1.0, True, ())
        log.warning("re-planning onto one worker: %s", harm)
        before = _mean(self._segments[1:] or self._segments)
        self.records.append(ReplanRecord(epoch, pos, proposal, True, before,
                                         before_segments=list(self._segments)))
        self.fell_back = True
        return self._switch_at(trainer, proposal, it, loader, epoch, pos)

    def _switch_at(self, trainer: TrainingHost, proposal: Proposal, it: PartStream,
                   loader: Iterable[Any], epoch: int, pos: int) -> PartStream:
        trainer.drain(epoch)  # an asynchronous stretch's minibatches in flight finish first
        self.switch(trainer, proposal, epoch, pos)
        self._segments = []
        it.close()
        return PartStream(loader, epoch, trainer.seed, need_inputs=trainer.need_inputs,
                          need_targets=trainer.need_targets, start=pos,
                          prefetch=trainer.prefetch if trainer.need_inputs
                          or trainer.need_targets else 0)

    # ------------------------------------------------------------------ the switch
    def new_plan(self, proposal: Proposal) -> Plan:
        """The proposal as a plan this model's trainer runs (fingerprint, staleness table)."""
        from ..schedules.staleness import plan_staleness

        plan = replace(proposal.proposed, model_fingerprint=self.plan.model_fingerprint)
        return replace(plan, staleness=plan_staleness(plan.replicas))

    def switch(self, trainer: TrainingHost, proposal: Proposal, epoch: int, pos: int) -> None:
        """Carry ``proposal`` out on ``trainer`` at the boundary ``(epoch, pos)`` (see the
        module doc); a collective: every rank calls it."""
        plan = self.new_plan(proposal)
        specs = split_graph(self.compiled.traced.gm,
                            {name: st.index for st in plan.stages for name in st.nodes})
        root, folder = self._transfer_folder(trainer, epoch, pos)
        try:
            found = self._save(trainer, folder, epoch, pos)
            kw = dict(self.kwargs)
            if kw.get("recompute") is not None and not isinstance(kw["recompute"], bool):
                kw["recompute"] = plan.recompute  # per-stage flags: the new plan's
            auto = {**AutoOptions.given(kw.pop("auto_options", None)), "plan": plan,
                    "profile": proposal.profile or self.profile}
            kw.update(metrics_path=None, tensorboard_dir=None, progress=False,
                      replan=None, auto_options=auto)
            if sum(plan.replicas) == 1:  # fall_back: the same updates on one worker
                if trainer.split > 1:  # the cut is invisible: each minibatch runs whole
                    kw.update(split=None, microbatches=1)
                else:  # as many minibatches per update as before (default: the workers)
                    kw["microbatches"] = trainer._per_update() or sum(trainer.replicas)
                if trainer.index == 0:  # the one worker: this process
                    kw.update(executor="reference", timeline=False, measure_memory=False)
            new = type(trainer)(specs, plan.replicas, fingerprint=self.plan.model_fingerprint,
                          state_keys=stage_locations(self.compiled.model, specs), **kw)
            source = Repartition(found, new.stages)
            for rank, w in new.local.items():
                new._load_stage(rank, w, source.state_for(
                    rank[0], w.stash.latest, w.buffers, w.stash.optimizer,
                    new.schedulers.get(rank), w.stash.masters.master))
            trainer.backend.all_sum([0.0], "re-plan: state loaded")
        finally:
            if trainer.index == 0:
                shutil.rmtree(root, ignore_errors=True)
        self._take_over(trainer, new)
        log.info("re-planned at epoch %d minibatch %d: replicas %s -> %s, stages %d -> %d",
                 epoch, pos, self.plan.replicas, plan.replicas, len(self.plan.stages),
                 len(plan.stages))
        self.plan, self.profile = plan, proposal.profile or self.profile

    def _transfer_folder(self, trainer: TrainingHost, epoch: int, pos: int) -> tuple[Path, Path]:
        """Where the boundary's state travels (the folder to delete afterwards, and the one to
        write): under the checkpoint dir (shared by every rank, as checkpoints need), else a
        temporary folder rank 0 makes (ranks on one machine)."""
        name = f".replan-e{epoch}-m{pos}"
        if trainer.checkpoint_dir is not None:
            return Path(trainer.checkpoint_dir) / name, Path(trainer.checkpoint_dir) / name
        made = tempfile.mkdtemp(prefix="fxpipe-replan-") if trainer.index == 0 else None
        root = Path(trainer.backend.broadcast(made, "re-plan: transfer folder"))
        return root, root / name

    @staticmethod
    def _save(trainer: TrainingHost, folder: Path, epoch: int, pos: int) -> ckpt.Found:
        """Every stage's state under the old plan (replica 0 of each stage writes), then the
        manifest with the layout (rank 0): a checkpoint :class:`Repartition` reads."""
        for rank in trainer.local:
            if rank[1] == 0:
                ckpt.save_stage(folder, epoch, pos, rank[0],
                                trainer._stage_state(rank, epoch, pos))
        trainer.backend.all_sum([0.0], "re-plan: stage states written")
        if trainer.index == 0:
            ckpt.write_manifest(folder, epoch, pos, len(trainer.stages),
                                {"replicas": trainer.replicas, "layout":
                                 stage_layout(trainer.stages)})
        trainer.backend.all_sum([0.0], "re-plan: manifest written")
        return ckpt.check_folder(folder / ckpt.checkpoint_name(epoch, pos), None, verify=False)

    @staticmethod
    def _take_over(trainer: TrainingHost, new: TrainingHost) -> None:
        """``trainer`` becomes the new plan's trainer; its history, metrics log, progress
        setting and re-planner stay. The old backend leaves its groups (not the default one,
        which the new backend now owns)."""
        old = trainer.backend
        if isinstance(old, DistributedBackend) and not isinstance(new.backend,
                                                                  DistributedBackend):
            old.close()  # one worker on: no process group any more (every rank leaves it)
        elif hasattr(old, "_owns_group"):
            new.backend._owns_group, old._owns_group = old._owns_group, False
            old.comm.groups.clear()
            old.control = None
        keep = {"history", "metrics", "replanner", "progress", "_acc",  # the epoch's sums so far
                "cut_spec", "loss_rule", "_probe_size", "_bn_warned",  # the cut: tested once
                "_one_worker_profile"}  # the compiled profile, not a re-plan's rescaled one
        for k, v in vars(new).items():
            if k not in keep:
                setattr(trainer, k, v)
        m = trainer.metrics
        m.num_stages, m._busy = len(trainer.stages), (m._busy + [0.0] * len(trainer.stages)
                                                       )[:len(trainer.stages)]
        del old, new
        gc.collect()  # the old groups go now, GIL held (see DistributedBackend.close)


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def make_replanner(compiled: Any, kwargs: dict[str, Any]) -> Replanner | None:
    """Pop the ``replan*`` options of ``CompiledModel.trainer(**kwargs)``; a Replanner when
    ``replan`` is set (the distributed executor then records timelines to measure from)."""
    mode = kwargs.pop("replan", None)
    opts = {k: kwargs.pop(f"replan_{k}") for k in ("threshold", "after", "max", "measure")
            if f"replan_{k}" in kwargs}
    if mode is None:
        if opts:
            raise RuntimeConfigError(f"replan options {sorted(opts)} without replan=",
                                     "pass replan='auto'")
        return None
    if "max" in opts:
        opts["max_decisions"] = opts.pop("max")
    if kwargs.get("executor", "distributed") == "distributed" and "measure" not in opts:
        kwargs["timeline"] = True
    return Replanner(compiled, kwargs, mode=mode, **opts)


def measured_stage_times(timelines: Sequence[tuple[Sequence[Any], Any]], local: Sequence[int],
                         stages: int, exchange: Exchange, skip: int = 0) -> list[StageTimes]:
    """Per stage of ``stages``, the mean over its replicas and over the recorded segments
    (``timelines``: this rank's, one (events, ...) per segment; but the first ``skip``: warm-up)
    of the measured forward and backward per minibatch and optimizer step per update; this
    rank's replicas train the stages in ``local``, and ``exchange`` gathers every rank's. The
    first segment, when it is measured (``skip=0``), counts only after its first update
    (:func:`.replan.after_first_update`: the warm-up). A collective: every rank calls it."""
    mine: list[tuple[int, StageTimes]] = []
    segments = [after_first_update(list(events)) if i == 0 else list(events)
                for i, (events, _) in enumerate(timelines) if i >= skip] or [
        list(events) for events, _ in timelines[-1:]]
    if segments:
        avg = mean_times([measure(events) for events in segments])
        mine = [(s, avg) for s in local]
    by_stage: dict[int, list[StageTimes]] = {}
    for share in exchange(mine, "re-plan: measured stage times"):
        for s, t in share or []:
            by_stage.setdefault(s, []).append(t)
    missing = [s for s in range(stages) if s not in by_stage]
    if missing:
        raise RuntimeConfigError(f"no timeline of stages {missing} to re-plan from",
                                 "train with timeline=True (distributed executor) first")
    return [mean_times(by_stage[s]) for s in range(stages)]
