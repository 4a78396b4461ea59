"""The reference executor against stale-weight SGD written from the papers (stale_oracles.py).

Each schedule promises a training rule: which weight version every forward and backward reads
and what each update averages. The oracles implement those rules as plain PyTorch loops, with no
fxpipe runtime code (no schedule, stash, StageReplica or executor), and everything runs in
float64, so any wrong version shows up as a difference of order lr * gradient (~1e-2) against a
tolerance of 1e-10. Every case also checks that its rule is not the same as its neighbours' (plain
SGD, no vertical sync, ...), so the comparison can tell them apart.
"""
from __future__ import annotations

import pytest
import torch
from rt_helpers import LR, batches, loss_fn, sgd, split, tiny_mlp
from stale_oracles import double, no_stash_sgd, pipedream_sgd, plain_sgd, two_bw_sgd

from fxpipe.runtime.execution.reference import ReferenceExecutor
from fxpipe.runtime.execution.contract import RunResult
from fxpipe.runtime.schedules.kinds import make_schedule

F64 = dict(rtol=1e-10, atol=1e-12)
# cuts (rt_helpers.split) -> stage of each tiny_mlp layer (Linear, Tanh, Linear, Tanh, Linear):
# placeholder x is node 0, layer i is node i + 1, and a node's stage is the number of cuts below it
LAYER_STAGE = {(2,): (0, 0, 1, 1, 1), (1, 3): (0, 1, 1, 2, 2), (1, 2, 3): (0, 1, 2, 3, 3)}


def w0() -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in tiny_mlp().double().named_parameters()}


def reference(cuts: tuple[int, ...], replicas: tuple[int, ...], kind: str, n: int,
              m: int | None = None, **kw) -> tuple[RunResult, list]:
    data = double(batches(n))
    sched = make_schedule(kind, list(replicas), n, microbatches=m)
    ex = ReferenceExecutor(split(tiny_mlp().double(), list(cuts)), list(replicas), sched, loss_fn,
                           sgd, **kw)
    return ex.run(data), data


def version_bytes(cuts: tuple[int, ...]) -> list[int]:
    """Bytes of one weight version of each stage (float64: 8 bytes per element)."""
    stages = split(tiny_mlp().double(), list(cuts))
    return [sum(p.numel() * 8 for p in st.gm.parameters()) for st in stages]


def assert_matches(res: RunResult, want: tuple[list[float], dict[str, torch.Tensor]]) -> None:
    losses, params = want
    torch.testing.assert_close(res.losses, losses, **F64)
    for rank, got in res.replica_params.items():  # every replica, not only replica 0
        torch.testing.assert_close(got, {n: params[n] for n in got}, **F64, msg=str(rank))


def assert_differs(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert max(float((a[n] - b[n]).abs().max()) for n in a) > 1e-6


@pytest.mark.parametrize("cuts, replicas, n", [
    ((1, 3), (1, 1, 1), 8), ((2,), (2, 1), 8), ((2,), (1, 2), 8), ((2,), (3, 1), 9),
    ((1, 3), (2, 1, 1), 8), ((1, 3), (1, 2, 1), 8)])
def test_pipedream_equals_round_robin_stale_sgd(cuts, replicas, n) -> None:
    """Replicated stages: minibatch k on replica k mod r, version max(0, k div r - w + 1), one
    update per round of r minibatches averaging their gradients."""
    res, data = reference(cuts, replicas, "pipedream", n)
    want = pipedream_sgd(w0(), LAYER_STAGE[cuts], replicas, data, LR)
    assert_matches(res, want)
    assert_differs(want[1], plain_sgd(w0(), data, LR)[1])  # genuinely stale


@pytest.mark.parametrize("cuts, replicas", [((1, 3), (1, 1, 1)), ((1, 2, 3), (1, 1, 1, 1)),
                                            ((2,), (2, 2))])
def test_vertical_sync_uses_the_input_stages_version_everywhere(cuts, replicas) -> None:
    res, data = reference(cuts, replicas, "pipedream", 8, vertical_sync=True)
    want = pipedream_sgd(w0(), LAYER_STAGE[cuts], replicas, data, LR, vertical_sync=True)
    assert_matches(res, want)
    assert_differs(want[1], pipedream_sgd(w0(), LAYER_STAGE[cuts], replicas, data, LR)[1])


@pytest.mark.parametrize("cuts, replicas, m", [((2,), (1, 1), 2), ((1, 3), (1, 1, 1), 3),
                                               ((2,), (2, 1), 3), ((1, 3), (1, 1, 1), 4)])
def test_2bw_equals_double_buffered_sgd_with_two_versions(cuts, replicas, m) -> None:
    """W(t+1) = W(t) - lr grad f(W(t-1)); and no rank ever holds more than those two versions."""
    n = 4 * m
    res, data = reference(cuts, replicas, "2bw", n, m)
    want = two_bw_sgd(w0(), data, m, LR)
    assert_matches(res, want)
    assert_differs(want[1], plain_sgd(w0(), data, LR, m)[1])
    one = version_bytes(cuts)
    assert all(peak <= 2 * one[rank[0]] for rank, peak in res.peak_bytes.items())
    assert res.peak_bytes[(0, 0)] == 2 * one[0]  # the input stage does hold two at once


@pytest.mark.parametrize("cuts", [(2,), (1, 3), (1, 2, 3)])
def test_no_stashing_backward_recomputes_with_the_latest_weights(cuts) -> None:
    S = len(cuts) + 1
    res, data = reference(cuts, (1,) * S, "pipedream", 8, stashing=False)
    want = no_stash_sgd(w0(), LAYER_STAGE[cuts], data, LR)
    assert_matches(res, want)
    assert_differs(want[1], pipedream_sgd(w0(), LAYER_STAGE[cuts], (1,) * S, data, LR)[1])
    one = version_bytes(cuts)  # nothing but the latest version is ever held
    assert {rank: peak for rank, peak in res.peak_bytes.items()} == {
        (s, 0): one[s] for s in range(S)}
