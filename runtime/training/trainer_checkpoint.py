"""The Trainer's checkpoints: save a consistent cut per stage, resume from the newest complete one.

A mixin of :class:`~.trainer.Trainer`. Taken only where the pipeline is drained: replica 0 of each
stage writes its stage (:mod:`.checkpoint`), then rank 0 the manifest. A checkpoint of another
plan resumes through :class:`~.repartition.Repartition`."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from ..errors import RuntimeConfigError
from ..execution.sharding import is_sharded
from ..replica.stage import StageReplica
from ..schedules.localsgd import LOCALSGD
from . import checkpoint as ckpt
from .repartition import Repartition, optimizer_names, stage_layout

log = logging.getLogger("fxpipe.runtime.training.trainer")

REPLICA_KEYS = ("optimizer", "optimizer_names", "lr_scheduler")
"""What a LocalSGD replica past the first saves of its own: its optimizer's and LR schedule's
state (a replica without a minibatch in a round steps neither); the replicas' weights and
buffers are equal at a checkpoint, which follows an average."""


class CheckpointMixin:
    """Checkpoint and resume methods of the Trainer (it provides the attributes used here)."""

    local: dict[tuple[int, int], StageReplica]
    schedulers: dict[tuple[int, int], Any]
    split: int
    backend: Any
    stages: list[Any]
    replicas: list[int]
    checkpoint_dir: str | None
    keep_checkpoints: int | None
    history: list[dict[str, float]]
    segment: int
    kind: str
    seed: int
    fingerprint: str | None
    index: int
    on_checkpoint: Any

    # ------------------------------------------------------------------ checkpoints
    def _stage_state(self, rank: tuple[int, int], epoch: int, pos: int) -> dict[str, Any]:
        w = self.local[rank]
        return {"weights": {n: t.detach().cpu() for n, t in w.stash.latest.items()},
                "buffers": {n: t.detach().cpu() for n, t in w.buffers.items()},
                "masters": w.stash.masters.state(),  # float32 masters (runtime/replica/master.py)
                "loss_scaler": w.scaler.state_dict() if w.scaler is not None else None,
                **self._replica_state(rank), "position": [epoch, pos]}

    def _replica_state(self, rank: tuple[int, int]) -> dict[str, Any]:
        """The :data:`REPLICA_KEYS` of ``rank``: its optimizer's and LR schedule's state."""
        w = self.local[rank]
        opt, sch = w.stash.optimizer, self.schedulers.get(rank)
        return {"optimizer": opt.state_dict() if opt is not None else None,
                "optimizer_names": optimizer_names(
                    opt, {**w.stash.latest, **w.stash.masters.master}),
                "lr_scheduler": sch.state_dict() if sch is not None else None}

    def _checkpoint(self, epoch: int, pos: int, acc: list[float]) -> None:
        assert self.checkpoint_dir is not None
        for w in self.local.values():  # ZeRO-1: the stage's shards gathered on replica 0
            if is_sharded(w.stash.optimizer):
                w.stash.optimizer.consolidate_state_dict(to=0)  # type: ignore[union-attr]
        for rank in self.local:
            if rank[1] == 0:
                ckpt.save_stage(self.checkpoint_dir, epoch, pos, rank[0],
                                self._stage_state(rank, epoch, pos))
            elif self.kind == LOCALSGD:  # replicas share weights here, not optimizer states
                ckpt.save_stage(self.checkpoint_dir, epoch, pos, rank[0],
                                self._replica_state(rank), replica=rank[1])
        self.backend.all_sum([0.0], "checkpoint barrier")  # every stage file exists now
        if self.index == 0:
            info = {"history": self.history, "partial": acc, "replicas": self.replicas,
                    "schedule": self.schedule_name, "segment": self.segment, "seed": self.seed,
                    "split": self.split,
                    "fingerprint": self.fingerprint, "layout": stage_layout(self.stages)}
            ckpt.write_manifest(self.checkpoint_dir, epoch, pos, len(self.stages), info,
                                replicas=self.replicas if self.kind == LOCALSGD else ())
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
                choice = str(ckpt.find_latest(self.checkpoint_dir, None).folder)
            except ckpt.CheckpointError as err:
                choice = err
        choice = self.backend.broadcast(choice, "checkpoint choice")
        if isinstance(choice, ckpt.CheckpointError):
            raise choice
        found = ckpt.check_folder(Path(choice), None, verify=False)
        m = found.manifest
        if self.fingerprint and m.get("fingerprint") not in (None, self.fingerprint):
            raise ckpt.CheckpointError(f"{found.folder} was made for model {m.get('fingerprint')}"
                                       f", this is model {self.fingerprint}",
                                       "the checkpoint was made for a different model: resume "
                                       "with the model it was trained with")
        made = (m.get("schedule"), m.get("segment"), m.get("split", 1))
        if made != (self.schedule_name, self.segment, self.split):
            log.warning("checkpoint was made with schedule %s, segment %s and %s microbatch(es) "
                        "per minibatch; resuming with %s, %s and %s will not reproduce the "
                        "uninterrupted run exactly", *made, self.schedule_name, self.segment,
                        self.split)
        if m.get("layout", stage_layout(self.stages)) == stage_layout(self.stages) \
                and m.get("num_stages") == len(self.stages) and (
                    "layout" in m or m.get("replicas") == self.replicas):
            for rank, w in self.local.items():  # the same stages: each loads its own file
                state = ckpt.load_stage(found, rank[0])
                own = ckpt.load_replica(found, *rank) if rank[1] else None
                self._load_stage(rank, w, state if own is None else {
                    **state, **{k: own[k] for k in REPLICA_KEYS}})
        else:
            log.info("re-partitioning checkpoint %s: %s stages, replicas %s -> %d stages, "
                     "replicas %s", found.folder.name, m.get("num_stages"), m.get("replicas"),
                     len(self.stages), self.replicas)
            source = Repartition(found, self.stages)
            for rank, w in self.local.items():
                self._load_stage(rank, w, source.state_for(
                    rank[0], w.stash.latest, w.buffers, w.stash.optimizer,
                    self.schedulers.get(rank), w.stash.masters.master))
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
                                           "the checkpoint was made for a different model "
                                           "(or, written without a layout by an older fxpipe, "
                                           "for another plan: it resumes only under the plan "
                                           "that wrote it)")
            with torch.no_grad():
                for n, t in dst.items():
                    t.copy_(src[n])
        w.stash.masters.load(state.get("masters"), w.stash.latest)
        if w.scaler is not None:
            if state.get("loss_scaler") is None:
                raise ckpt.CheckpointError(f"stage {rank[0]}'s checkpoint has no loss-scaler "
                                           "state (it was not trained with precision='fp16')",
                                           "resume with the precision the run was trained with")
            w.scaler.load_state_dict(state["loss_scaler"])
        if w.stash.optimizer is not None and state.get("optimizer") is not None:
            w.stash.optimizer.load_state_dict(state["optimizer"])
        if rank in self.schedulers and state.get("lr_scheduler") is not None:
            self.schedulers[rank].load_state_dict(state["lr_scheduler"])

