"""The user-facing training loop: ``Trainer.fit(loader, epochs, eval_loader, resume)``.

Every rank runs the same script and loader (:mod:`.data`), read in segments; ``fit`` trains in
the modes the user's modules are in and leaves trained weights on their ranks. This module is
the loop; :mod:`.trainer_schedule` and the other ``trainer_*`` modules hold the rest."""
from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch

from fxpipe.codegen.split import MODEL, StageSpec
from fxpipe.errors import FxpipeError
from fxpipe.tracing.batchdims import BatchDims

from ..errors import RuntimeConfigError
from ..execution.contract import Batch
from ..execution.trainer_backends import (DistributedBackend, IdleBackend, ReferenceBackend,
                                          ranks_text, surplus_rank)
from ..replica.stage import LossFn, StageReplica, check_stages
from ..replica.stash import OptimizerFactory
from ..replica.state_size import temporaries_for
from ..replica.step_options import StepOptions, check_shard
from ..replica.weighted import WeightedLoss
from ..schedules.localsgd import LOCALSGD
from ..schedules.placement import PLACED_KINDS
from ..schedules.schedule import Schedule
from ..schedules.spec import AUTO, parse_schedule
from ..schedules.staleness import own_delays
from .auto import DEFAULT_CANDIDATES, AutoOptions, Decision
from .auto_look import look_again
from .auto_resolve import resolve as resolve_auto
from . import checkpoint as ckpt
from .checkpoint import KEEP, check_directory
from .config import (CheckpointConfig, DataConfig, LrSchedulerConfig, MetricsConfig,
                     PrecisionConfig, RunConfig, ScheduleConfig, flat_options)
from .data import PartStream
from .first_check import check_loss_fn
from .memory_fit import check_schedule_memory, fitting_candidates
from .metrics import MetricsLog
from .param_names import as_factory, wrap_factory
from .trainer_checkpoint import CheckpointMixin
from .trainer_cut import CutMixin, check_split
from .trainer_progress import Progress
from .trainer_results import ResultsMixin
from .trainer_schedule import (DEFAULT_SEGMENT, FIRST_SEGMENT, ScheduleMixin, check_local_sgd,
                               check_noam, check_placed_executor, local_sgd_replicas)
from .trainer_switch import Replanner, make_replanner

__all__ = ["DEFAULT_SEGMENT", "FIRST_SEGMENT", "History", "LR_INTERVALS", "Trainer",
           "make_trainer"]

log = logging.getLogger(__name__)

History = list[dict[str, float]]
_EVAL_CHUNK = 64  # eval minibatches per exchange
LR_INTERVALS = ("step", "epoch")


