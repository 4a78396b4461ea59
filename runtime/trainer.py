"""The user-facing training loop: ``Trainer.fit(loader, epochs, eval_loader, resume)``.

    # train.py, launched by: torchrun --nproc-per-node 4 train.py
    compiled = fxpipe.compile(model, fxpipe.Cluster.from_env(), example_inputs=(x,), loss_fn=...)
    trainer = compiled.trainer(optimizer=lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
                               checkpoint_dir="ckpt/", checkpoint_every=100)
    history = trainer.fit(loader, epochs=3, eval_loader=val_loader, resume=True)

Every rank runs the same script; rank i is the i-th (stage, replica) in stage-major,
replica-minor order. Only ranks of stages that read model inputs keep inputs, only the output
stage keeps targets (see :mod:`fxpipe.runtime.data` for the loader contract).

**Segments and checkpoints.** Training proceeds in *segments* of ``segment`` minibatches (default:
``checkpoint_every``, else the whole epoch); each segment is one complete schedule, so the
pipeline drains at its end (for pipedream that costs a fill and drain per segment). A checkpoint
is taken only at a segment end, so it is a consistent cut: no minibatch is half-trained and no
stashed weight version is needed afterwards. Resuming from a checkpoint at position k replays
exactly the segments an uninterrupted run with the same settings performs after k, so it reaches
bit-identical parameters. Dropout is reproducible too: the global RNG of each rank is reseeded at
every segment start from ``(seed, epoch, position, rank)``, so no RNG state needs saving.

The LR scheduler (``lr_scheduler=lambda opt: ...``) is stepped once per epoch, on each stage's
own optimizer.
"""
from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch

from fxpipe.codegen.split import MODEL, StageSpec

from . import checkpoint as ckpt
from .data import Part, batch_size_of, derive_seed, iter_parts, take
from .errors import RuntimeConfigError
from .auto import AutoOptions, Decision
from .auto import resolve as resolve_auto
from .schedule import Schedule, make_schedule
from .schedule_spec import AUTO, parse_schedule
from .staleness import own_delays
from .stage import LossFn, StageReplica, check_stages
from .stash import OptimizerFactory
from .timeline import TimelineEvent
from .trainer_backends import DistributedBackend, ReferenceBackend
from .trainer_progress import Progress
from .wire import make_wire_plan

log = logging.getLogger(__name__)

History = list[dict[str, float]]
_EVAL_CHUNK = 64  # eval minibatches per broadcast from rank 0


