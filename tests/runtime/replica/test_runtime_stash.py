"""Weight stashing on literal, hand-computable cases."""
from __future__ import annotations

import functools

import pytest
import torch
import torch.fx as fx
import torch.nn as nn

from fxpipe.codegen.split import placed_nodes, split_graph
from fxpipe.runtime.errors import StashError
from fxpipe.runtime.replica.stage import StageReplica
from fxpipe.runtime.replica.stash import WeightStash

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


# ----------------------------------------------------------------------------- refusals
def test_each_misuse_is_refused_with_what_to_do() -> None:
    stash = WeightStash({"w": torch.ones(2, requires_grad=True)}, sgd)
    with pytest.raises(StashError) as info:
        stash.acquire(0, 1)
    assert info.value.message == "forward of minibatch 0 reads version 1 but only 0 updates happened"
    assert info.value.hint == "check the schedule's versions"
    stash.acquire(0, 0)
    with pytest.raises(StashError) as info:
        stash.acquire(0, 0)
    assert info.value.message == "minibatch 0 is already in flight"
    assert info.value.hint == "each minibatch has one forward per stage replica"
    with pytest.raises(StashError) as info:
        stash.for_backward(5)
    assert info.value.message == "backward of minibatch 5 without its forward"
    assert info.value.hint == "run F<k> before B<k> on the same replica"
    with pytest.raises(StashError) as info:
        stash.rebase()
    assert info.value.message == "rebase with minibatches [0] in flight"
    assert info.value.hint == "finish every backward before starting a new schedule"
    stash.update({"w": torch.ones(2)})
    stash.release(0)
    with pytest.raises(StashError) as info:
        stash.get(0)
    assert info.value.message == "weight version 0 is not held (held: [1])"
    assert info.value.hint == "the schedule reads a version that was dropped: pass planned_reads"


def test_rebase_starts_counting_from_zero_again() -> None:
    stash = WeightStash({"w": torch.ones(2, requires_grad=True)}, sgd, planned_reads={0: 1})
    stash.update({"w": torch.ones(2)})  # version 0 is planned to be read: kept
    assert stash.versions_held() == [0, 1]
    stash.rebase()
    assert stash.version == 0 and stash.versions_held() == [0] and stash.spare_bytes() == 0
    assert torch.allclose(stash.get(0)["w"], torch.full((2,), 0.9))  # the latest, renamed
    stash.set_planned_reads({0: 1})
    stash.update({"w": torch.ones(2)})
    assert stash.versions_held() == [0, 1]  # the new plan keeps version 0 alive


def test_without_stashing_the_backward_gets_the_latest() -> None:
    stash = WeightStash({"w": torch.ones(2, requires_grad=True)}, sgd, stashing=False)
    first = stash.acquire(0, 0)
    stash.update({"w": torch.ones(2)})
    version, weights = stash.for_backward(0)
    assert version == 1 and weights is stash.latest and weights["w"] is first["w"]  # in place
    assert stash.versions_held() == [1] and stash.bytes_held() == 8


# ----------------------------------------------------------------------------- memory
def test_a_dropped_versions_tensors_are_reused_by_the_next_copy() -> None:
    """Copy-on-write writes into the spare tensors of a version dropped earlier (one version's
    worth is kept, counted apart from bytes_held); an in-place update frees them."""
    stash = WeightStash({"w": torch.zeros(4, requires_grad=True),
                         "b": torch.zeros(2, requires_grad=True)}, sgd)
    stash.acquire(0, 0)
    stash.update({"w": torch.ones(4), "b": torch.ones(2)})  # v0 in flight: copied
    v0 = stash.get(0)
    assert stash.bytes_held() == 48 and stash.spare_bytes() == 0
    stash.release(0)  # v0 dropped: its tensors become the spares
    assert stash.versions_held() == [1] and stash.spare_bytes() == 24 and stash.bytes_held() == 24
    stash.acquire(1, 1)
    stash.update({"w": torch.ones(4), "b": torch.ones(2)})  # v1 in flight: copied into spares
    assert stash.latest["w"].data_ptr() == v0["w"].data_ptr()
    assert stash.latest["b"].data_ptr() == v0["b"].data_ptr()
    assert torch.allclose(stash.latest["w"], torch.full((4,), -0.2)) and stash.spare_bytes() == 0
    assert torch.allclose(stash.get(1)["w"], torch.full((4,), -0.1))  # untouched by the copy
    stash.release(1)
    assert stash.spare_bytes() == 24
    stash.update({"w": torch.ones(4), "b": torch.ones(2)})  # nobody reads v2: in place
    assert stash.spare_bytes() == 0 and stash.peak_bytes == 48