class Trainer(ScheduleMixin, CutMixin, ResultsMixin, CheckpointMixin):
    """Trains the stages of a plan with a PipeDream schedule (docs/design-notes.md).

    Options come in sections (:mod:`.config`: ``schedule``, ``data``, ``checkpoint``,
    ``precision``, ``metrics``, ``run``, ``lr_scheduler``); below, each is named by the flat
    option it sets, which earlier releases took as a keyword (still taken, for one release).

    ``stages``/``replicas``: the CompiledModel's ``stage_specs`` and ``plan.replicas``.
    ``optimizer``: ``params -> torch.optim.Optimizer`` (one per stage replica; a factory that
    also takes ``stage`` and ``delay`` keywords receives the stage index and its weight delay).
    ``schedule``: a kind (``pipedream``, ``1f1b-flush``, ``gpipe``, ``2bw``), ``pipedream`` with
    staleness mitigations (``"pipedream+predict"``, :mod:`fxpipe.runtime.replica.mitigation`), or
    ``"auto"``: chosen at the start of :meth:`fit` by a pilot (:mod:`fxpipe.runtime.training.auto`,
    ``auto_options``), recorded in :attr:`auto_decision` (the default of
    ``CompiledModel.trainer``; this class defaults to ``pipedream``).
    ``executor``: "distributed" (this process is one torchrun rank) or "reference" (every rank
    in this process, deterministic: the oracle). ``device``: None (``cuda:LOCAL_RANK`` when
    CUDA is available, else the CPU), "cpu", "cuda" or "cuda:N". ``timeout_s`` bounds every
    pipeline message and collective; ``data_timeout_s`` the control messages a rank may wait
    on while another reads its loader. ``on_checkpoint(epoch, minibatch)`` is called
    on every rank after a checkpoint is complete. ``timeline=True`` (distributed executor)
    records this rank's forwards, backwards, updates, sends, receives and all-reduces: one
    ``(events, background)`` pair per segment in :attr:`timelines`, in seconds since
    :attr:`timeline_origin` (a ``time.perf_counter()`` value; compute spans timed with CUDA
    events on a GPU). ``measure_memory=True`` (distributed executor, every rank alike) measures
    each rank's peak bytes of live tensors while it trains (:mod:`fxpipe.runtime.replica.
    live_bytes`): :attr:`memory_peaks` per rank after every segment, ``peak_tensor_bytes`` per
    stage in the metrics; ``compiled.memory_check(trainer)`` holds them against the plan.

    The training loop practitioners expect (README, "The training loop practitioners expect"):
    an optimizer factory with a ``names`` parameter gets the model's names of its tensors
    (:mod:`fxpipe.runtime.training.param_names`); ``clip_grad_norm`` clips by norm
    (:mod:`fxpipe.runtime.replica.clipping`: the whole model's norm for 1f1b-flush and gpipe, each
    stage's own for pipedream and 2bw); ``precision="bf16"`` runs forwards under autocast
    (:mod:`fxpipe.runtime.replica.precision`); ``master_weights`` (None: on exactly for
    float16/bfloat16 parameters) steps float32 masters of low-precision parameters
    (:mod:`fxpipe.runtime.replica.master`); ``precision="fp16"`` adds dynamic loss scaling
    (:mod:`fxpipe.runtime.replica.loss_scale`, ``loss_scaler``: GradScaler's keywords; flushing
    schedules only); ``recompute`` (True or one bool per stage) recomputes
    activations in the backward; ``metrics_path``/``metrics_every``/``tensorboard_dir`` write
    metrics (:mod:`fxpipe.runtime.training.metrics`); ``prefetch`` reads that many minibatches ahead
    in a thread (:mod:`fxpipe.runtime.training.prefetch`). ``replan`` (made by
    ``CompiledModel.trainer( replan="auto", replan_threshold=0.05)``): switch to a re-solved plan at
    a segment boundary when the measured stage times predict it faster
    (:mod:`fxpipe.runtime.training.trainer_switch`).

    ``noam``: the minibatches in flight at the input stage of ``pipedream`` and ``2bw``: by
    default (None, or "auto") the fewest that hide the plan's communication round trips within
    its memory (from ``compiled.trainer``: :func:`fxpipe.runtime.pricing.plansim.noam_for`;
    PipeDream's NOAM where the links are fast, and for a Trainer built without a plan);
    "pipedream" for PipeDream's NOAM whatever the links; or a number.

    Cutting minibatches (``auto`` on 2+ stages, or ``split=k`` with a flushing kind named
    without ``microbatches``): each loader minibatch becomes k microbatches and one update, equal
    to plain PyTorch's step on the whole minibatch (:mod:`.trainer_cut`: batch dimensions from
    the graph, ``input_batch_dims``, or stated as ``batch_dims=(inputs_dims, target_dims)``; the
    loss's reduction tested on the first minibatch). ``on_recipe(text)`` receives what fit
    trains (:meth:`recipe`).
    """

    def __init__(self, stages: Sequence[StageSpec], replicas: Sequence[int], loss_fn: LossFn,
                 optimizer: OptimizerFactory, *,
                 schedule: ScheduleConfig | str | None = None, data: DataConfig | None = None,
                 checkpoint: CheckpointConfig | None = None,
                 precision: PrecisionConfig | str | None = None,
                 metrics: MetricsConfig | None = None, run: RunConfig | None = None,
                 lr_scheduler: LrSchedulerConfig | Callable[[torch.optim.Optimizer], Any]
                 | None = None,
                 replan: Replanner | None = None, **aliases: Any) -> None:
        """The sections (:mod:`.config`) configure it; ``aliases``: the flat keywords of
        earlier releases (``checkpoint_dir=``, ``executor=`` ...), kept for one release."""
        options = flat_options({"schedule": schedule, "data": data, "checkpoint": checkpoint,
                                "precision": precision, "metrics": metrics, "run": run,
                                "lr_scheduler": lr_scheduler}, aliases)
        bad = sorted(k for k in options if k.startswith("replan"))
        if bad:
            raise RuntimeConfigError(f"{', '.join(bad)} on a bare Trainer",
                                     "re-planning needs the compiled model: "
                                     "compiled.trainer(replan=fxpipe.ReplanConfig())")
        self._setup(stages, replicas, loss_fn, optimizer, replan=replan, **options)

    def _setup(self, stages: Sequence[StageSpec], replicas: Sequence[int], loss_fn: LossFn,
               optimizer: OptimizerFactory, *,
               lr_scheduler: Callable[[torch.optim.Optimizer], Any] | None = None,
               lr_scheduler_interval: str = "step",
               schedule: str = "pipedream", vertical_sync: bool = False,
               microbatches: int | None = None, checkpoint_dir: str | None = None,
               checkpoint_every: int | None = None, keep_checkpoints: int | None = KEEP,
               overwrite_checkpoints: bool = False,
               segment: int | None = None, executor: str = "distributed",
               timeout_s: float = 60.0, data_timeout_s: float = 600.0, seed: int = 0,
               device: str | None = None, progress: bool = True, stashing: bool = True,
               on_checkpoint: Callable[[int, int], None] | None = None,
               timeline: bool = False,
               fingerprint: str | None = None,
               state_keys: Mapping[str, tuple[int, str] | torch.Tensor] | None = None,
               auto_options: AutoOptions | Mapping[str, Any] | None = None,
               clip_grad_norm: float | None = None, precision: str = "fp32",
               recompute: bool | Sequence[bool] | None = None,
               metrics_path: str | None = None, metrics_every: int = 1,
               tensorboard_dir: str | None = None, prefetch: int = 0,
               master_weights: bool | None = None,
               loss_scaler: Mapping[str, Any] | None = None,
               replan: Replanner | None = None, split: int | None = None,
               batch_dims: Any = None, input_batch_dims: BatchDims | None = None,
               on_recipe: Callable[[str], None] | None = None,
               noam: int | str | None = None, measure_memory: bool = False,
               average_every: int | None = None, shard: str | None = None) -> None:
        if loss_fn is None:
            raise RuntimeConfigError("no loss function", "pass loss_fn= to fxpipe.compile")
        check_loss_fn(loss_fn)
        spec = parse_schedule(schedule)  # a kind, "pipedream+<mitigations>" or "auto"
        if spec.kind == AUTO and vertical_sync:
            raise RuntimeConfigError("vertical_sync=True with schedule='auto'",
                                     "name the schedule: schedule='pipedream', vertical_sync=True")
        if executor not in ("distributed", "reference"):
            raise RuntimeConfigError(f"unknown executor {executor!r}",
                                     "use 'distributed' (torchrun) or 'reference' (one process)")
        if lr_scheduler_interval not in LR_INTERVALS:
            raise RuntimeConfigError(f"lr_scheduler_interval={lr_scheduler_interval!r}",
                                     f"use one of {LR_INTERVALS}")
        for name, v in (("checkpoint_every", checkpoint_every), ("segment", segment)):
            if v is not None and (not isinstance(v, int) or v < 1):
                raise RuntimeConfigError(f"{name}={v!r}", "use a positive number of minibatches")
        if checkpoint_every is not None and checkpoint_dir is None:
            raise RuntimeConfigError("checkpoint_every without checkpoint_dir",
                                     "pass checkpoint_dir='ckpt/'")
        if keep_checkpoints is not None and (not isinstance(keep_checkpoints, int)
                                             or isinstance(keep_checkpoints, bool)
                                             or keep_checkpoints < 1):
            raise RuntimeConfigError(f"keep_checkpoints={keep_checkpoints!r}",
                                     "keep a positive number of the newest checkpoints, or None "
                                     "to keep them all")
        if checkpoint_dir is not None:
            check_directory(checkpoint_dir)  # a file, or unwritable: not at the first save
        self.stages, self.replicas = list(stages), list(replicas)
        check_stages(self.stages, self.replicas)
        shard = check_shard(shard)  # "never" is None
        self.average_every = check_local_sgd(spec.kind, self.replicas, average_every,
                                             clip_grad_norm, precision, microbatches, split,
                                             shard)
        self.microbatches, self._segment_args = microbatches, (segment, checkpoint_every)
        self.split = check_split(split, spec.kind, microbatches)  # microbatches per minibatch
        self.batch_dims, self.input_batch_dims = batch_dims, input_batch_dims  # trainer_cut
        self.cut_spec, self.loss_rule, self.on_recipe = None, None, on_recipe
        self._bn_warned, self._bns, self._probe_size, self._share = False, None, 0, []
        self._first_checked = False  # the loader's first minibatch (trainer_cut._check_first)
        io = self.stages[0].io if self.stages else None
        self.model_args: tuple[str, ...] = tuple(io.arg_names) if io is not None else ()
        self.user_loss_fn, loss_fn = loss_fn, WeightedLoss(loss_fn)  # scales ride with targets
        self.options = StepOptions.make(len(self.stages), clip_grad_norm=clip_grad_norm,
                                        precision=precision, recompute=recompute,
                                        master_weights=master_weights,
                                        loss_scaler=loss_scaler, shard=shard)
        self.options.check_kind(spec.kind)  # fp16: a flushing schedule, named
        self._noam_spec = check_noam(noam, spec.kind)  # trainer_schedule
        optimizer = wrap_factory(as_factory(optimizer), self.stages,  # `names=` (param_names)
                                 state_keys)
        self._set_segments(spec.kind)
        self.loss_fn, self.kind, self.vertical_sync = loss_fn, spec.kind, vertical_sync
        self.schedule_name, self.mitigation = spec.name, spec.mitigation
        self.optimizer, self.stashing, self._lr_scheduler = optimizer, stashing, lr_scheduler
        self.auto_options = AutoOptions.make(auto_options)
        if shard is not None and (replan is not None or (
                spec.kind == AUTO and self.auto_options.where == "pipeline")):
            raise RuntimeConfigError(
                "shard='optimizer' with " + ("re-planning" if replan is not None else
                                             "auto's pilot on the pipeline (where='pipeline')"),
                "both carry each replica's whole optimizer state from one pipeline to the next, "
                "which a shard is not: train sharded without them")
        self._noams: dict[str, int | None] = {}
        self.auto_decision: Decision | None = None  # what schedule="auto" chose, and why
        self._schedules: dict[int, Schedule] = {}
        self._stream = None  # the running stretch of an asynchronous kind (trainer_schedule)
        self._shares: dict[int, float] = {}  # minibatch -> its weight in the logged loss
        self._acc, self._dt = [0.0, 0.0, 0.0, 0.0], 0.0  # the epoch's sums; a segment's seconds
        self._samples = 0  # the segment's samples (trainer_cut)
        self._sizes_read: list[int] = []  # and each minibatch's (trainer_cut._lead)
        self.harm: str | None = None  # why this plan is slower than one worker (trainer_schedule)
        self.harm_ratio: float | None = None  # and by how much: segment time / one worker's
        self._harm_segments = 0
        self._harm_streak: list[float] = []  # ratios of the slow segments in a row
        # the compiled profile one worker's time is read from (kept across re-plans, whose
        # rescaled profiles time the split run's microbatches: trainer_schedule)
        self._one_worker_profile = self.auto_options.profile
        self._check_tied_cadence()  # before any process group: a clear error, not a hang
        self.checkpoint_dir, self.checkpoint_every = checkpoint_dir, checkpoint_every
        self.keep_checkpoints, self.seed, self.progress = keep_checkpoints, seed, progress
        self.overwrite_checkpoints = overwrite_checkpoints
        self._own_checkpoints = False  # this trainer has written checkpoint_dir's checkpoints
        self.on_checkpoint, self.fingerprint = on_checkpoint, fingerprint
        self.state_keys = dict(state_keys) if state_keys is not None else None
        self.history: History = []
        self._wire_cache: dict[Any, Any] = {}
        check_placed_executor(spec.kind, executor)
        # auto: 1f1b-flush until fit() chooses; the placed kinds have 1f1b-flush's semantics
        kind = "1f1b-flush" if spec.kind in (AUTO,) + PLACED_KINDS else spec.kind
        empty = Schedule(kind, tuple(self.replicas), 0, {r: () for r in
                         ((s, j) for s, n in enumerate(self.replicas) for j in range(n))})
        mitigated = dict(mitigation=spec.mitigation, delays=own_delays(
            kind, self.replicas, vertical_sync=vertical_sync, microbatches=self._per_update(),
            noam=self._noam(kind)))
        if executor == "reference" and timeline:
            raise RuntimeConfigError("timeline=True needs executor='distributed'",
                                     "the reference executor is the oracle, not a timing")
        if executor == "reference" and measure_memory:
            raise RuntimeConfigError("measure_memory=True needs executor='distributed'",
                                     "every rank of the reference executor shares one process: "
                                     "train with torchrun to measure each rank's memory")
        job = surplus_rank() if executor == "distributed" else None
        if executor == "reference":
            self.backend: Any = ReferenceBackend(self.stages, self.replicas, loss_fn, optimizer,
                                                 empty, stashing=stashing, options=self.options,
                                                 **mitigated)
        elif job is not None and job[0] >= len(empty.ranks):
            self.backend = IdleBackend(job[0], job[1], len(empty.ranks))
        else:
            self.backend = DistributedBackend(self.stages, self.replicas, loss_fn, optimizer,
                                              empty, stashing=stashing, timeout_s=timeout_s,
                                              data_timeout_s=data_timeout_s, timeline=timeline,
                                              device=device, options=self.options,
                                              measure_memory=measure_memory, **mitigated)
        self.idle = isinstance(self.backend, IdleBackend)
        if job is not None and job[0] == 0 and job[1] > len(empty.ranks):
            log.warning("the plan uses %d of the job's %d processes: more are not faster here "
                        "(compiled.summary() says why); %s idle", len(empty.ranks), job[1],
                        ranks_text(len(empty.ranks), job[1] - 1))
        self.replanner = replan.bind(self) if replan is not None else None  # trainer_switch
        self.local: dict[tuple[int, int], StageReplica] = self.backend.local
        self.lr_interval = lr_scheduler_interval
        self.schedulers = {r: lr_scheduler(w.stash.optimizer) for r, w in self.local.items()
                           if lr_scheduler is not None and w.stash.optimizer is not None}
        if lr_scheduler_interval == "step":
            for r, sch in self.schedulers.items():
                self.local[r].on_update = sch.step
        last = len(self.stages) - 1
        ref = executor == "reference"
        mine = {s for s, _ in self.local}
        self.index = self.backend.index
        self.need_inputs = ref or self.index == 0 or any(
            MODEL in self.stages[s].sources for s in mine)
        self.need_targets = ref or last in mine
        self.metrics = MetricsLog(metrics_path, metrics_every, tensorboard_dir, len(self.stages),
                                  write=self.index == 0 and not self.idle)
        self._busy_seen: dict[tuple[int, int], float] = {}
        self.memory_peaks: dict[tuple[int, int], int] = {}  # measure_memory (trainer_results)
        self._look_at: int | None = None  # auto on the pipeline: a second look (auto_look)
        if not isinstance(prefetch, int) or isinstance(prefetch, bool) or prefetch < 0:
            raise RuntimeConfigError(f"prefetch={prefetch!r}", "use 0 (no reading ahead) or a "
                                     "positive number of minibatches")
        self.prefetch = prefetch  # minibatches read ahead by a thread (training/prefetch.py)

    # ------------------------------------------------------------------ training
    def fit(self, train_loader: Iterable[Any], epochs: int = 1,
            eval_loader: Iterable[Any] | None = None, resume: bool = False) -> History:
        """Train for ``epochs`` (counting from 0, so resuming a 3-epoch run with epochs=3 only
        finishes it); returns the per-epoch history, also in ``self.history``."""
        if self.idle:
            return self.history
        # no train() here: as a plain PyTorch loop, training runs in the modes the user's modules
        # are in (a BatchNorm put in eval() keeps its frozen statistics); evaluation switches to
        # eval mode itself and gives the modes back (StageReplica.evaluate)
        self._fit(train_loader, epochs, eval_loader, resume)
        return self.history

    def _fit(self, train_loader: Iterable[Any], epochs: int, eval_loader: Iterable[Any] | None,
             resume: bool) -> None:
        epoch0, pos0, partial = 0, 0, [0.0, 0.0, 0.0, 0.0]
        if self.checkpoint_dir is not None and not resume:
            self._claim_checkpoint_dir()  # another run's checkpoints: refused, or cleared
        if self.kind == AUTO:
            resolved = resolve_auto(self, train_loader, resume, epochs)
            self.auto_decision, self._look_at = resolved.decision, resolved.look_at
            if resolved.decision.continued:  # decided on the pipeline: its winner trained it
                epoch0, pos0, partial = 0, resolved.decision.continued, list(resolved.acc)
        told = False
        if resume:
            epoch0, pos0, partial = self._resume()
            self._own_checkpoints = True  # that run goes on here: its checkpoints are ours
            if epoch0 >= epochs and self.index == 0:
                log.warning("nothing left to train: the checkpoint resumed is at the end of epoch "
                            "%d, and fit was asked for %d epoch(s) in all; pass more epochs to "
                            "train on", epoch0, epochs)
        if isinstance(train_loader, Iterator) and epochs - epoch0 > 1:
            raise RuntimeConfigError(
                f"{epochs - epoch0} epochs from an iterator ({type(train_loader).__name__}), "
                "which can be read once: every epoch after the first would train nothing",
                "pass a list or a DataLoader (re-iterable), or train one epoch per fit call "
                "with a fresh iterator each time")
        total = len(train_loader) if hasattr(train_loader, "__len__") else None  # type: ignore
        for epoch in range(epoch0, epochs):
            pos = pos0 if epoch == epoch0 else 0
            self._acc = list(partial) if epoch == epoch0 else [0.0, 0.0, 0.0, 0.0]
            it = PartStream(train_loader, epoch, self.seed, need_inputs=self.need_inputs,
                            need_targets=self.need_targets, start=pos, expects=self.model_args,
                            prefetch=self.prefetch if self.need_inputs or self.need_targets
                            else 0)
            bar = Progress(f"epoch {epoch + 1}/{epochs}", total, pos,
                           enabled=self.progress and self.index == 0)
            try:
                while True:
                    want = self._segment_at(pos)
                    parts, n = self._lead(it, want, f"epoch {epoch} segment at {pos}")
                    if not told:  # what trains, once the cut is known (trainer_cut)
                        told = self._tell()
                    if n == 0:
                        break
                    final = n < want or self._drain_due(pos + n)  # trainer_schedule
                    self._train_segment(parts, epoch, pos, n, final)
                    del parts  # one segment's minibatches in memory at a time
                    pos += n
                    bar.update(n, self._acc[0] / max(self._acc[1], 1),
                               self._acc[2] / max(self._acc[3], 1e-9))
                    if n < want:
                        break
                    if self._look_at is not None and epoch == 0 and pos >= self._look_at:
                        self._look_at = None  # once: race the pick against flush (auto_look)
                        it.close()
                        done, self._acc, self.auto_decision = look_again(  # set with _look_at
                            self, train_loader, epoch, pos, self.auto_options, self.auto_decision)
                        bar.update(done - pos, self._acc[0] / max(self._acc[1], 1),
                                   self._acc[2] / max(self._acc[3], 1e-9))
                        pos = done
                        it = PartStream(train_loader, epoch, self.seed,
                                        need_inputs=self.need_inputs,
                                        need_targets=self.need_targets, start=pos,
                                        prefetch=self.prefetch if self.need_inputs
                                        or self.need_targets else 0)
                        continue  # the race's segments were not fit's: no re-plan from them
                    if self.checkpoint_every and pos % self.checkpoint_every == 0:
                        self._checkpoint(epoch, pos, self._acc)
                    if self.replanner is not None:  # may switch plans here (trainer_switch)
                        it = self.replanner.after_segment(self, it, train_loader, epoch, pos, n,
                                                          self._dt)
                        if self.idle:  # re-planned onto fewer workers without this rank
                            return
                self.drain(epoch)  # the epoch's last minibatches finish (trainer_schedule)
            finally:
                it.close()
                bar.close()
            acc = self._acc
            if self.lr_interval == "epoch":
                for sch in self.schedulers.values():
                    sch.step()
            entry = {"epoch": float(epoch + 1), "loss": acc[0] / max(acc[1], 1),
                     "samples": acc[2], "time_s": acc[3],
                     "samples_per_s": acc[2] / acc[3] if acc[3] > 0 else 0.0}
            if eval_loader is not None:
                entry.update(self.evaluate(eval_loader))
                self.metrics.evaluation(epoch, {k: v for k, v in entry.items()
                                                if k.startswith("eval_")})
            self.history.append(entry)
            log.info("epoch %d: %s", epoch + 1, ", ".join(f"{k} {v:.4g}" for k, v in entry.items()))
            if self.checkpoint_dir is not None:
                self._checkpoint(epoch + 1, 0, [0.0, 0.0, 0.0, 0.0])
        self._write_back()

    def _claim_checkpoint_dir(self) -> None:
        """Before training without ``resume``: a ``checkpoint_dir`` holding checkpoints this
        trainer did not write is another run's. Refused (a later resume would pick whichever is
        newest of both runs), unless ``overwrite_checkpoints``, which deletes them first. Rank
        0 decides for all."""
        verdict = None
        if self.index == 0 and not self._own_checkpoints:
            found = ckpt.existing_run(self.checkpoint_dir)
            if found is not None and not self.overwrite_checkpoints:
                verdict = (f"checkpoint_dir={self.checkpoint_dir!r} holds another run's "
                           f"checkpoints ({found}), and fit was not asked to resume")
            elif found is not None:
                ckpt.clear(self.checkpoint_dir)
                log.warning("deleted the checkpoints in %s (%s): overwrite_checkpoints=True",
                            self.checkpoint_dir, found)
        verdict = self.backend.broadcast(verdict, "checkpoint directory")
        if verdict is not None:
            raise ckpt.CheckpointError(verdict, "continue that run with fit(..., resume=True), "
                                       "pass another checkpoint_dir, or overwrite_checkpoints="
                                       "True to delete them and start afresh")
        self._own_checkpoints = True

    def evaluate(self, loader: Iterable[Any]) -> dict[str, float]:
        """The loss of the latest weights over the whole of ``loader``, a mean over its samples
        (over its valid labels for a token-mean loss; a sum loss's sum per sample), as plain
        per-sample evaluation gives it, so a short last minibatch weighs by its samples; and the
        top-1 accuracy for classification. Computed on the output stage, shared with every
        rank."""
        if self.idle:
            return {}
        it = PartStream(loader, 0, self.seed, need_inputs=self.need_inputs,
                        need_targets=self.need_targets, expects=self.model_args)
        total = [0.0] * 4
        while True:
            parts, n = self._lead(it, _EVAL_CHUNK, "evaluation", split=False)
            if n == 0:
                break
            parts = self._counted(parts, self._sizes_read)
            total = [a + b for a, b in zip(total, self.backend.evaluate(parts, self._wire))]
            if n < _EVAL_CHUNK:
                break
        total = self.backend.all_sum(total, "evaluation metrics")
        out = {"eval_loss": total[0] / max(total[1], 1)}
        if total[3] > 0:
            out["eval_accuracy"] = total[2] / total[3]
        return out

    def close(self) -> None:
        """Leave the process group (distributed): call once training is over."""
        self.metrics.close()
        self.backend.close()