class Trainer:
    """Trains the stages of a plan with a PipeDream schedule (see the module doc).

    ``stages``/``replicas``: the CompiledModel's ``stage_specs`` and ``plan.replicas``.
    ``optimizer``: ``params -> torch.optim.Optimizer`` (one per stage replica; a factory that
    also takes ``stage`` and ``delay`` keywords receives the stage index and its weight delay).
    ``schedule``: a kind (``pipedream``, ``1f1b-flush``, ``gpipe``, ``2bw``), ``pipedream`` with
    staleness mitigations (``"pipedream+predict"``, :mod:`fxpipe.runtime.mitigation`), or
    ``"auto"``: chosen at the start of :meth:`fit` by a pilot (:mod:`fxpipe.runtime.auto`,
    ``auto_options``), recorded in :attr:`auto_decision` (the default of
    ``CompiledModel.trainer``; this class defaults to ``pipedream``).
    ``executor``: "distributed" (this process is one torchrun rank) or "reference" (every rank
    in this process, deterministic: the oracle). ``on_checkpoint(epoch, minibatch)`` is called
    on every rank after a checkpoint is complete. ``timeline=True`` (distributed executor)
    records this rank's forwards, backwards, updates, sends, receives and all-reduces: one
    ``(events, background)`` pair per segment in :attr:`timelines`, in seconds since
    :attr:`timeline_origin` (a ``time.perf_counter()`` value).
    """

    def __init__(self, stages: Sequence[StageSpec], replicas: Sequence[int], loss_fn: LossFn,
                 optimizer: OptimizerFactory, *,
                 lr_scheduler: Callable[[torch.optim.Optimizer], Any] | None = None,
                 schedule: str = "pipedream", vertical_sync: bool = False,
                 microbatches: int | None = None, checkpoint_dir: str | None = None,
                 checkpoint_every: int | None = None, keep_checkpoints: int | None = None,
                 segment: int | None = None, executor: str = "distributed",
                 timeout_s: float = 60.0, seed: int = 0, device: str | None = None,
                 progress: bool = True, stashing: bool = True,
                 on_checkpoint: Callable[[int, int], None] | None = None,
                 timeline: bool = False,
                 fingerprint: str | None = None,
                 state_keys: Mapping[str, tuple[int, str] | torch.Tensor] | None = None,
                 auto_options: AutoOptions | Mapping[str, Any] | None = None) -> None:
        if loss_fn is None:
            raise RuntimeConfigError("no loss function", "pass loss_fn= to fxpipe.compile")
        spec = parse_schedule(schedule)  # a kind, "pipedream+<mitigations>" or "auto"
        if spec.kind == AUTO and vertical_sync:
            raise RuntimeConfigError("vertical_sync=True with schedule='auto'",
                                     "name the schedule: schedule='pipedream', vertical_sync=True")
        if executor not in ("distributed", "reference"):
            raise RuntimeConfigError(f"unknown executor {executor!r}",
                                     "use 'distributed' (torchrun) or 'reference' (one process)")
        for name, v in (("checkpoint_every", checkpoint_every), ("segment", segment)):
            if v is not None and (not isinstance(v, int) or v < 1):
                raise RuntimeConfigError(f"{name}={v!r}", "use a positive number of minibatches")
        if checkpoint_every is not None and checkpoint_dir is None:
            raise RuntimeConfigError("checkpoint_every without checkpoint_dir",
                                     "pass checkpoint_dir='ckpt/'")
        self.segment = segment or checkpoint_every
        if checkpoint_every and self.segment and checkpoint_every % self.segment:
            raise RuntimeConfigError(f"checkpoint_every={checkpoint_every} is not a multiple of "
                                     f"segment={self.segment}", "checkpoints happen only at "
                                     "segment ends (where the pipeline is drained)")
        self.stages, self.replicas = list(stages), list(replicas)
        check_stages(self.stages, self.replicas)
        self.loss_fn, self.kind, self.vertical_sync = loss_fn, spec.kind, vertical_sync
        self.schedule_name, self.mitigation = spec.name, spec.mitigation
        self.optimizer, self.stashing, self._lr_scheduler = optimizer, stashing, lr_scheduler
        self.auto_options = AutoOptions.make(auto_options)
        self.auto_decision: Decision | None = None  # what schedule="auto" chose, and why
        self.microbatches = microbatches
        self._schedules: dict[int, Schedule] = {}
        self.checkpoint_dir, self.checkpoint_every = checkpoint_dir, checkpoint_every
        self.keep_checkpoints, self.seed, self.progress = keep_checkpoints, seed, progress
        self.on_checkpoint, self.fingerprint = on_checkpoint, fingerprint
        self.state_keys = dict(state_keys) if state_keys is not None else None
        self.history: History = []
        for st in self.stages:
            st.gm.train()
        kind = "1f1b-flush" if spec.kind == AUTO else spec.kind  # auto: until fit() chooses
        empty = Schedule(kind, tuple(self.replicas), 0, {r: () for r in
                         ((s, j) for s, n in enumerate(self.replicas) for j in range(n))})
        mitigated = dict(mitigation=spec.mitigation, delays=own_delays(
            kind, self.replicas, vertical_sync=vertical_sync, microbatches=microbatches))
        if executor == "reference":
            if timeline:
                raise RuntimeConfigError("timeline=True needs executor='distributed'",
                                         "the reference executor is the oracle, not a timing")
            self.backend: Any = ReferenceBackend(self.stages, self.replicas, loss_fn, optimizer,
                                                 empty, stashing=stashing, **mitigated)
        else:
            self.backend = DistributedBackend(self.stages, self.replicas, loss_fn, optimizer,
                                              empty, stashing=stashing, timeout_s=timeout_s,
                                              timeline=timeline,
                                              device=device, **mitigated)
        self.local: dict[tuple[int, int], StageReplica] = self.backend.local
        self.schedulers = {r: lr_scheduler(w.stash.optimizer) for r, w in self.local.items()
                           if lr_scheduler is not None and w.stash.optimizer is not None}
        last = len(self.stages) - 1
        ref = executor == "reference"
        mine = {s for s, _ in self.local}
        self.index = self.backend.index
        self.need_inputs = ref or self.index == 0 or any(
            MODEL in self.stages[s].sources for s in mine)
        self.need_targets = ref or last in mine

    # ------------------------------------------------------------------ helpers
    def adopt(self, schedule: str) -> None:
        """Switch to ``schedule`` before training (what ``schedule="auto"`` chose): new stage
        replicas with the same initial weights, optimizers made for the new schedule's delays."""
        spec = parse_schedule(schedule)
        self.kind, self.schedule_name, self.mitigation = spec.kind, spec.name, spec.mitigation
        self._schedules.clear()
        self.backend.rebuild(self.optimizer, stashing=self.stashing, mitigation=spec.mitigation,
                             delays=own_delays(spec.kind, self.replicas,
                                               vertical_sync=self.vertical_sync,
                                               microbatches=self.microbatches))
        self.local = self.backend.local
        self.schedulers = {r: self._lr_scheduler(w.stash.optimizer) for r, w in self.local.items()
                           if self._lr_scheduler is not None and w.stash.optimizer is not None}

    def _schedule(self, n: int) -> Schedule:
        """The (validated) schedule of a segment of ``n`` minibatches, made once per length:
        every full segment of every epoch has the same one, and making it costs milliseconds,
        which on a small model is a visible share of an epoch."""
        sched = self._schedules.get(n)
        if sched is None:
            sched = make_schedule(self.kind, self.replicas, n, microbatches=self.microbatches)
            sched = self._schedules[n] = sched.with_vertical_sync() if self.vertical_sync else sched
        return sched

    def _lead(self, it: Any, n: int | None, what: str, wire: bool = True) -> tuple[list[Part], int]:
        """Rank 0 reads up to ``n`` minibatches and tells every rank how many (and their wire
        shapes); the others read the same number of their parts."""
        info = None
        if self.index == 0:
            parts = take(it, n if n is not None else math.inf)  # type: ignore[arg-type]
            plan = (make_wire_plan(self.stages, [p[0] for p in parts])
                    if wire and parts and isinstance(self.backend, DistributedBackend) else None)
            info = (len(parts), plan, sum(batch_size_of(p[0]) for p in parts))
        count, plan, samples = self.backend.broadcast(info, f"{what} size")
        if self.index != 0:
            parts = (take(it, count) if self.need_inputs or self.need_targets
                     else [(None, None)] * count)
            if len(parts) != count:
                raise RuntimeConfigError(f"rank {self.index} read {len(parts)} minibatches of "
                                         f"{what}, rank 0 read {count}", "the loader must yield "
                                         "the same minibatches on every rank (deterministic)")
        self._wire, self._samples = plan, samples
        return parts, count

    # ------------------------------------------------------------------ training
    def fit(self, train_loader: Iterable[Any], epochs: int = 1,
            eval_loader: Iterable[Any] | None = None, resume: bool = False) -> History:
        """Train for ``epochs`` (counting from 0, so resuming a 3-epoch run with epochs=3 only
        finishes it); returns the per-epoch history, also in ``self.history``."""
        epoch0, pos0, partial = 0, 0, [0.0, 0.0, 0.0, 0.0]
        if self.kind == AUTO:
            resolve_auto(self, train_loader, resume, epochs)
        if resume:
            epoch0, pos0, partial = self._resume()
        total = len(train_loader) if hasattr(train_loader, "__len__") else None  # type: ignore
        for epoch in range(epoch0, epochs):
            pos = pos0 if epoch == epoch0 else 0
            acc = list(partial) if epoch == epoch0 else [0.0, 0.0, 0.0, 0.0]
            it = iter_parts(train_loader, epoch, self.seed, need_inputs=self.need_inputs,
                            need_targets=self.need_targets, start=pos)
            bar = Progress(f"epoch {epoch + 1}/{epochs}", total, pos,
                           enabled=self.progress and self.index == 0)
            try:
                while True:
                    parts, n = self._lead(it, self.segment, f"epoch {epoch} segment at {pos}")
                    if n == 0:
                        break
                    torch.manual_seed(derive_seed(self.seed, epoch, pos, self.index))
                    t0 = time.perf_counter()
                    losses = self.backend.run_segment(self._schedule(n), parts, self._wire)
                    dt = time.perf_counter() - t0
                    got = self.backend.all_sum([sum(losses.values()), len(losses)], "loss sum")
                    acc = [acc[0] + got[0], acc[1] + got[1], acc[2] + self._samples, acc[3] + dt]
                    pos += n
                    bar.update(n, acc[0] / max(acc[1], 1), acc[2] / max(acc[3], 1e-9))
                    if self.segment is None or n < self.segment:
                        break
                    if self.checkpoint_every and pos % self.checkpoint_every == 0:
                        self._checkpoint(epoch, pos, acc)
            finally:
                bar.close()
            for sch in self.schedulers.values():
                sch.step()
            entry = {"epoch": float(epoch + 1), "loss": acc[0] / max(acc[1], 1),
                     "samples": acc[2], "time_s": acc[3],
                     "samples_per_s": acc[2] / acc[3] if acc[3] > 0 else 0.0}
            if eval_loader is not None:
                entry.update(self.evaluate(eval_loader))
            self.history.append(entry)
            log.info("epoch %d: %s", epoch + 1, ", ".join(f"{k} {v:.4g}" for k, v in entry.items()))
            if self.checkpoint_dir is not None:
                self._checkpoint(epoch + 1, 0, [0.0, 0.0, 0.0, 0.0])
        self._write_back()
        return self.history

    def evaluate(self, loader: Iterable[Any]) -> dict[str, float]:
        """Mean loss (and top-1 accuracy for classification) of the latest weights, computed on
        the output stage and shared with every rank."""
        it = iter_parts(loader, 0, self.seed, need_inputs=self.need_inputs,
                        need_targets=self.need_targets)
        total = [0.0] * 4
        while True:
            parts, n = self._lead(it, _EVAL_CHUNK, "evaluation")
            if n == 0:
                break
            total = [a + b for a, b in zip(total, self.backend.evaluate(parts, self._wire))]
            if n < _EVAL_CHUNK:
                break
        total = self.backend.all_sum(total, "evaluation metrics")
        out = {"eval_loss": total[0] / max(total[1], 1)}
        if total[3] > 0:
            out["eval_accuracy"] = total[2] / total[3]
        return out

    # ------------------------------------------------------------------ checkpoints
    def _stage_state(self, rank: tuple[int, int], epoch: int, pos: int) -> dict[str, Any]:
        w = self.local[rank]
        opt, sch = w.stash.optimizer, self.schedulers.get(rank)
        return {"weights": {n: t.detach().cpu() for n, t in w.stash.latest.items()},
                "buffers": {n: t.detach().cpu() for n, t in w.buffers.items()},
                "optimizer": opt.state_dict() if opt is not None else None,
                "lr_scheduler": sch.state_dict() if sch is not None else None,
                "position": [epoch, pos]}

    def _checkpoint(self, epoch: int, pos: int, acc: list[float]) -> None:
        assert self.checkpoint_dir is not None
        for rank in self.local:
            if rank[1] == 0:
                ckpt.save_stage(self.checkpoint_dir, epoch, pos, rank[0],
                                self._stage_state(rank, epoch, pos))
        self.backend.all_sum([0.0], "checkpoint barrier")  # every stage file exists now
        if self.index == 0:
            info = {"history": self.history, "partial": acc, "replicas": self.replicas,
                    "schedule": self.schedule_name, "segment": self.segment, "seed": self.seed,
                    "fingerprint": self.fingerprint}
            ckpt.write_manifest(self.checkpoint_dir, epoch, pos, len(self.stages), info)
            if self.keep_checkpoints:
                ckpt.prune(self.checkpoint_dir, self.keep_checkpoints, len(self.stages))
        self.backend.all_sum([0.0], "checkpoint manifest")
        if self.on_checkpoint is not None:
            self.on_checkpoint(epoch, pos)

    def _resume(self) -> tuple[int, int, list[float]]:
        """Load the newest checkpoint every stage finished (chosen by rank 0, for all)."""
        if self.checkpoint_dir is None:
            raise RuntimeConfigError("resume=True without checkpoint_dir",
                                     "pass the checkpoint_dir the run was saving to")
        choice: Any = None
        if self.index == 0:
            try:
                choice = str(ckpt.find_latest(self.checkpoint_dir, len(self.stages)).folder)
            except ckpt.CheckpointError as err:
                choice = err
        choice = self.backend.broadcast(choice, "checkpoint choice")
        if isinstance(choice, ckpt.CheckpointError):
            raise choice
        found = ckpt.check_folder(Path(choice), len(self.stages), verify=False)
        m = found.manifest
        if m.get("replicas") != self.replicas or (self.fingerprint and m.get("fingerprint")
                                                  not in (None, self.fingerprint)):
            raise ckpt.CheckpointError(f"{found.folder} was made for replicas {m.get('replicas')} "
                                       f"(model {m.get('fingerprint')}), this pipeline has "
                                       f"{self.replicas} (model {self.fingerprint})",
                                       "resume with the plan the checkpoint was trained with")
        if (m.get("segment"), m.get("schedule")) != (self.segment, self.schedule_name):
            log.warning("checkpoint was made with schedule %s and segment %s; resuming with %s "
                        "and %s will not reproduce the uninterrupted run exactly",
                        m.get("schedule"), m.get("segment"), self.schedule_name, self.segment)
        for rank, w in self.local.items():
            self._load_stage(rank, w, ckpt.load_stage(found, rank[0]))
        self.history = [dict(h) for h in m.get("history", [])]
        log.info("resumed from %s (epoch %d, minibatch %d)", found.folder, found.epoch,
                 found.minibatch)
        return found.epoch, found.minibatch, list(m.get("partial", [0.0] * 4))

    def _load_stage(self, rank: tuple[int, int], w: StageReplica, state: dict[str, Any]) -> None:
        for key, dst in (("weights", w.stash.latest), ("buffers", w.buffers)):
            src = state.get(key) or {}
            if set(src) != set(dst):
                raise ckpt.CheckpointError(f"stage {rank[0]}'s checkpoint has {key} "
                                           f"{sorted(src)[:4]}..., the stage has {sorted(dst)[:4]}",
                                           "the checkpoint was made for a different model")
            with torch.no_grad():
                for n, t in dst.items():
                    t.copy_(src[n])
        if w.stash.optimizer is not None and state.get("optimizer") is not None:
            w.stash.optimizer.load_state_dict(state["optimizer"])
        if rank in self.schedulers and state.get("lr_scheduler") is not None:
            self.schedulers[rank].load_state_dict(state["lr_scheduler"])

    # ------------------------------------------------------------------ results
    def _write_back(self) -> None:
        """Copy the trained weights into the stage GraphModules (the user's own Parameters when
        compiled in this process): all stages on rank 0, the own stage elsewhere."""
        mine = {r[0]: {"weights": {n: t.detach().cpu() for n, t in w.stash.latest.items()},
                       "buffers": {n: t.detach().cpu() for n, t in w.buffers.items()}}
                for r, w in self.local.items() if r[1] == 0}
        gathered = self.backend.gather(mine, "gathering trained weights")
        merged: dict[int, dict[str, Any]] = dict(mine)
        for part in gathered or []:
            merged.update(part)
        with torch.no_grad():
            for s, state in merged.items():
                gm = self.stages[s].gm
                for n, t in [*gm.named_parameters(), *gm.named_buffers()]:
                    src = state["weights"].get(n, state["buffers"].get(n))
                    if src is not None:
                        t.copy_(src)
        self._have = sorted(merged)

    @property
    def timelines(self) -> list[tuple[list[TimelineEvent], list[TimelineEvent]]]:
        """Per segment so far, this rank's (events, background) when ``timeline=True``."""
        return getattr(self.backend, "timelines", [])

    @property
    def timeline_origin(self) -> float:
        """The ``perf_counter()`` the timelines count from (the same clock on every process of
        one machine, so ranks on one machine line up)."""
        return self.backend.comm.recorder.t0

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Trained weights and buffers: every stage's on rank 0 (and in the reference executor),
        only this rank's stage on other ranks. With ``state_keys`` (a compiled model's trainer:
        the model's own ``state_dict`` keys -> (stage, name there), or the tensor itself for
        state no stage holds) exactly the model's keys, tied aliases included, so that
        ``model.load_state_dict(trainer.state_dict())`` takes it strictly; else each stage's
        own names."""
        have = getattr(self, "_have", range(len(self.stages)))
        states = {s: self.stages[s].gm.state_dict() for s in have}
        if self.state_keys is None:
            return {n: t.detach() for st in states.values() for n, t in st.items()}
        out: dict[str, torch.Tensor] = {}
        for key, where in self.state_keys.items():
            if isinstance(where, torch.Tensor):
                out[key] = where.detach()
            elif where[0] in states:
                out[key] = states[where[0]][where[1]].detach()
        return out

    def close(self) -> None:
        """Leave the process group (distributed): call once training is over."""
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
    kwargs.setdefault("schedule", "auto")  # the default for a compiled model: see runtime/auto.py
    report = lambda d: setattr(compiled, "auto_decision", d)  # noqa: E731 - shown by summary()
    auto = {"plan": compiled.plan, "profile": compiled.profile, "report": report,
            **dict(kwargs.pop("auto_options", None) or {})}
    return Trainer(compiled.stage_specs, compiled.plan.replicas, loss_fn,
                   fingerprint=compiled.plan.model_fingerprint, state_keys=keys,
                   auto_options=auto, **kwargs)
