"""Weight stashing on literal, hand-computable cases."""
from __future__ import annotations

import functools

import pytest
import torch
import torch.fx as fx
import torch.nn as nn

from fxpipe.codegen.split import placed_nodes, split_graph
from fxpipe.runtime.errors import StashError
from fxpipe.runtime.stage import StageReplica
from fxpipe.runtime.stash import WeightStash

sgd = functools.partial(torch.optim.SGD, lr=0.1)


def scalar_stage() -> StageReplica:
    """y = w * x with w = 1, loss = sum(y): the input gradient IS the weight used."""
    lin = nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        lin.weight.fill_(1.0)
    gm = fx.symbolic_trace(nn.Sequential(lin))
    spec = split_graph(gm, {n.name: 0 for n in placed_nodes(gm)})[0]
    return StageReplica(spec, sgd, loss_fn=lambda out, target: out.sum(),
                        stashing=True)


@pytest.mark.parametrize("stashing, used", [(True, 1.0), (False, 0.8)])
def test_backward_uses_the_forwards_version(stashing: bool, used: float) -> None:
    st = scalar_stage()
    st.stash.stashing = stashing
    x = torch.tensor([[3.0]])
    st.forward(0, 0, [x])
    # an update lands between F0 and B0: grad 2 -> w = 1 - 0.1 * 2 = 0.8
    assert st.apply_update(torch.tensor([2.0, 1.0])) == 1
    assert st.parameters()["0.weight"].item() == pytest.approx(0.8)
    (gx,) = st.backward(0, [None])
    assert gx.item() == pytest.approx(used)  # d(w x)/dx = the w the backward used
    # the parameter gradient (x = 3) is accumulated for the next update either way
    assert st.local_gradient().tolist() == pytest.approx([3.0, 1.0])


def test_versions_are_shared_until_an_update_then_dropped() -> None:
    w = torch.ones(10)  # 40 bytes
    stash = WeightStash({"w": w.requires_grad_()}, sgd)
    a = stash.acquire(0, 0)
    b = stash.acquire(1, 0)
    assert a["w"] is b["w"] and stash.bytes_held() == 40  # shared, not copied
    stash.update({"w": torch.ones(10)})
    assert stash.versions_held() == [0, 1] and stash.bytes_held() == 80
    assert torch.equal(stash.get(0)["w"], torch.ones(10))  # the old version is untouched
    assert torch.allclose(stash.latest["w"], torch.full((10,), 0.9))
    version, weights = stash.for_backward(0)
    assert version == 0 and weights["w"] is a["w"]
    stash.release(0)
    assert stash.versions_held() == [0, 1]  # minibatch 1 still needs version 0
    stash.release(1)
    assert stash.versions_held() == [1] and stash.bytes_held() == 40
    assert stash.peak_bytes == 80


def test_update_in_place_when_nothing_in_flight() -> None:
    stash = WeightStash({"w": torch.ones(4, requires_grad=True)}, sgd)
    before = stash.latest["w"]
    stash.update({"w": torch.ones(4)})
    assert stash.latest["w"] is before and stash.bytes_held() == 16


def test_optimizer_state_follows_the_copy() -> None:
    """Momentum keeps working across a copy-on-write update."""
    mom = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)
    stash = WeightStash({"w": torch.zeros(1, requires_grad=True)}, mom)
    ref = torch.zeros(1, requires_grad=True)
    opt = mom([ref])
    for k in range(3):
        stash.acquire(k, stash.version)  # keep every version alive -> copy each time
        stash.update({"w": torch.ones(1)})
        ref.grad = torch.ones(1)
        opt.step()
    torch.testing.assert_close(stash.latest["w"], ref.detach())
    assert stash.versions_held() == [0, 1, 2, 3]


def test_planned_reads_keep_an_old_version() -> None:
    stash = WeightStash({"w": torch.ones(2, requires_grad=True)}, sgd, planned_reads={0: 2})
    stash.acquire(0, 0)
    stash.release(0)
    stash.update({"w": torch.ones(2)})
    assert torch.equal(stash.acquire(1, 0)["w"], torch.ones(2))  # vertical sync reads v0 late
    stash.release(1)
    assert stash.versions_held() == [1]
    with pytest.raises(StashError, match="version 0 is not held"):
        stash.acquire(2, 0)


def test_stage_without_parameters_still_answers_old_versions() -> None:
    """A stage of activations alone (a Tanh between two cuts) has no optimizer, but its updates
    still count versions: a backward must find the version its forward read (4-stage pipedream:
    F0 F1 F2 B0 U0 F3 B1 on stage 1)."""
    stash = WeightStash({}, lambda ps: torch.optim.SGD(ps, lr=0.1))
    for k in (0, 1, 2):
        stash.acquire(k, None)
    assert stash.for_backward(0)[0] == 0
    stash.release(0)
    assert stash.update({}) == 1
    stash.acquire(3, None)
    version, weights = stash.for_backward(1)
    assert version == 0 and weights == {}
    stash.release(1)
    stash.release(2)
    assert stash.versions_held() == [1]
