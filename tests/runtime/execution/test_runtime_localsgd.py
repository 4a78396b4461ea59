"""LocalSGD across pipeline replicas (fxpipe.runtime.schedules.localsgd[_executor]) against plain
PyTorch.

The oracle is written here from LocalSGD's definition: R copies of the whole model, copy j trains
with ordinary momentum SGD on minibatches j, j + R, j + 2R, ... and every H updates (and at the
end) the copies' weights are replaced by their mean; momentum buffers stay with their copy.
"""
from __future__ import annotations

import copy
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from rt_helpers import split
from test_runtime_mitigation import data64, model64

from fxpipe.runtime.errors import RuntimeConfigError
from fxpipe.runtime.schedules.localsgd import make_localsgd_schedule
from fxpipe.runtime.execution.launch import RankJob, run_rank_jobs
from fxpipe.runtime.execution.localsgd_executor import LocalSGDExecutor
from fxpipe.runtime.schedules.ncclcheck import check_logs

LR, MOM = 0.05, 0.9


def local_sgd(model: torch.nn.Module, data: list, R: int, H: int) -> tuple[list[float], dict]:
    copies = [copy.deepcopy(model) for _ in range(R)]
    opts = [torch.optim.SGD(c.parameters(), lr=LR, momentum=MOM) for c in copies]
    losses: dict[int, float] = {}
    rounds = -(-len(data) // R)
    for i in range(rounds):
        for j, (c, o) in enumerate(zip(copies, opts)):
            k = i * R + j
            if k >= len(data):
                continue
            o.zero_grad()
            loss = F.mse_loss(c(data[k][0]), data[k][1])
            loss.backward()
            o.step()
            losses[k] = float(loss.detach())
        if (i + 1) % H == 0 or i == rounds - 1:
            with torch.no_grad():
                for ps in zip(*(c.parameters() for c in copies)):
                    mean = torch.stack([p for p in ps]).mean(0)
                    for p in ps:
                        p.copy_(mean)
    return [losses[k] for k in range(len(data))], dict(copies[0].named_parameters())


def run(model: torch.nn.Module, data: list, R: int, H: int) -> tuple[list[float], dict]:
    stages = split(copy.deepcopy(model), [1, 3])
    sched = make_localsgd_schedule(len(stages), R, len(data), average_every=H)
    res = LocalSGDExecutor(stages, sched, F.mse_loss,
                           lambda ps: torch.optim.SGD(ps, lr=LR, momentum=MOM)).run(data)
    for rank, params in res.replica_params.items():  # one model after the final average
        for n, t in params.items():
            assert torch.equal(t, res.params[rank[0]][n])
    return res.losses, res.merged_params()


@pytest.mark.parametrize("R,H,n", [(3, 2, 13), (2, 3, 12), (3, 1, 9)])
def test_localsgd_equals_independent_replicas_averaged(R: int, H: int, n: int) -> None:
    model, data = model64(), data64(n)
    losses, params = run(model, data, R, H)
    want_losses, want = local_sgd(model, data, R, H)
    torch.testing.assert_close(losses, want_losses, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(params, {k: v.detach() for k, v in want.items()},
                               rtol=1e-10, atol=1e-12)


def test_average_every_update_is_synchronous_sgd() -> None:
    """H = 1: averaging the replicas' momentum-SGD steps is one step on the mean gradient."""
    model, data, R = model64(), data64(9), 3
    _, params = run(model, data, R, 1)
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(ref.parameters(), lr=LR, momentum=MOM)
    for i in range(0, len(data), R):
        opt.zero_grad()
        loss = sum(F.mse_loss(ref(x), y) for x, y in data[i:i + R]) / R
        loss.backward()
        opt.step()
    torch.testing.assert_close(params, {k: v.detach() for k, v in ref.named_parameters()},
                               rtol=1e-10, atol=1e-12)


def test_localsgd_schedule_is_sequential_per_replica_and_refuses_bad_input() -> None:
    sched = make_localsgd_schedule(2, 2, 3, average_every=2)
    assert [str(a) for a in sched.actions[(0, 0)]] == ["F0", "B0", "U0", "F2", "B2", "U1"]
    assert [str(a) for a in sched.actions[(1, 1)]] == ["F1", "B1", "U0", "U1"]  # empty round
    with pytest.raises(Exception, match="average_every=0"):
        make_localsgd_schedule(2, 2, 4, average_every=0)
    with pytest.raises(RuntimeConfigError, match="LocalSGDExecutor got a 'pipedream'"):
        from fxpipe.runtime.schedules.kinds import make_schedule

        LocalSGDExecutor(split(model64(), [1, 3]), make_schedule("pipedream", [1, 1, 1], 3),
                         F.mse_loss, lambda ps: torch.optim.SGD(ps, lr=LR))


@pytest.mark.multiprocess
def test_localsgd_distributed_equals_reference_and_oracle() -> None:
    """One process per (stage, replica): 2 and 4 stages with R = 2 (one spawned world of 8),
    the averages one all-reduce on each stage's replica group; == the reference executor ==
    the oracle above, and every rank's host calls pass NCCL's rules."""
    model = model64()
    cases = [([2], 11, 2), ([1, 2, 3], 10, 3)]  # cuts (2 and 4 stages), minibatches, H
    jobs, refs = [], []
    for cuts, n, H in cases:
        data = data64(n)
        stages = split(copy.deepcopy(model), cuts)
        sched = make_localsgd_schedule(len(stages), 2, n, average_every=H)
        opt = partial(torch.optim.SGD, lr=LR, momentum=MOM)
        jobs.append(RankJob(stages, [2] * len(stages), sched, F.mse_loss, opt, data,
                            record_comm=True))
        ref = LocalSGDExecutor(stages, sched, F.mse_loss, opt).run(data)
        refs.append((ref, local_sgd(model, data, 2, H)))
    for (cuts, n, H), got, (ref, (want_losses, want)) in zip(
            cases, run_rank_jobs(jobs, timeout_s=30.0, join_timeout_s=300.0), refs):
        assert len(got.comm_logs) == 2 * (len(cuts) + 1)
        assert check_logs(got.comm_logs) > 0
        assert got.losses == ref.losses  # same operations in the same order: bit for bit
        for rank, params in got.replica_params.items():  # one model after the final average
            for name, t in params.items():
                assert torch.equal(t, ref.replica_params[rank][name]), (rank, name)
        torch.testing.assert_close(got.losses, want_losses, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(got.merged_params(), {k: v.detach() for k, v in want.items()},
                                   rtol=1e-10, atol=1e-12)
