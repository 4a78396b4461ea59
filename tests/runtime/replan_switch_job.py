"""A torchrun job for test_runtime_trainer_switch: 2 ranks start from the plan a deliberately
wrong profile (x4 on one stage) gives and train with ``replan="auto"``; rank r saves its
re-planning records (and rank 0 the gathered weights and history) to OUT.r.pt.

    python -m torch.distributed.run --nproc-per-node 2 replan_switch_job.py OUT MODE

MODE ``perfect``: the measurements are the right profile's (a perfect timer: the switch is
certain); ``timeline``: each rank's own timelines (the default measuring; any decision).
"""
from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F

import fxpipe
from test_runtime_trainer_switch import (CLUSTER, M, Net, data, example, options, perfect_timer,
                                         wrong_start)


def main() -> int:
    torch.set_num_threads(1)
    out, mode = sys.argv[1], sys.argv[2]
    true, bad, bad_plan = wrong_start()
    compiled = fxpipe.compile(Net(), CLUSTER, example_inputs=(example(),),
                              loss_fn=F.cross_entropy, plan=bad_plan)
    compiled.profile = bad
    extra = (dict(replan_measure=perfect_timer(true)) if mode == "perfect"
             else dict(replan_after=2, replan_threshold=0.0))
    kw = {**options(replan="auto", **extra), "executor": "distributed", "timeout_s": 60}
    trainer = compiled.trainer(**kw)
    history = trainer.fit(data(), epochs=2)
    recs = [(r.epoch, r.position, r.adopted, r.proposal.gain, r.proposal.factors,
             list(r.proposal.proposed.replicas), r.measured_before_s, r.measured_after_s)
            for r in trainer.replanner.records]
    state = trainer.state_dict()
    rank = int(os.environ["RANK"])
    torch.save({"records": recs, "history": history, "state": state if rank == 0 else None,
                "replicas": trainer.replicas, "stages": len(trainer.stages),
                "local": sorted(trainer.local), "segments": M},
               f"{out}.{rank}.pt")
    trainer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
