"""The reference executor against plain SGD, and its replica / versioning semantics."""
from __future__ import annotations

import copy

import pytest
import torch
from rt_helpers import LR, SkipMLP, batches, loss_fn, plain_sgd, sgd, split, tiny_mlp
from stale_oracles import double, pipedream_sgd, two_bw_sgd
from stale_oracles import plain_sgd as oracle_sgd

from fxpipe.runtime.errors import RuntimeConfigError
from fxpipe.runtime.execution.reference import ReferenceExecutor
from fxpipe.runtime.schedules.schedule import SCHEDULE_KINDS
from fxpipe.runtime.schedules.kinds import make_schedule

EXACT = dict(rtol=0.0, atol=0.0)


@pytest.mark.parametrize("kind", ["pipedream", "1f1b-flush", "gpipe"])
def test_one_stage_equals_plain_sgd(kind: str) -> None:
    data = batches(6)
    model = tiny_mlp()
    stages = split(copy.deepcopy(model), [])
    sched = make_schedule(kind, [1], 6, microbatches=1 if kind != "pipedream" else None)
    res = ReferenceExecutor(stages, [1], sched, loss_fn, sgd).run(data)
    losses, params = plain_sgd(model, data)
    assert res.losses == losses
    torch.testing.assert_close(res.merged_params(), params, **EXACT)


@pytest.mark.parametrize("cuts", [[2], [1, 3], [1, 2, 4]])
def test_noam_one_any_stages_equals_plain_sgd(cuts: list[int]) -> None:
    data = batches(6)
    model = tiny_mlp()
    stages = split(copy.deepcopy(model), cuts)
    S = len(cuts) + 1
    sched = make_schedule("pipedream", [1] * S, 6, noam=1)
    res = ReferenceExecutor(stages, [1] * S, sched, loss_fn, sgd).run(data)
    losses, params = plain_sgd(model, data)
    torch.testing.assert_close(res.losses, losses, **EXACT)
    torch.testing.assert_close(res.merged_params(), params, **EXACT)


def test_noam_one_skip_connection_equals_plain_sgd() -> None:
    """A value sent straight to two later stages: its gradient sums both consumers' (in stage
    order, which may differ from autograd's order by a rounding)."""
    data = batches(6)
    model = SkipMLP()
    stages = split(copy.deepcopy(model), [2, 4])
    assert stages[0].consumers == ((1, 2),)
    sched = make_schedule("pipedream", [1, 1, 1], 6, noam=1)
    res = ReferenceExecutor(stages, [1, 1, 1], sched, loss_fn, sgd).run(data)
    losses, params = plain_sgd(model, data)
    torch.testing.assert_close(res.losses, losses, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(res.merged_params(), params, rtol=1e-6, atol=1e-7)


# Pipelined pipedream with and without stashing, replicated stages and vertical sync are
# checked against their training rules in test_runtime_stale_oracles.py.


def test_replicated_stage_keeps_replicas_bit_identical() -> None:
    """Replicas step with the same all-reduced mean: their weights are equal to the last bit."""
    data = batches(8)
    sched = make_schedule("pipedream", [2, 1], 8)
    res = ReferenceExecutor(split(tiny_mlp(), [2]), [2, 1], sched, loss_fn, sgd).run(data)
    torch.testing.assert_close(res.replica_params[(0, 0)], res.replica_params[(0, 1)], **EXACT)


def test_data_parallel_one_stage_two_replicas_equals_big_batch_sgd() -> None:
    """[2] with gpipe, m=2: each update averages two minibatch gradients = SGD on their mean."""
    data = batches(4)
    model = tiny_mlp()
    sched = make_schedule("gpipe", [2], 4, microbatches=2)
    res = ReferenceExecutor(split(copy.deepcopy(model), []), [2], sched, loss_fn, sgd).run(data)
    opt = sgd(list(model.parameters()))
    for b in range(2):
        opt.zero_grad()
        for x, y in data[2 * b:2 * b + 2]:
            (loss_fn(model(x), y) / 2).backward()
        opt.step()
    torch.testing.assert_close(res.merged_params(), dict(model.named_parameters()),
                               rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("kind", SCHEDULE_KINDS)
def test_every_kind_trains_by_its_rule(kind: str) -> None:
    """Each kind against its rule written as plain PyTorch (stale_oracles.py), in float64:
    pipedream = 1F1B stale SGD, the flush kinds (the zero-bubble ones too) = one SGD step per 4
    microbatches, 2bw = one step per batch on the weights one batch old."""
    data = double(batches(8))
    m = None if kind == "pipedream" else 4
    sched = make_schedule(kind, [1, 1], 8, microbatches=m)
    res = ReferenceExecutor(split(tiny_mlp().double(), [2]), [1, 1], sched, loss_fn,
                            sgd).run(data)
    w0 = {n: p.detach().clone() for n, p in tiny_mlp().double().named_parameters()}
    want = {"pipedream": lambda: pipedream_sgd(w0, (0, 0, 1, 1, 1), (1, 1), data, LR),
            "1f1b-flush": lambda: oracle_sgd(w0, data, LR, 4),
            "gpipe": lambda: oracle_sgd(w0, data, LR, 4),
            "zb-h1": lambda: oracle_sgd(w0, data, LR, 4),
            "zb-h2": lambda: oracle_sgd(w0, data, LR, 4),
            "2bw": lambda: two_bw_sgd(w0, data, 4, LR)}[kind]()
    torch.testing.assert_close(res.losses, want[0], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(res.merged_params(), want[1], rtol=1e-10, atol=1e-12)


def test_run_twice_continues_training() -> None:
    data = batches(4)
    model = tiny_mlp()
    ex = ReferenceExecutor(split(copy.deepcopy(model), [2]), [1, 1],
                           make_schedule("pipedream", [1, 1], 2, noam=1), loss_fn, sgd)
    ex.run(data[:2])
    res = ex.run(data[2:])
    _, params = plain_sgd(model, data)
    torch.testing.assert_close(res.merged_params(), params, **EXACT)


def test_mismatched_schedule_is_rejected() -> None:
    with pytest.raises(RuntimeConfigError, match="replicas"):
        ReferenceExecutor(split(tiny_mlp(), [2]), [1, 1], make_schedule("pipedream", [2, 1], 4),
                          loss_fn, sgd)
    ex = ReferenceExecutor(split(tiny_mlp(), [2]), [1, 1], make_schedule("pipedream", [1, 1], 4),
                           loss_fn, sgd)
    with pytest.raises(RuntimeConfigError, match="3 batches"):
        ex.run(batches(3))


class _CountMM(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts matrix products (a Linear's backward: one for its weight, one for its input)."""

    def __init__(self) -> None:
        super().__init__()
        self.mm = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.mm += func is torch.ops.aten.mm.default
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("cuts", [[], [2]])
def test_model_inputs_are_not_differentiated(cuts: list[int]) -> None:
    """The gradient of a model input goes nowhere (the distributed executor does not compute it
    either): the input stage's backward skips that product. tiny_mlp's three Linear layers per
    backward: three weight gradients and the inputs of the second and third layer, 5 products
    (6 when the model input is differentiated too), whatever the cut."""
    data = batches(6)
    stages = split(tiny_mlp(), cuts)
    S = len(cuts) + 1
    sched = make_schedule("pipedream", [1] * S, 6, noam=1)
    ex = ReferenceExecutor(stages, [1] * S, sched, loss_fn, sgd)
    with _CountMM() as count:
        ex.run(data)
    assert count.mm == 5 * 6
