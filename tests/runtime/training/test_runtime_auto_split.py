"""schedule="auto" keeps the user's samples per update: a microbatched schedule it picks cuts each
of the loader's minibatches into sum(replicas) microbatches (runtime/training/minibatch.cut_part, along the tested batch dimensions), so the run
updates once per minibatch, as pipedream does and as torch.distributed.pipelining splits a step's
batch. Checked against hand-written pieces, plain single-process SGD on the whole minibatches,
and the explicit schedule fed the same microbatches by the loader."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from rt_helpers import batches, loss_fn, split, tiny_mlp

from fxpipe.runtime.training.auto import pilot
from fxpipe.runtime.training.minibatch import CutSpec, cut_part
from fxpipe.runtime.errors import RuntimeConfigError
from fxpipe.runtime.training.trainer import Trainer

LR, MOMENTUM = 0.05, 0.5


def opt(ps):
    return torch.optim.SGD(ps, lr=LR, momentum=MOMENTUM)


def trainer(schedule: str, cuts: list[int] | None = None, **kw) -> Trainer:
    cuts = [1, 3] if cuts is None else cuts
    return Trainer(split(tiny_mlp(), cuts), [1] * (len(cuts) + 1), loss_fn, opt,
                   schedule=schedule, executor="reference", progress=False, **kw)


def plain(data: list) -> dict[str, torch.Tensor]:
    """Ordinary training, one optimizer step per whole minibatch (the oracle)."""
    model = tiny_mlp()
    o = opt(list(model.parameters()))
    for x, y in data:
        o.zero_grad()
        loss_fn(model(x), y).backward()
        o.step()
    return {n: p.detach() for n, p in model.named_parameters()}


def test_cut_part_by_hand() -> None:
    """Tensors with a batch dimension are cut along it (tensor_split sizes), the others go
    whole; structure kept; a rank holding only targets cuts them alike."""
    x = torch.arange(10.0).reshape(5, 2)
    y = torch.arange(5)
    mask = torch.ones(2, 2)  # no batch dimension: every microbatch gets it whole
    part = ((x, {"ids": y * 10, "scale": 3.0, "mask": mask}), y)
    spec = CutSpec({"[0][0]": 0, "[0][1]['ids']": 0, "[0][1]['mask']": None}, {"": 0})
    got = cut_part(part, 3, 5, spec)  # tensor_split: 2, 2 and 1 rows
    rows = [[0, 1], [2, 3], [4]]
    assert len(got) == 3
    for (inputs, target), r in zip(got, rows):
        assert torch.equal(inputs[0], torch.tensor([[2.0 * i, 2.0 * i + 1] for i in r]))
        assert torch.equal(inputs[1]["ids"], torch.tensor([10 * i for i in r]))
        assert inputs[1]["scale"] == 3.0 and inputs[1]["mask"] is mask
        assert torch.equal(target, torch.tensor(r))
    assert cut_part(part, 1, 5, spec) == [part]
    only_targets = cut_part((None, y), 2, 5, spec)  # a rank that holds the targets alone
    assert [t.tolist() for _, t in only_targets] == [[0, 1, 2], [3, 4]]
    assert [i for i, _ in only_targets] == [None, None]
    with pytest.raises(RuntimeConfigError, match="minibatch of 2 sample.*into 3 microbatches"):
        cut_part(((x[:2],), y[:2]), 3, 2, spec)
    with pytest.raises(RuntimeConfigError, match=r"batch dimension 0 should hold the "
                                                 r"minibatch's 4 samples"):
        cut_part(((x, {"ids": y, "scale": 1.0, "mask": mask}), y), 2, 4, spec)


@pytest.mark.slow
def test_auto_flush_updates_once_per_minibatch_of_the_loader(tmp_path: Path) -> None:
    data = batches(12, batch=6)  # 3 stages: each minibatch as 3 microbatches of 2
    auto = trainer("auto", auto_options={"pilot": 0}, checkpoint_dir=str(tmp_path))
    auto.fit(data, epochs=1)
    d = auto.auto_decision
    assert (auto.schedule_name, d.split, auto.split) == ("1f1b-flush", 3, 3)
    assert "each minibatch cut into 3 microbatches" in d.summary()
    want = plain(data)  # equal microbatches: the mean of their mean gradients is the minibatch's
    got = auto.state_dict()
    assert set(got) == set(want)
    for n, t in want.items():
        torch.testing.assert_close(got[n], t, rtol=1e-5, atol=1e-6, msg=n)
    # the same microbatches from the loader with an explicit schedule: the same numbers
    micro = [(x[i:i + 2], y[i:i + 2]) for x, y in data for i in (0, 2, 4)]
    named = trainer("1f1b-flush", microbatches=3)
    named.fit(micro, epochs=1)
    for n, t in named.state_dict().items():
        assert torch.equal(t, got[n]), n
    manifest = json.loads(next(tmp_path.glob("*/manifest.json")).read_text())
    assert manifest["split"] == 3 and manifest["schedule"] == "1f1b-flush"


@pytest.mark.slow
def test_auto_keeps_the_users_microbatches_and_refuses_short_minibatches() -> None:
    data = batches(12, batch=6)
    given = trainer("auto", auto_options={"pilot": 0}, microbatches=3)
    given.fit(data, epochs=1)  # the loader's minibatches are the microbatches: no cutting
    assert (given.schedule_name, given.split, given.auto_decision.split) == ("1f1b-flush", 1, 1)
    named = trainer("1f1b-flush", microbatches=3)
    named.fit(data, epochs=1)
    for n, t in named.state_dict().items():
        assert torch.equal(t, given.state_dict()[n]), n
    # a short last minibatch (a loader without drop_last) is the segment's last, partial update
    tail = data[:3] + batches(1, batch=2, seed=5)
    short = trainer("auto", auto_options={"pilot": 0})
    short.fit(tail, epochs=1)
    for n, t in plain(tail).items():
        torch.testing.assert_close(short.state_dict()[n], t, rtol=1e-5, atol=1e-6, msg=n)
    early = trainer("auto", auto_options={"pilot": 0})  # a short one inside a segment: refused
    with pytest.raises(RuntimeConfigError, match="(?s)minibatch of 2 sample.*microbatches="):
        early.fit(tail[::-1], epochs=1)


@pytest.mark.slow
def test_one_worker_trains_plain_steps_without_a_pilot(tmp_path: Path) -> None:
    """One stage on one worker: no pilot, the schedule its plan is priced for (1f1b-flush, an
    update a minibatch, nothing cut), equal to plain steps."""
    data = batches(8, batch=6)
    t = trainer("auto", cuts=[])
    t.fit(data, epochs=1)
    d = t.auto_decision
    assert (t.schedule_name, t.split, d.rows) == ("1f1b-flush", 1, ())
    assert "one worker" in d.reason
    assert "no cut: an update after every minibatch, on every stage" in t.recipe()
    want = plain(data)
    for n, v in t.state_dict().items():
        torch.testing.assert_close(v, want[n], rtol=1e-6, atol=1e-7, msg=n)
    # a resumed run keeps the checkpoint's schedule, one stage or not
    first = trainer("pipedream", cuts=[], checkpoint_dir=str(tmp_path))
    first.fit(data, epochs=1)
    again = trainer("auto", cuts=[], checkpoint_dir=str(tmp_path))
    again.fit(data, epochs=2, resume=True)
    assert again.schedule_name == "pipedream" and "checkpoint" in again.auto_decision.reason


@pytest.mark.slow
def test_the_pilot_leaves_out_a_minibatch_too_small_to_cut() -> None:
    """A pilot may span epochs, so an epoch's short last minibatch can sit inside it: every
    candidate's pilot leaves it out (flush's baseline is not lost, the curves stay aligned)."""
    sgd = lambda ps: torch.optim.SGD(ps, lr=0.05)  # noqa: E731
    whole = batches(10, batch=6)
    data = whole[:5] + batches(1, batch=2, seed=9) + whole[5:]  # 2 samples, 3 stages
    cands = ("1f1b-flush", "pipedream")
    got, notes = pilot(split(tiny_mlp(), [1, 3]), [1, 1, 1], loss_fn, sgd, data, cands)
    want, _ = pilot(split(tiny_mlp(), [1, 3]), [1, 1, 1], loss_fn, sgd, whole, cands)
    assert notes == {} and set(got) == set(cands)
    for c in cands:
        assert len(got[c]) == 10 and got[c] == want[c], c
    with pytest.raises(RuntimeConfigError, match="cannot tell which dimension of the model inputs"):
        pilot(split(tiny_mlp(), [1, 3]), [1, 1, 1], loss_fn, sgd,
              [((3.0,), y) for _, y in whole], cands)