def make_trainer(compiled: Any, **kwargs: Any) -> Trainer:
    """``CompiledModel.trainer(**kwargs)``: a Trainer for the compiled plan and stages."""
    loss_fn = kwargs.pop("loss_fn", None) or compiled.loss_fn
    if loss_fn is None:
        raise RuntimeConfigError("this model was compiled without loss_fn",
                                 "pass loss_fn=... to fxpipe.compile or to trainer()")
    own = compiled.model.state_dict()
    keys = {k: own[k] if where is None else where
            for k, where in compiled.state_locations().items()}
    kwargs.setdefault("schedule", "auto")  # the default for a compiled model: see training/auto.py
    temporaries = (0.0, 0.0)  # the optimizer step's, held against a cap with the rest
    if compiled.plan.cluster.get("memory") is not None:
        temporaries = temporaries_for(compiled.traced.gm.parameters(), kwargs.get("optimizer"),
                                      compiled.plan.cluster.get("device"),
                                      kwargs.get("master_weights"))
    replicas = list(compiled.plan.replicas)
    if parse_schedule(kwargs["schedule"]).kind == LOCALSGD:  # copies of the plan's stages
        replicas = local_sgd_replicas(len(replicas), compiled.plan.cluster.get("workers"))
    else:
        check_schedule_memory(compiled.plan, compiled.profile, kwargs["schedule"],
                              kwargs.get("microbatches"), kwargs.get("split"), temporaries)
    report = lambda d: setattr(compiled, "auto_decision", d)  # noqa: E731 - shown by summary()
    auto = {"plan": compiled.plan, "profile": compiled.profile, "report": report,
            "temporaries": temporaries, **AutoOptions.given(kwargs.pop("auto_options", None))}
    if kwargs["schedule"] == "auto":  # only candidates whose memory the plan fits
        auto["candidates"] = fitting_candidates(
            compiled.plan, compiled.profile, auto.get("candidates", DEFAULT_CANDIDATES),
            kwargs.get("microbatches"), kwargs.get("split"), temporaries)
    replan = make_replanner(compiled, kwargs)  # replan="auto": issue 13 (trainer_switch)
    if replan is not None:
        replan.kwargs.update(loss_fn=loss_fn, auto_options=auto)
    kwargs.setdefault("input_batch_dims", compiled.traced.batch_dims)  # tested at compile
    kwargs.setdefault("on_recipe", lambda text: setattr(compiled, "recipe", text))  # summary()
    return Trainer(compiled.stage_specs, replicas, loss_fn,
                   fingerprint=compiled.plan.model_fingerprint, state_keys=keys,
                   auto_options=auto, replan=replan, **kwargs)
