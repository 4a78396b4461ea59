"""A replicated stage's optimizer state sharded over its replica group (ZeRO-1), on torch's engine.

Every replica of a stage holds the same weights and, after the replicas' gradient sum, the same
gradients; only the optimizer's state (Adam's two moments, momentum buffers) is split: torch's
``ZeroRedundancyOptimizer`` steps each replica's share of the parameters and broadcasts the new
values to the group, so the weights stay equal on every replica while each holds about 1/R of the
state. The arithmetic per parameter is the user's optimizer's, unchanged.
"""
from __future__ import annotations

import inspect
import logging
import sys
from typing import Any

import torch

from ..errors import RuntimeConfigError
from ..replica.stash import OptimizerFactory

log = logging.getLogger(__name__)

def sharded_factory(factory: OptimizerFactory, group: Any) -> OptimizerFactory:
    """``factory``'s optimizer, its state sharded over process group ``group`` (the stage's
    replicas): the factory's optimizer is made once to read its class, parameter groups and
    hyper-parameters (it holds no state before a step), then torch's
    ``ZeroRedundancyOptimizer`` with the same. Refuses an optimizer that is not one
    ``torch.optim`` class over its parameter groups (a composite recipe such as Muon + AdamW)."""

    def make(params: list[torch.Tensor]) -> torch.optim.Optimizer:
        # imported here: torch.distributed.optim costs most of a second, paid by every rank
        # and by the overhead probe's processes, which shard nothing
        from torch.distributed.optim import ZeroRedundancyOptimizer

        probe = factory(params)
        cls = type(probe)
        if cls.__module__.split(".")[:2] != ["torch", "optim"]:
            raise RuntimeConfigError(f"shard='optimizer' with optimizer {cls.__name__}",
                                     "sharding takes one torch.optim optimizer (SGD, Adam, "
                                     "AdamW, ...): use one, or train without shard")
        groups = [dict(g) for g in probe.param_groups]
        takes = inspect.signature(cls.__init__).parameters  # a group may hold more (AdamW's
        first = {k: v for k, v in groups[0].items()  # decoupled_weight_decay): its settings
                 if k != "params" and k in takes}
        zero = ZeroRedundancyOptimizer(groups[0]["params"], optimizer_class=cls,
                                       process_group=group, **first)
        for g in groups[1:]:
            zero.add_param_group(g)
        log.debug("optimizer %s sharded over %d replicas", cls.__name__, zero.world_size)
        return zero
    return make


def is_sharded(optimizer: Any) -> bool:
    zero = sys.modules.get("torch.distributed.optim")  # none made yet where not imported
    return zero is not None and isinstance(optimizer, zero.ZeroRedundancyOptimizer)
