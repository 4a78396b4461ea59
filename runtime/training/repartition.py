"""Resume a checkpoint under another plan of the same model: re-partition its state by name.

Stage files are keyed by the traced model's own parameter and buffer names, which do not depend
on the cuts, so each new stage finds weights, buffers, optimizer and LR-scheduler state and
masters in whichever old stage held them; a different model raises ``CheckpointError``."""
from __future__ import annotations

import copy
import logging
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from fxpipe.codegen.split import StageSpec

from . import checkpoint as ckpt

log = logging.getLogger(__name__)

OldName = tuple[int, str]  # (old stage, name in that stage's file)


def stage_layout(stages: Sequence[StageSpec]) -> dict[str, dict[str, list[str]]]:
    """Per stage, the names of its weights and buffers (what its checkpoint file holds): the
    manifest records it, so a resume knows the plan that wrote the checkpoint and which old
    stage file holds which name."""
    return {str(st.index): {"weights": [n for n, _ in st.gm.named_parameters()],
                            "buffers": [n for n, _ in st.gm.named_buffers()]} for st in stages}


def optimizer_names(opt: torch.optim.Optimizer | None, latest: dict[str, torch.Tensor]
                    ) -> list[str] | None:
    """The name of each index of ``opt.state_dict()`` (indices count the parameters of every
    group in order, as torch packs them). ``latest``: the tensors the optimizer steps, by name
    (a low-precision weight's float32 master under the weight's name)."""
    if opt is None:
        return None
    by_id = {id(t): n for n, t in latest.items()}
    return [by_id[id(p)] for g in opt.param_groups for p in g["params"]]


def canonical_names(stages: Sequence[StageSpec]) -> dict[str, str]:
    """Every name of every tensor the stages hold -> one name per tensor (the smallest of its
    names). The set of names of a tensor is the same under every plan of one traced model (each
    graph node lands in exactly one stage), so the map is plan-independent: a tied weight saved
    as ``wte.weight`` is found for a stage that holds it as ``lm_head.weight``."""
    names: dict[int, set[str]] = {}
    for st in stages:
        for n, t in [*st.gm.named_parameters(remove_duplicate=False),
                     *st.gm.named_buffers(remove_duplicate=False)]:
            names.setdefault(id(t), set()).add(n)
    return {n: min(group) for group in names.values() for n in group}


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                and a.shape == b.shape and bool(torch.equal(a.cpu(), b.cpu())))
    return bool(a == b)


@dataclass
class _OldStage:
    state: dict[str, Any]
    names: list[str]  # optimizer index -> name
    group_of: dict[int, int]  # optimizer index -> group index


