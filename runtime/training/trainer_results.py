"""Where a Trainer's results go: weights back into the stages, the model gathered on request.

A mixin of :class:`~.trainer.Trainer`: write-back, :meth:`ResultsMixin.state_dict`, the recorded
timelines, measured memory and metrics records. Nothing is gathered unless asked for."""
from __future__ import annotations

from typing import Any, Mapping

import torch

from fxpipe.costmodel import Cluster
from fxpipe.costmodel.profile import Profile
from fxpipe.passes.plan import Plan

from ..errors import RuntimeConfigError
from ..execution.trainer_backends import DistributedBackend
from ..pricing.replan import Proposal, StageTimes, propose
from ..replica.stage import StageReplica
from ..replica.state_size import temporaries_for
from ..timeline import TimelineEvent
from .memory_fit import walked_peaks
from .trainer_switch import measured_stage_times


class ResultsMixin:
    """Result methods of the Trainer (it provides the attributes declared here)."""

    stages: list[Any]
    local: dict[tuple[int, int], StageReplica]
    backend: Any
    idle: bool
    state_keys: Mapping[str, tuple[int, str] | torch.Tensor] | None
    replicas: list[int]
    metrics: Any
    _busy_seen: dict[tuple[int, int], float]
    memory_peaks: dict[tuple[int, int], int]
    optimizer: Any
    options: Any
    kind: str
    microbatches: int | None
    split: int
    auto_options: Any

    def _write_back(self) -> None:
        """Copy the trained weights into this process's stage GraphModules (the user's own
        Parameters when compiled in this process): every stage this rank trained, nothing
        more, and no communication (the whole model is gathered only when asked for)."""
        with torch.no_grad():
            for (s, _), w in sorted(self.local.items(), key=lambda kv: kv[0][1], reverse=True):
                gm = self.stages[s].gm  # replica 0 last: the one every checkpoint keeps
                for n, t in [*gm.named_parameters(), *gm.named_buffers()]:
                    src = w.stash.latest.get(n, w.buffers.get(n))
                    if src is not None:
                        t.copy_(src)

    def _busy(self) -> list[float]:
        """This rank's busy seconds per stage since the last call (mean over a stage's
        replicas once summed over the ranks)."""
        busy = [0.0] * len(self.stages)
        for r, w in self.local.items():
            busy[r[0]] += (w.busy_s - self._busy_seen.get(r, 0.0)) / self.replicas[r[0]]
            self._busy_seen[r] = w.busy_s
        return busy

    def _peak_slots(self) -> list[float]:
        """With ``measure_memory``: one slot per rank of the job, this rank's peak bytes of live
        tensors in its own (summed over the ranks, every rank learns every peak); else none."""
        memory = getattr(self.backend, "memory", None)
        if memory is None:
            return []
        slots = [0.0] * self.backend.world
        slots[self.backend.index] = float(memory.peak)  # exact: bytes < 2**53
        return slots

    def _note_peaks(self, got: list[float]) -> list[float]:
        """Take the ranks' peaks (:meth:`_peak_slots`) off the end of a segment's exchange into
        :attr:`memory_peaks`; the rest of it is returned."""
        keep = 2 + len(self.stages)
        rank_of = getattr(self.backend, "rank_of", None)
        if len(got) > keep and rank_of is not None:
            self.memory_peaks = {r: int(got[keep + i]) for r, i in rank_of.items()}
        return got[:keep]

    def measured_memory(self) -> list[int] | None:
        """Per stage, the largest peak bytes of live tensors among its replicas so far
        (``measure_memory=True``), or None when not measured."""
        if not self.memory_peaks:
            return None
        peaks = [0] * len(self.stages)
        for (s, _), b in self.memory_peaks.items():
            peaks[s] = max(peaks[s], b)
        return peaks

    @property
    def memory_parts(self) -> dict[int, dict[str, int]]:
        """This rank's measured peak by what made each tensor (held at the start, ``F``,
        ``B``, ``W``, ``U``, ``comm``), by stage; empty on CUDA or when not measured."""
        memory = getattr(self.backend, "memory", None)
        if memory is None or not memory.parts:
            return {}
        return {s: memory.parts for s, _ in self.local}

    def _record(self, epoch: int, n: int, got: list[float], dt: float, sched: Any) -> None:
        """One segment (schedule ``sched``, ``n`` minibatches) into the metrics log
        (:mod:`fxpipe.runtime.training.metrics`); ``got``: the segment's summed [loss sum,
        losses, busy seconds per stage...]; rank 0 writes."""
        busy = got[2:]
        updates = sum(a.kind == "U" for a in sched.actions[(0, 0)])
        first = self.local.get((0, 0))
        opt = first.stash.optimizer if first is not None else None
        lr = float(opt.param_groups[0]["lr"]) if opt is not None else None
        self.metrics.segment(epoch=epoch, updates=updates, loss_sum=got[0], losses=got[1],
                             minibatches=n, samples=self._samples, time_s=dt, busy=busy, lr=lr,
                             peak=self.measured_memory())

    def walked_peaks(self, plan: Plan, profile: Profile | None) -> tuple[Any, ...] | None:
        """Per stage of ``plan``, the peak walked through the schedule this trainer runs
        (:func:`~.memory_fit.walked_peaks`), its optimizer's step temporaries measured on
        stand-ins of the stages' parameters on the path torch takes on this rank's device."""
        device = getattr(self.backend, "device", None)  # CUDA: torch's foreach step
        temporaries = temporaries_for((p for st in self.stages for p in st.gm.parameters()),
                                      self.optimizer,
                                      str(device) if device is not None else None,
                                      self.options.master_weights)
        return walked_peaks(plan, profile, self.kind, self.microbatches, self.split,
                            temporaries)

    def measured_stage_times(self, skip: int = 0) -> list[StageTimes]:
        """Per stage, its measured times from every rank's timelines but the first ``skip``
        segments (:func:`~.trainer_switch.measured_stage_times`; ``timeline=True``). A
        collective: every rank calls it."""
        return measured_stage_times(self.timelines, [s for s, _ in self.local],
                                    len(self.stages), self.backend.exchange, skip=skip)

    def propose_replan(self, cluster: Cluster | None = None,
                       threshold: float = 0.05) -> Proposal:
        """A plan re-solved from this trainer's measured stage times (:meth:`measured_stage_times`)
        and the plan and profile its stages came from; what ``replan="auto"`` decides on, usable
        by hand. A collective: every rank calls it."""
        plan, profile = self.auto_options.plan, self.auto_options.profile
        if plan is None or profile is None:
            raise RuntimeConfigError("re-planning needs the plan and profile the stages came "
                                     "from", "make the trainer with CompiledModel.trainer(...)")
        return propose(profile, plan, self.measured_stage_times(),
                       cluster or Cluster.from_dict(dict(plan.cluster)), threshold=threshold)

    @property
    def timelines(self) -> list[tuple[list[TimelineEvent], list[TimelineEvent]]]:
        """Per segment so far, this rank's (events, background) when ``timeline=True``."""
        return getattr(self.backend, "timelines", [])

    @property
    def timeline_origin(self) -> float:
        """The ``perf_counter()`` the timelines count from (the same clock on every process of
        one machine, so ranks on one machine line up)."""
        return self.backend.comm.recorder.t0

    def state_dict(self, *, gather: bool = True) -> dict[str, torch.Tensor]:
        """Weights and buffers by the model's own names: with ``state_keys`` (a compiled model's
        trainer: the model's ``state_dict`` keys -> (stage, name there), or the tensor itself
        for state no stage holds) exactly the model's keys, tied aliases included, so that
        ``model.load_state_dict(trainer.state_dict())`` takes it strictly; else the stage
        GraphModules' names.

        With the distributed executor and ``gather=True`` (default) this is a COLLECTIVE: call
        it on every rank (a rank calling it alone waits ``data_timeout_s`` and fails naming a
        peer). Rank 0 then receives every stage's weights from replica 0 of that stage and
        returns the whole model; every other rank returns its own stage's entries. With
        ``gather=False`` each rank returns its own stage's entries without any communication
        (what a rank can save on its own). The reference executor and idle ranks never
        communicate: the former returns every stage, the latter nothing."""
        if self.idle:
            return {}
        mine = {s: {n: t.detach() for n, t in self.stages[s].gm.state_dict().items()}
                for s in sorted({s for s, _ in self.local})}
        if gather and isinstance(self.backend, DistributedBackend):
            shares = {s: {n: t.cpu() for n, t in sd.items()} for s, sd in mine.items()
                      if (s, 0) in self.local}
            got = self.backend.gather(shares, "state_dict() gathering every stage (call it on "
                                      "every rank)")
            for share in got or []:
                for s, sd in share.items():
                    mine.setdefault(s, sd)
        out: dict[str, torch.Tensor] = {}
        if self.state_keys is None:
            for s in sorted(mine):
                out.update(mine[s])
            return out
        for key, where in self.state_keys.items():
            if isinstance(where, torch.Tensor):
                out[key] = where.detach()
            elif where[0] in mine:
                out[key] = mine[where[0]][where[1]]
        return out
