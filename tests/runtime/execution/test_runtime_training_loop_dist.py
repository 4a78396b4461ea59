"""Clipping, bf16 and recomputation in the distributed executor (gloo ranks in one spawned world)
equal the reference executor with the same options (itself checked against eager torch in
test_runtime_clipping / test_runtime_precision_recompute); every run's recorded communication,
the gradient norm's all-reduce included, passes the NCCL checker (rt_spawn.run_jobs)."""
from __future__ import annotations

import functools

import pytest
import torch
from rt_helpers import batches, loss_fn, split, tiny_mlp
from rt_spawn import Job, run_jobs
from rt_tied import TiedLM, ce, token_batches

from fxpipe.runtime.execution.reference import ReferenceExecutor
from fxpipe.runtime.schedules.kinds import make_schedule
from fxpipe.runtime.replica.step_options import StepOptions

pytestmark = [pytest.mark.multiprocess]

sgd = functools.partial(torch.optim.SGD, lr=0.5, momentum=0.9)


def _big(n: int) -> list:
    return [(x, 10 * y) for x, y in batches(n)]


def _job(model_fn, cuts, replicas, kind, data, loss, options, m=None) -> Job:
    sched = make_schedule(kind, replicas, len(data), microbatches=m)
    return Job(split(model_fn(), cuts), replicas, sched, loss, sgd, data, options)


CASES = {
    "global clip, replicated stage": lambda: _job(tiny_mlp, [1, 3], [1, 2, 1], "1f1b-flush",
                                                  _big(8), loss_fn,
                                                  StepOptions.make(3, clip_grad_norm=0.3), 4),
    "global clip, tied weight": lambda: _job(TiedLM, [1, 3], [1, 1, 1], "gpipe",
                                             token_batches(8), ce,
                                             StepOptions.make(3, clip_grad_norm=0.05), 4),
    "stage clip, bf16, recompute": lambda: _job(
        tiny_mlp, [2], [1, 1], "pipedream", _big(6), loss_fn,
        StepOptions.make(2, clip_grad_norm=0.3, precision="bf16", recompute=True)),
    "bf16, recompute one stage": lambda: _job(
        tiny_mlp, [1, 3], [1, 2, 1], "1f1b-flush", batches(8), loss_fn,
        StepOptions.make(3, precision="bf16", recompute=[False, True, True]), 4),
}


def test_distributed_options_equal_the_reference() -> None:
    jobs = [make() for make in CASES.values()]
    got = run_jobs(jobs)
    for name, job, res in zip(CASES, jobs, got):
        fresh = CASES[name]()  # untouched weights for the oracle
        ref = ReferenceExecutor(fresh.stages, fresh.replicas, fresh.schedule, fresh.loss_fn, sgd,
                                options=fresh.options).run(fresh.batches)
        assert res.losses == ref.losses, name
        for s, params in enumerate(ref.params):
            for n, t in params.items():
                torch.testing.assert_close(res.params[s][n], t, rtol=1e-6, atol=1e-7,
                                           msg=f"{name}: stage {s} {n}")
    # the bf16 runs really sent bfloat16 activations (half the bytes)
    sent = {ev[2][0][4] for log_ in got[3].comm_logs.values() for ev in log_
            if ev[0] == "p2p" and ev[2][0][0]}
    assert "torch.bfloat16" in sent
    # the global norm is one all-reduce over every rank per update
    colls = [ev for ev in got[0].comm_logs[0] if ev[0] == "coll" and ev[1] == "clip"]
    assert len(colls) == 2 and colls[0][3] == (0, 1, 2, 3)