def test_a_dropped_versions_tensors_are_the_next_copys_targets() -> None:
    """A spare is kept by parameter name (a parameter's versions share its layout) and written
    by the next copy-on-write: no new tensor once every parameter has one."""
    w, v = torch.zeros(2, 3, requires_grad=True), torch.zeros(3, 2, requires_grad=True)
    stash = WeightStash({"w": w, "v": v.t()}, sgd)
    stash.acquire(0, 0)
    stash.update({"w": torch.ones(2, 3), "v": torch.ones(2, 3)})
    stash.release(0)
    spares = dict(stash._spare)
    assert spares.keys() == {"w", "v"} and spares["v"].shape == (2, 3)
    stash.acquire(1, 1)
    stash.update({"w": torch.ones(2, 3), "v": torch.ones(2, 3)})
    assert stash.latest["w"] is spares["w"] and stash.latest["v"] is spares["v"]
    assert torch.equal(stash.get(1)["w"], torch.full((2, 3), -0.1))  # the copy, not a reset


def test_bytes_held_counts_each_storage_once() -> None:
    base = torch.zeros(10)
    stash = WeightStash({"a": base[:5].requires_grad_(), "frozen": torch.zeros(3)}, sgd)
    assert stash.trainable == ("a",) and stash.bytes_held() == 20 + 12
    assert stash.spare_bytes() == 0 and stash.peak_bytes == 32


def test_a_stage_with_nothing_trainable_has_no_optimizer() -> None:
    stash = WeightStash({"frozen": torch.ones(3)}, sgd)
    assert stash.optimizer is None and stash.trainable == ()
    assert stash.update({}) == 1 and torch.equal(stash.latest["frozen"], torch.ones(3))


# ----------------------------------------------------------------------------- swapped_call
class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(2, 2, bias=False)
        self.b = nn.Linear(2, 2, bias=False)
        self.b.weight = self.a.weight
        self.register_buffer("scale", torch.tensor(2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x)) * self.scale


def test_slots_list_every_place_a_tensor_lives() -> None:
    from fxpipe.runtime.replica.stash import tensor_slots

    m = Tied()
    slots = dict(tensor_slots(m))
    assert sorted(slots) == ["a.weight", "scale"]  # the tied weight once, by its first name
    assert [attr for _, attr in slots["a.weight"]] == ["weight", "weight"]
    assert slots["scale"][0][0] is m._buffers
    from torch.nn.utils import parametrize

    class Double(nn.Module):
        def forward(self, w: torch.Tensor) -> torch.Tensor:
            return 2 * w

    # an unset (None) parameter or buffer is skipped, and whatever follows it still counted
    holes = nn.Module()
    holes.register_parameter("unset", None)
    holes.w = nn.Parameter(torch.ones(1))
    holes.register_buffer("nothing", None)
    holes.register_buffer("count", torch.zeros(1))
    assert sorted(dict(tensor_slots(holes))) == ["count", "w"]
    p = nn.Linear(2, 2)
    parametrize.register_parametrization(p, "weight", Double())
    assert tensor_slots(nn.Sequential(p)) is None


