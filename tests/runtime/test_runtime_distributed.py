"""The distributed runtime (gloo, CPU, spawned processes) against the reference executor."""
from __future__ import annotations

import copy
import time

import pytest
import torch
from rt_helpers import SkipMLP, batches, loss_fn, sgd, split, tiny_mlp

from fxpipe.runtime.errors import WorkerFailedError
from fxpipe.runtime.launch import run_distributed
from fxpipe.runtime.reference import ReferenceExecutor
from fxpipe.runtime.schedule import make_schedule

TIGHT = dict(rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("cuts, replicas, make", [([2], [1, 1], tiny_mlp),
                                                 ([2, 4], [1, 1, 1], SkipMLP),
                                                 ([2], [2, 1], tiny_mlp)],
                         ids=["2-stage", "3-stage-skip", "replicated-2-1"])
def test_distributed_equals_reference(cuts: list[int], replicas: list[int], make) -> None:
    """8 pipedream minibatches; the 3-stage model sends stage 0's output straight to stage 2."""
    data = batches(8)
    model = make()
    sched = make_schedule("pipedream", replicas, 8)
    ref = ReferenceExecutor(split(copy.deepcopy(model), cuts), replicas, sched, loss_fn,
                            sgd).run(data)
    got = run_distributed(split(copy.deepcopy(model), cuts), replicas, sched, loss_fn, sgd, data,
                          timeout_s=30, join_timeout_s=240)
    torch.testing.assert_close(got.losses, ref.losses, **TIGHT)
    for rank in sched.ranks:
        torch.testing.assert_close(got.replica_params[rank], ref.replica_params[rank], **TIGHT)
    assert got.peak_bytes == ref.peak_bytes


def test_killed_rank_makes_the_others_fail_naming_it() -> None:
    sched = make_schedule("pipedream", [1, 1, 1], 8)
    start = time.monotonic()
    with pytest.raises(WorkerFailedError) as info:
        run_distributed(split(tiny_mlp(), [1, 3]), [1, 1, 1], sched, loss_fn, sgd, batches(8),
                        timeout_s=5, join_timeout_s=120, faults={1: ("die", 3)})
    err = info.value
    assert err.exitcodes[1] == 17 and err.exitcodes[0] != 0 and err.exitcodes[2] != 0
    for i in (0, 2):
        assert "stage 1 replica 0 (rank 1)" in err.errors[i], err.errors[i]
    assert time.monotonic() - start < 90


def test_hung_rank_times_out_naming_it() -> None:
    sched = make_schedule("pipedream", [1, 1], 4)
    with pytest.raises(WorkerFailedError) as info:
        run_distributed(split(tiny_mlp(), [2]), [1, 1], sched, loss_fn, sgd, batches(4),
                        timeout_s=2, join_timeout_s=120, faults={1: ("hang", 1)})
    err = info.value
    assert err.exitcodes[0] == 1
    assert "stage 1 replica 0 (rank 1)" in err.errors[0] and "timeout 2 s" in err.errors[0]
