"""The default trainer on a replicated plan under torchrun, for test_recipe_replicated_dist.py.

    torchrun --nproc-per-node N recipe_replicated_job.py OUT_DIR PLAN LOSS [LOSS ...]

PLAN is a name of ``test_recipe_replicated.PLANS`` (``[2]``, ``[2, 1]``, ``[1, 2]``: N is its
workers); each LOSS of ``LOSSES`` is compiled onto that plan on every rank and trained with
``compiled.trainer(optimizer=sgd)`` and nothing else named. Rank 0 writes ``OUT_DIR/LOSS.pt``
with the trained state dict and what fit said it trains.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
from test_recipe_replicated import LOSSES, PLANS, compiled_for, data, sgd


def main() -> None:
    out, plan, names = Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
    torch.set_num_threads(1)
    starts, replicas = PLANS[plan]
    trainers = []
    for name in names:
        compiled = compiled_for(starts, replicas, LOSSES[name])
        trainer = compiled.trainer(optimizer=sgd, progress=False, timeout_s=60)
        trainer.fit(data())
        state = trainer.state_dict()
        if trainer.index == 0:
            torch.save({"state": state, "recipe": getattr(compiled, "recipe", ""),
                        "replicas": compiled.plan.replicas}, out / f"{name}.pt")
        trainers.append(trainer)
    for trainer in trainers:  # the job's process group serves every compile until here
        trainer.close()


if __name__ == "__main__":
    main()
