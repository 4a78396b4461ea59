"""B then W (a zero-bubble schedule's split backward) equals the fused backward exactly: on every
zoo model's every stage, and on hand-made graphs with the shapes that make splitting tricky."""
from __future__ import annotations

import pytest
import torch

import fxpipe
from fxpipe import models
from fxpipe.runtime.replica.splitgrad import input_gradients
from fxpipe.runtime.replica.stage import StageReplica, model_env

SGD = lambda ps: torch.optim.SGD(ps, lr=0.1)  # noqa: E731


def _stage_inputs(stages, x):
    """Every stage's real inputs for model inputs ``x`` (a plain run of the stages)."""
    env = model_env(stages, x)
    per_stage = []
    with torch.no_grad():
        for st in stages:
            per_stage.append([env[n] for n in st.inputs])
            env.update(zip(st.outputs, st.gm(*per_stage[-1])))
    return per_stage


@pytest.mark.parametrize("name", models.names(include_test_models=True))
def test_split_backward_equals_fused_on_every_zoo_stage(name: str) -> None:
    spec = models.get(name)
    compiled = fxpipe.compile(spec.model, fxpipe.Cluster(workers=3, device="V100"),
                              example_inputs=spec.example_inputs, loss_fn=spec.loss_fn,
                              stages=3, straight=True)
    stages = compiled.stage_specs
    x, y = spec.make_batch(spec.batch_size, seed=5)
    last = len(stages) - 1
    for st, ins in zip(stages, _stage_inputs(stages, x)):
        loss = spec.loss_fn if st.index == last else None
        fused, split = (StageReplica(st, SGD, loss_fn=loss) for _ in range(2))
        torch.manual_seed(7)  # the same dropout masks in both
        outs, _ = fused.forward(0, 0, ins, y)
        torch.manual_seed(7)
        split.forward(0, 0, ins, y)
        g = torch.Generator().manual_seed(st.index)
        seeds = [torch.randn(o.shape, generator=g, dtype=o.dtype)
                 if isinstance(o, torch.Tensor) and o.is_floating_point() else None for o in outs]
        want = fused.backward(0, seeds)
        got = split.backward(0, seeds, split=True)
        assert split.count == 0 and split.grad_sums == {}  # nothing of W has happened yet
        split.backward_weight(0)
        assert [None if t is None else t.shape for t in got] == \
            [None if t is None else t.shape for t in want]
        for a, b in zip(got, want):
            assert (a is None and b is None) or torch.equal(a, b)
        assert fused.grad_sums.keys() == split.grad_sums.keys()
        for n in fused.grad_sums:
            assert torch.equal(fused.grad_sums[n], split.grad_sums[n]), (name, st.index, n)
        assert split.count == fused.count == 1


CASES = {
    "chain": lambda x, w: torch.tanh(x @ w[0]) @ w[1],
    "skip, a weight used twice": lambda x, w: torch.tanh(x @ w[0]) @ w[1] + x @ w[0] @ w[0],
    "a loss term no input reaches": lambda x, w: (x @ w[0]).sum() + w[1].pow(2).sum(),
    "an unused weight": lambda x, w: torch.relu(x @ w[0]) * (x @ w[1]),
    "the input through two branches": lambda x, w: (x @ w[0]) * torch.sigmoid(x @ w[1]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_input_then_weight_gradients_are_the_fused_ones(case: str) -> None:
    torch.manual_seed(0)
    w = [torch.randn(4, 4, dtype=torch.float64, requires_grad=True) for _ in range(3)]
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    out = CASES[case](x, w)
    seed = torch.randn_like(out) if out.dim() else None
    want = torch.autograd.grad([out], [x, *w], [seed], retain_graph=True, allow_unused=True)
    got_x, task = input_gradients([out], [seed], [x], w)
    got_w = task.run()
    for a, b in zip([*got_x, *got_w], want):
        assert (a is None and b is None) or torch.equal(a, b)
    assert got_w[2] is None  # w[2] is used by no case


def test_weight_gradients_need_their_split_backward() -> None:
    spec = models.get("reuse")
    compiled = fxpipe.compile(spec.model, fxpipe.Cluster(workers=1, device="V100"),
                              example_inputs=spec.example_inputs, loss_fn=spec.loss_fn)
    replica = StageReplica(compiled.stage_specs[0], SGD, loss_fn=spec.loss_fn)
    with pytest.raises(fxpipe.FxpipeError, match="without its split backward"):
        replica.backward_weight(0)
