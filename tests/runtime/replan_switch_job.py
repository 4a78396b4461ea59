"""A torchrun job for test_runtime_trainer_switch: 2 ranks start from the plan a deliberately
wrong profile (x4 on one stage) gives and train with ``replan="auto"``; rank r saves its
re-planning records (and rank 0 the gathered weights and history) to OUT.r.pt.

    python -m torch.distributed.run --nproc-per-node 2 replan_switch_job.py OUT MODE [RECIPE]

MODE ``perfect``: the measurements are the right profile's (a perfect timer: the switch is
certain; the do-no-harm verdict, a timing, is left out); ``timeline``: each rank's own
timelines (the default measuring; any decision, falling back to one worker included);
``harm``: the right plan, the perfect timer, and rank 0's do-no-harm verdict forced after its second segment
(rank 1's never set: rank 0's decides), so the job falls back to one worker. RECIPE (see
``recipe`` in the test): ``microbatches`` (default), ``default`` or ``split``.
"""
from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F

import fxpipe
from test_runtime_trainer_switch import (CLUSTER, M, Net, data, example, options, perfect_timer,
                                         recipe, wrong_start)


def main() -> int:
    torch.set_num_threads(1)
    out, mode = sys.argv[1], sys.argv[2]
    true, bad, bad_plan = wrong_start()
    compiled = fxpipe.compile(Net(), CLUSTER, example_inputs=(example(),),
                              loss_fn=F.cross_entropy, plan=None if mode == "harm" else bad_plan,
                              schedule="pipedream")
    if mode != "harm":  # harm: the right plan, which the perfect timer keeps
        compiled.profile = bad
    extra = (dict(replan_measure=perfect_timer(true)) if mode in ("perfect", "harm")
             else dict(replan_after=2, replan_threshold=0.0))
    kw = {**recipe(sys.argv[3] if len(sys.argv) > 3 else "microbatches",
                   options(replan="auto", **extra)), "executor": "distributed", "timeout_s": 60}
    rank = int(os.environ["RANK"])
    if mode == "harm":
        from fxpipe.runtime.training.trainer import Trainer

        def forced(self, busy, dt, n):  # noqa: ANN001, ANN202 - the verdict on rank 0 only
            self._harm_segments += 1
            if rank == 0 and self._harm_segments == 2 and self.harm is None:
                self.harm_ratio = 2.0
                self.harm = ("2 workers took 1 s for 4 minibatches while their compute was "
                             "0.5 s in all: one worker would have been 2.00x faster")
        Trainer._check_harm = forced
    elif mode == "perfect":  # the decisions are the timer's: no do-no-harm verdict from timing
        from fxpipe.runtime.training.trainer import Trainer

        Trainer._check_harm = lambda self, busy, dt, n: None
    trainer = compiled.trainer(**kw)
    history = trainer.fit(data(), epochs=2)
    recs = [(r.epoch, r.position, r.adopted, r.proposal.gain, r.proposal.factors,
             list(r.proposal.proposed.replicas), r.measured_before_s, r.measured_after_s)
            for r in trainer.replanner.records]
    state = trainer.state_dict()
    torch.save({"records": recs, "history": history, "state": state if rank == 0 else None,
                "replicas": trainer.replicas, "stages": len(trainer.stages),
                "local": sorted(trainer.local), "segments": M, "idle": trainer.idle,
                "executor": type(trainer.backend).__name__},
               f"{out}.{rank}.pt")
    trainer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
