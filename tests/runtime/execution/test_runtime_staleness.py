"""PipeDream's weight-stashing semantics, checked against an independent formula.

In the pipedream (1F1B, NOAM = S) schedule of a straight S-stage pipeline, stage s admits S - s
minibatches before its first backward and updates after every backward, so the forward (and,
with weight stashing, the backward) of minibatch k on stage s uses the weights after
``max(0, k - (S - 1 - s))`` updates: the last stage is never stale, stage 0 is S - 1 updates
behind. ``stale_sgd`` trains the ORIGINAL model with exactly that rule, in one process, without
the runtime's schedule, stash or executor; the reference executor must agree with it.
"""
from __future__ import annotations

import copy

import pytest
import torch
from rt_helpers import LR, batches, loss_fn, split, tiny_mlp
from torch.func import functional_call

from fxpipe.runtime.execution.reference import ReferenceExecutor
from fxpipe.runtime.schedules.kinds import make_schedule


def stale_sgd(model: torch.nn.Module, stage_of: dict[str, int], stages: int,
              data: list) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Plain SGD where minibatch k sees stage s's weights ``max(0, k - (S-1-s))`` updates old."""
    hist = [{n: p.detach().clone() for n, p in model.named_parameters()}]  # hist[j]: j updates
    losses = []
    for k, (x, y) in enumerate(data):
        used = {n: hist[max(0, k - (stages - 1 - stage_of[n]))][n].clone().requires_grad_(True)
                for n in hist[0]}
        loss = loss_fn(functional_call(model, used, (x,)), y)
        grads = torch.autograd.grad(loss, list(used.values()))
        hist.append({n: hist[-1][n] - LR * g for n, g in zip(used, grads)})
        losses.append(float(loss.detach()))
    return losses, hist[-1]


@pytest.mark.parametrize("cuts", [[2], [1, 3], [0, 2, 4]])
def test_pipedream_equals_stale_sgd(cuts: list[int]) -> None:
    data = batches(9)
    model = tiny_mlp()
    stages = split(copy.deepcopy(model), cuts)
    S = len(stages)
    stage_of = {n: s for s, st in enumerate(stages) for n, _ in st.gm.named_parameters()}
    assert sorted(stage_of) == sorted(n for n, _ in model.named_parameters())
    sched = make_schedule("pipedream", [1] * S, len(data))
    res = ReferenceExecutor(stages, [1] * S, sched, loss_fn,
                            lambda ps: torch.optim.SGD(ps, lr=LR)).run(data)
    losses, params = stale_sgd(model, stage_of, S, data)
    torch.testing.assert_close(res.losses, losses, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(res.merged_params(), params, rtol=1e-6, atol=1e-7)
    # and it is genuinely stale: the same rule with no delay (plain SGD) ends elsewhere
    _, fresh = stale_sgd(model, {n: S - 1 for n in stage_of}, S, data)
    assert not torch.allclose(fresh["0.weight"], params["0.weight"])
