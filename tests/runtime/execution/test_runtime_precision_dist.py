"""fp16 loss scaling and float32 master weights in the distributed executor (gloo ranks in one
spawned world) equal the reference executor (itself checked against eager torch loops in
test_runtime_fp16 / test_runtime_master_weights); the overflow decision is one all-reduce over
every rank per update, and every run's communication passes the NCCL checker (rt_spawn)."""
from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from rt_helpers import split
from rt_spawn import Job, run_jobs
from test_runtime_fp16 import SCALER, Net, data
from test_runtime_master_weights import bf16_batches, bf16_model

from fxpipe.runtime.execution.reference import ReferenceExecutor
from fxpipe.runtime.schedules.kinds import make_schedule
from fxpipe.runtime.replica.step_options import StepOptions

pytestmark = [pytest.mark.multiprocess]

small = functools.partial(torch.optim.SGD, lr=1e-3)
adamw = functools.partial(torch.optim.AdamW, lr=3e-3)


def fp16_job() -> Job:
    """Stages [1, 2] replicas; minibatch 5 of 8 overflows only in stage 0's weight gradient."""
    batches = data(8, huge=5)
    return Job(split(Net(), [1]), [1, 2], make_schedule("1f1b-flush", [1, 2], 8, microbatches=2),
               F.mse_loss, small, batches,
               StepOptions.make(2, precision="fp16", loss_scaler=SCALER, clip_grad_norm=1.0))


def masters_job() -> Job:
    """A bfloat16 model (float32 masters, automatic) with a replicated middle stage: the
    replicas' float32 gradient sums go through the overlapped buckets."""
    batches = bf16_batches(8)
    return Job(split(bf16_model(), [1, 3]), [1, 2, 1],
               make_schedule("1f1b-flush", [1, 2, 1], 8, microbatches=4), F.mse_loss, adamw,
               batches, StepOptions.make(3))


def test_fp16_and_master_weights_distributed_equal_the_reference() -> None:
    makers = {"fp16": fp16_job, "masters": masters_job}
    jobs = [make() for make in makers.values()]
    got = run_jobs(jobs)
    for (name, make), res in zip(makers.items(), got):
        fresh = make()
        ex = ReferenceExecutor(fresh.stages, fresh.replicas, fresh.schedule, fresh.loss_fn,
                               fresh.optimizer_factory, options=fresh.options)
        ref = ex.run(fresh.batches)
        if name == "fp16":  # updates 0, 1 clean; 2 (minibatch 5) overflowed; 3 clean
            assert {w.scaler.scale for w in ex.workers.values()} == {2048.0}  # type: ignore
        assert res.losses == ref.losses, name
        for s, params in enumerate(ref.params):
            for n, t in params.items():
                assert res.params[s][n].dtype == t.dtype
                torch.testing.assert_close(res.params[s][n], t, rtol=1e-6, atol=1e-7,
                                           msg=f"{name}: stage {s} {n}")
    # fp16: one all-reduce of [squared norm, overflow flag] over every rank per update (4)
    colls = [ev for ev in got[0].comm_logs[0] if ev[0] == "coll" and ev[1] == "clip"]
    assert len(colls) == 4 and all(c[3] == (0, 1, 2) for c in colls)