class Repartition:
    """The state of a checkpoint, served to the stages of the plan resuming it.

    ``found``: the complete checkpoint (its manifest must carry a ``layout``). ``stages``: the
    resuming plan's stages (every stage, to resolve tied names). Old stage files are read only
    when a new stage needs a name they hold, each once."""

    def __init__(self, found: ckpt.Found, stages: Sequence[StageSpec]) -> None:
        layout = found.manifest.get("layout")
        if not isinstance(layout, dict):
            raise ckpt.CheckpointError(
                f"{found.folder} was written before checkpoints recorded their layout; it "
                f"resumes only under the plan that wrote it ({found.manifest.get('num_stages')} "
                f"stages, replicas {found.manifest.get('replicas')})",
                "resume with that plan, or start from scratch")
        self.found, self.canon = found, canonical_names(stages)
        self.where: dict[tuple[str, str], list[OldName]] = {}
        for s in sorted(layout, key=int):
            for kind in ("weights", "buffers"):
                for n in layout[s][kind]:
                    self.where.setdefault((kind, self.canon.get(n, n)), []).append((int(s), n))
        self._files: dict[int, _OldStage] = {}
        mine = {(kind, self.canon.get(n, n)) for st in stages for kind, items in
                (("weights", st.gm.named_parameters()), ("buffers", st.gm.named_buffers()))
                for n, _ in items}
        missing, extra = sorted(mine - set(self.where)), sorted(set(self.where) - mine)
        if missing or extra:
            raise ckpt.CheckpointError(
                f"{found.folder} holds a different model: this model's {len(missing)} tensor(s) "
                f"{[n for _, n in missing[:4]]} are not in it, its {len(extra)} tensor(s) "
                f"{[n for _, n in extra[:4]]} are not in this model",
                "resume with the model the checkpoint was trained with")

    def _old(self, s: int) -> _OldStage:
        if s not in self._files:
            state = ckpt.load_stage(self.found, s)
            opt = state.get("optimizer")
            names = state.get("optimizer_names")
            if opt is not None and names is None:
                raise ckpt.CheckpointError(
                    f"{self.found.stage_file(s)} does not record its optimizer's parameter "
                    "names (written by an older fxpipe)", "resume with the plan that wrote it")
            group_of = {i: g for g, grp in enumerate(opt["param_groups"]) for i in grp["params"]
                        } if opt is not None else {}
            self._files[s] = _OldStage(state, list(names or []), group_of)
        return self._files[s]

    def _find(self, kind: str, name: str) -> tuple[OldName, torch.Tensor]:
        for s, n in self.where[(kind, self.canon.get(name, name))]:  # lowest old stage first
            return (s, n), self._old(s).state[kind][n]
        raise AssertionError("checked in __init__")

    def state_for(self, stage: int, latest: dict[str, torch.Tensor],
                  buffers: dict[str, torch.Tensor], opt: torch.optim.Optimizer | None,
                  scheduler: Any | None,
                  masters: dict[str, torch.Tensor] | None = None) -> dict[str, Any]:
        """Stage ``stage``'s state in the shape :func:`.checkpoint.load_stage` returns, for a
        stage replica with these weights, buffers, optimizer and LR scheduler (their structure,
        not their values, decides what is built); ``masters``: the float32 masters the
        optimizer steps in place of low-precision weights (:mod:`.master`), by name."""
        out: dict[str, Any] = {"weights": {}, "buffers": {}}
        for kind, dst in (("weights", latest), ("buffers", buffers)):
            for n, t in dst.items():
                _, src = self._find(kind, n)
                if src.shape != t.shape:
                    raise ckpt.CheckpointError(
                        f"{n!r} has shape {tuple(src.shape)} in {self.found.folder}, "
                        f"{tuple(t.shape)} in stage {stage}",
                        "the checkpoint was made for a different model")
                out[kind][n] = src
        out["optimizer"], sources, olds = self._optimizer(stage, {**latest, **(masters or {})},
                                                          opt)
        out["lr_scheduler"] = self._scheduler(stage, scheduler, opt, sources, olds)
        out["masters"] = self._masters(latest)
        # one scaler state for all stages (fp16 runs take one global skip decision per update)
        out["loss_scaler"] = self._old(0).state.get("loss_scaler")
        return out

    def _masters(self, latest: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
        """The float32 master weights (runtime/replica/master.py) of this stage's parameters, by
        name, from the old stage that held each; None when the run kept none."""
        out: dict[str, torch.Tensor] = {}
        for n in latest:
            (s, old), _ = self._find("weights", n)
            m = (self._old(s).state.get("masters") or {}).get(old)
            if m is not None:
                out[n] = m
        return out or None

    def _optimizer(self, stage: int, latest: dict[str, torch.Tensor],
                   opt: torch.optim.Optimizer | None
                   ) -> tuple[dict[str, Any] | None, list[tuple[int, int]], set[int]]:
        """The new optimizer's state dict, per new group the (old stage, old group) its first
        parameter came from, and every old stage a parameter came from."""
        if opt is None:
            return None, [], set()
        by_id = {id(t): n for n, t in latest.items()}
        state: dict[int, Any] = {}
        groups: list[dict[str, Any]] = []
        sources: list[tuple[int, int]] = []
        contributing: set[int] = set()
        index = 0
        for g, group in enumerate(opt.param_groups):
            hyper: dict[str, Any] | None = None
            first: tuple[int, int] | None = None
            params = []
            for p in group["params"]:
                name = by_id[id(p)]
                (s, old_name), _ = self._find("weights", name)
                old = self._old(s)
                if old.state.get("optimizer") is None or old_name not in old.names:
                    raise ckpt.CheckpointError(
                        f"{name!r} is trained by stage {stage} but was not trained in "
                        f"{self.found.folder} (stage {s} had no optimizer state for it)",
                        "resume with the model and requires_grad settings it was trained with")
                i = old.names.index(old_name)
                contributing.add(s)
                old_opt = old.state["optimizer"]
                if i in old_opt["state"]:
                    state[index] = copy.deepcopy(old_opt["state"][i])
                og = old.group_of[i]
                h = {k: v for k, v in old_opt["param_groups"][og].items() if k != "params"}
                if hyper is None:
                    hyper, first = h, (s, og)
                elif h.keys() != hyper.keys() or not all(_same(h[k], hyper[k]) for k in h):
                    diff = sorted(k for k in h if k not in hyper or not _same(h[k], hyper[k]))
                    raise ckpt.CheckpointError(
                        f"stage {stage}'s parameter group {g} joins parameters whose optimizer "
                        f"settings differed in the checkpoint ({diff}, e.g. {name!r} from old "
                        f"stage {s})", "the stages updated on different LR schedules (pipedream "
                        "with replicas?): resume with a plan that keeps those stages apart")
                params.append(index)
                index += 1
            groups.append({**copy.deepcopy(hyper or {}), "params": params})
            sources.append(first if first is not None else (-1, -1))
        return {"state": state, "param_groups": groups}, sources, contributing

    def _scheduler(self, stage: int, scheduler: Any | None, opt: torch.optim.Optimizer | None,
                   sources: list[tuple[int, int]], contributing: set[int]
                   ) -> dict[str, Any] | None:
        """The new LR scheduler's state: counters from the old stages its parameters come from
        (they must be equal), per-group lists mapped through ``sources``."""
        if scheduler is None or opt is None or not sources:
            return None
        olds = {s: self._old(s).state.get("lr_scheduler") for s in sorted(contributing)}
        if any(v is None for v in olds.values()):
            raise ckpt.CheckpointError(f"stage {stage}'s LR scheduler has no saved state in "
                                       f"{self.found.folder}", "resume with the same lr_scheduler")
        base_stage = sources[0][0]
        base = olds[base_stage]
        n_old = {s: len(self._old(s).state["optimizer"]["param_groups"]) for s in olds}
        out: dict[str, Any] = {}
        for k, v in base.items():
            if isinstance(v, list) and len(v) == n_old[base_stage]:
                out[k] = [copy.deepcopy(olds[s][k][og]) for s, og in sources]
                continue
            for s, other in olds.items():
                if not _same(other.get(k), v):
                    raise ckpt.CheckpointError(
                        f"stage {stage} takes parameters from old stages {sorted(olds)} whose LR "
                        f"schedulers differ in {k!r} ({v!r} vs {other.get(k)!r})",
                        "the stages updated at different rates (pipedream with replicas?): "
                        "resume with a plan that keeps those stages apart")
            out[k] = copy.deepcopy(v)
        return out
