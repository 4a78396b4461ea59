"""fxpipe's split as torch.distributed.pipelining ``PipelineStage`` s (torch cannot split a model).

Skips ride through the stages between; tied gradients are summed by ``TorchStages.sync_tied_grads``.
``loop`` puts stage s on rank ``s % world``; ``v`` gives rank r stages r and ``2 * world - 1 - r``.
"""
from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage

from fxpipe.codegen.carry import CarryStage, carry_stages, model_inputs
from fxpipe.codegen.split import StageSpec

from ..errors import PeerError, RuntimeConfigError
from ..replica.stage import tied_parameters

log = logging.getLogger(__name__)

PLACEMENTS = ("loop", "v")


def stage_ranks(num_stages: int, world: int, placement: str = "loop") -> list[int]:
    """The rank of each stage under ``placement`` (docs/design-notes.md)."""
    if placement not in PLACEMENTS:
        raise RuntimeConfigError(f"unknown placement {placement!r}", f"use one of {PLACEMENTS}")
    if world < 1 or num_stages % world:
        raise RuntimeConfigError(f"{num_stages} stages do not divide among {world} ranks",
                                 "compile with stages = a multiple of the world size")
    if placement == "loop":
        return [s % world for s in range(num_stages)]
    if num_stages != 2 * world:
        raise RuntimeConfigError(f"placement 'v' needs 2 x {world} stages, the plan has "
                                 f"{num_stages}", f"compile with stages={2 * world}")
    return [s if s < world else 2 * world - 1 - s for s in range(num_stages)]


@dataclass
class TorchStages:
    """This rank's part of the pipeline: its ``PipelineStage`` s (pass them to a torch
    schedule), their modules, and the tied-weight groups it belongs to."""

    stages: list[PipelineStage]
    modules: list[CarryStage]
    input_names: tuple[str, ...]
    io: Any
    ties: list[tuple[Any, list[nn.Parameter], tuple[int, ...]]] = field(default_factory=list)
    timeout: timedelta = timedelta(seconds=60)

    @property
    def first(self) -> bool:
        """Holds stage 0 (the one a torch schedule feeds the model inputs)."""
        return any(st.is_first for st in self.stages)

    @property
    def last(self) -> bool:
        """Holds the last stage (where the loss is computed)."""
        return any(st.is_last for st in self.stages)

    def parameters(self) -> Iterator[nn.Parameter]:
        """This rank's parameters, each once (a weight two local stages share counts once)."""
        seen: set[int] = set()
        for m in self.modules:
            for p in m.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    yield p

    def inputs(self, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
        """The model's ``(*args, **kwargs)`` as stage 0's positional inputs."""
        bound = self.io.bind_inputs(args, kwargs)
        return tuple(bound[n] for n in self.input_names)

    def sync_tied_grads(self) -> None:
        """Sum each tied weight's gradient over every copy, this rank's and the other ranks'
        (call after ``schedule.step``, before ``optimizer.step``): every copy then steps with
        the gradient of all its uses, and the copies stay equal."""
        for group, copies, ranks in self.ties:
            total = torch.zeros_like(copies[0])
            for p in copies:
                if p.grad is not None:
                    total += p.grad
            if group is not None:
                try:
                    dist.all_reduce(total, group=group, async_op=True).wait(self.timeout)
                except RuntimeError as err:
                    raise PeerError(f"tied-weight all-reduce among ranks {list(ranks)} failed: "
                                    f"{err}", "another rank crashed or hung: look at its log"
                                    ) from err
            for p in copies:
                p.grad = total.clone()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's weights and buffers under the model's own names."""
        return {n: t.detach() for m in self.modules for n, t in m.stage.state_dict().items()}


def torch_stages(specs: Sequence[StageSpec], rank: int, world: int, *,
                 placement: str = "loop", device: torch.device | str | None = None,
                 group: Any = None, timeout_s: float = 60.0) -> TorchStages:
    """Build this rank's :class:`TorchStages` from fxpipe's stage specs (every rank must call
    it, in the same order as its peers: tied-weight groups are created collectively).

    The torch stages own copies of their weights (as they would in their own processes): the
    compiled model is left as it is. A weight several of this rank's stages use gets one copy per
    stage, because torch scales each stage's gradients by its microbatch count itself (a shared
    tensor would be scaled once per stage); :meth:`TorchStages.sync_tied_grads` sums the copies'
    gradients, locally and over the other ranks holding one, so they stay one parameter."""
    if not dist.is_initialized():
        raise RuntimeConfigError("torch.distributed is not initialised",
                                 "call dist.init_process_group (torchrun sets the environment)")
    owner = stage_ranks(len(specs), world, placement)
    dev = torch.device(device or "cpu")
    tied = tied_parameters(specs)  # by identity, before the copies below
    mine = [s for s, r in enumerate(owner) if r == rank]
    copies = {s: copy.deepcopy(specs[s]) for s in mine}  # separately: a copy per stage
    built = carry_stages([copies.get(s, st) for s, st in enumerate(specs)])
    modules = {s: built[s].to(dev) for s in mine}
    stages = [PipelineStage(modules[s], s, len(specs), dev, group=group) for s in mine]
    ties = []
    for t in tied:
        ranks = tuple(sorted({owner[s] for s in t.stages}))
        local = [copies[s].gm.get_parameter(t.names[s]) for s in t.stages if s in copies]
        pg = dist.new_group(list(ranks), timeout=timedelta(seconds=timeout_s)) \
            if len(ranks) > 1 else None
        if local:
            ties.append((pg, local, ranks))
    log.info("rank %d: torch stages %s of %d (%s placement), %d tied parameters", rank, mine,
             len(specs), placement, len(ties))
    return TorchStages(stages, [modules[s] for s in mine], model_inputs(specs), specs[0].io,
                       ties, timedelta(seconds=timeout_s))