def test_swapped_call_uses_the_given_tensors_and_puts_the_originals_back() -> None:
    from fxpipe.runtime.replica.stash import swapped_call, tensor_slots

    m = Tied()
    slots = tensor_slots(m)
    x = torch.ones(1, 2)
    w = torch.eye(2)
    out = swapped_call(m, slots, ({"a.weight": w}, {"scale": torch.tensor(3.0)}), [x])
    assert torch.equal(out, 3 * x)  # both uses of the tied weight saw w, the buffer 3
    assert m.a.weight is m.b.weight and m.scale.item() == 2.0  # originals back
    # the second mapping wins over the first; names given nowhere keep the module's own
    out = swapped_call(m, slots, ({"a.weight": w, "scale": torch.tensor(5.0)},
                                  {"scale": torch.tensor(7.0)}), [x])
    assert torch.equal(out, 7 * x)
    want = m(x)
    assert torch.equal(swapped_call(m, slots, ({}, {}), [x]), want)
    with pytest.raises(RuntimeError):
        swapped_call(m, slots, ({"a.weight": torch.ones(3, 3)}, {}), [x])
    assert m.a.weight is m.b.weight and m.a.weight.shape == (2, 2)  # restored after an error


@pytest.mark.parametrize("device", [None, "cpu"])
def test_the_stash_owns_copies_of_the_weights_it_was_given(device: str | None) -> None:
    """A replica owns its weights: updating the stash never writes into the caller's tensors,
    also when the device asked for is the one they are already on."""
    given = torch.ones(2, requires_grad=True)
    stash = WeightStash({"w": given}, sgd, device=device)
    assert stash.latest["w"].data_ptr() != given.data_ptr()
    stash.update({"w": torch.ones(2)})  # in place: nothing in flight
    assert torch.equal(given.detach(), torch.ones(2))
    assert torch.allclose(stash.latest["w"], torch.full((2,), 0.9))


def test_the_stash_puts_the_weights_on_the_device_asked_for() -> None:
    """``device``: where the replica's weights live (the meta device stands in for an
    accelerator here: same code path, no storage)."""
    stash = WeightStash({"w": torch.ones(2, requires_grad=True), "b": torch.zeros(3)}, sgd,
                        device=torch.device("meta"))
    assert {n: t.device.type for n, t in stash.latest.items()} == {"w": "meta", "b": "meta"}
    assert stash.latest["w"].requires_grad and not stash.latest["b"].requires_grad
    assert stash.trainable == ("w",)


def test_the_peak_follows_the_most_versions_held_at_once() -> None:
    """The peak is re-summed only when more old versions are held than ever before (every
    copy holds the same bytes): 1, 2, 3, 4, then 2 old versions peak at 4 old versions plus
    the latest, and the one-call copy into spares gives each name its own values."""
    stash = WeightStash({"w": torch.zeros(4, requires_grad=True),
                         "b": torch.zeros(2, requires_grad=True)}, sgd)
    grads = {"w": torch.ones(4), "b": torch.ones(2)}
    held = []
    for k, drop in enumerate([0, 0, 0, 2, 2]):
        if k < 4:
            stash.acquire(k, None)  # minibatch k's forward reads the current version
        stash.update(grads)
        held.append(stash.bytes_held())
        for m in sorted(stash._inflight)[:drop]:
            stash.release(m)
    assert held == [48, 72, 96, 120, 72]  # the latest + 1, 2, 3, 4, 2 old versions (24 B each)
    assert stash.peak_bytes == max(held) == 120
    assert stash.versions_held() == [5] and stash.spare_bytes() == 24  # one version's spares
    want = torch.zeros(1, requires_grad=True)  # the same five steps on one plain parameter
    opt = sgd([want])
    for _ in range(5):
        want.grad = torch.ones(1)
        opt.step()
    assert torch.equal(stash.latest["w"], want.detach().expand(4))
    assert torch.equal(stash.latest["b"], want.detach().expand(2))
