"""What the Trainer promises beyond exactness (one process, executor="reference"): learning-rate
schedules per optimizer update, modes given back after fit, loaders that would mis-pair inputs
and targets refused, state re-assembled from per-stage checkpoints.

Expected values come from plain torch written out here (no fxpipe code in the oracle)."""
from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.nn as nn
from rt_helpers import batches, loss_fn, split, tiny_mlp
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from fxpipe.runtime.training.data import ShardedDataset
from fxpipe.runtime.errors import RuntimeConfigError
from fxpipe.runtime.training.trainer import Trainer

TIGHT = dict(rtol=1e-6, atol=1e-7)
momentum = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)


def warmup(step: int) -> float:
    """Linear warm-up from 0 over 3 updates: the first update has learning rate 0."""
    return min(1.0, step / 3)


warmup_lr = functools.partial(torch.optim.lr_scheduler.LambdaLR, lr_lambda=warmup)


def test_per_update_lr_schedule_equals_plain_torch_under_1f1b_flush() -> None:
    """16 minibatches in batches of m = 4: four updates per epoch on every stage, each one the
    mean gradient of the batch (= one step on the concatenation), the scheduler stepped after
    every optimizer step, as a plain torch loop does. Stepped once per epoch instead (what
    fit did before), the warm-up would keep the learning rate at 0 for the whole first epoch."""
    data = batches(16)
    model = tiny_mlp()
    trainer = Trainer(split(copy.deepcopy(model), [2]), [1, 1], loss_fn, momentum,
                      lr_scheduler=warmup_lr, schedule="1f1b-flush", microbatches=4,
                      executor="reference", progress=False)
    trainer.fit(data, epochs=2)
    opt = momentum(model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup)
    for _ in range(2):
        for b in range(0, 16, 4):
            xs, ys = zip(*data[b:b + 4])
            opt.zero_grad()
            loss_fn(model(torch.cat(xs)), torch.cat(ys)).backward()
            opt.step()
            sched.step()
    got = trainer.state_dict()
    for name, p in model.named_parameters():
        torch.testing.assert_close(got[name], p.detach(), **TIGHT, msg=name)
    assert {r: s.last_epoch for r, s in trainer.schedulers.items()} == {(0, 0): 8, (1, 0): 8}


def test_pipedream_schedulers_follow_each_stages_own_updates() -> None:
    """Replicas [2, 1] under pipedream, 8 minibatches: each replica of stage 0 updates once per
    round of 2 (4 updates), stage 1 after every minibatch (8)."""
    trainer = Trainer(split(tiny_mlp(), [2]), [2, 1], loss_fn, momentum, lr_scheduler=warmup_lr,
                      executor="reference", progress=False)
    trainer.fit(batches(8), epochs=1)
    assert {r: s.last_epoch for r, s in trainer.schedulers.items()} == {
        (0, 0): 4, (0, 1): 4, (1, 0): 8}


def test_epoch_interval_on_request() -> None:
    data = batches(8)
    model = tiny_mlp()
    trainer = Trainer(split(model, [2]), [1, 1], loss_fn, momentum, lr_scheduler=warmup_lr,
                      lr_scheduler_interval="epoch", executor="reference", progress=False)
    before = copy.deepcopy(trainer.state_dict())
    trainer.fit(data, epochs=1)  # learning rate 0 all epoch long: nothing moves
    assert all(torch.equal(before[n], t) for n, t in trainer.state_dict().items())
    trainer.fit(data, epochs=2)  # two more epochs (no resume: counting from 0 again)
    assert {r: s.last_epoch for r, s in trainer.schedulers.items()} == {(0, 0): 3, (1, 0): 3}
    with pytest.raises(RuntimeConfigError, match="lr_scheduler_interval"):
        Trainer(split(tiny_mlp(), [2]), [1, 1], loss_fn, momentum, executor="reference",
                lr_scheduler_interval="batch")


class Noisy(nn.Module):
    """Linear, BatchNorm, Dropout, Linear: train and eval differ in two ways."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.bn, self.drop, self.b = (nn.Linear(4, 6), nn.BatchNorm1d(6),
                                              nn.Dropout(0.5), nn.Linear(6, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.drop(self.bn(self.a(x))))


@pytest.mark.parametrize("mode", ["eval", "mixed", "train"])
def test_fit_gives_back_every_modules_mode(mode: str) -> None:
    model = Noisy()
    if mode != "train":
        model.eval()
    if mode == "mixed":
        model.drop.train()
    stages = split(model, [2])
    before = [m.training for st in stages for m in st.gm.modules()]
    Trainer(stages, [1, 1], loss_fn, momentum, executor="reference",
            progress=False).fit(batches(4), epochs=1, eval_loader=batches(2))
    assert [m.training for st in stages for m in st.gm.modules()] == before
    assert model.drop.training is (mode != "eval") and model.bn.training is (mode == "train")


def test_evaluation_runs_in_eval_mode_with_the_trained_weights() -> None:
    """eval_loss is the loss of the trained model in eval mode (no dropout, running stats)."""
    model = Noisy()
    data, held = batches(6), batches(3, seed=7)
    trainer = Trainer(split(model, [2]), [1, 1], loss_fn, momentum, executor="reference",
                      progress=False)
    got = trainer.fit(data, epochs=1, eval_loader=held)[0]["eval_loss"]
    model.eval()
    with torch.no_grad():
        want = sum(float(loss_fn(model(x), y)) for x, y in held) / len(held)
    assert got == pytest.approx(want, rel=1e-6)


# ----------------------------------------------------------------------------- pairing
def test_a_distributed_sampler_is_refused_with_the_way_out() -> None:
    x, y = torch.randn(32, 4), torch.randn(32, 2)
    ds = TensorDataset(x, y)
    loader = DataLoader(ds, batch_size=4, sampler=DistributedSampler(ds, num_replicas=2, rank=0))
    trainer = Trainer(split(tiny_mlp(), [2]), [1, 1], loss_fn, momentum, executor="reference",
                      progress=False)
    with pytest.raises(RuntimeConfigError, match="shards the data by rank") as info:
        trainer.fit(loader, epochs=1)
    assert "SAME loader over the whole dataset" in (info.value.hint or "")
    trainer.fit(DataLoader(ds, batch_size=4, shuffle=True), epochs=1)  # the way out works
    one = DistributedSampler(ds, num_replicas=1, rank=0)  # one replica: a plain sampler
    trainer.fit(DataLoader(ds, batch_size=4, sampler=one), epochs=1)


def test_several_epochs_from_an_iterator_are_refused_with_the_way_out() -> None:
    """A generator can be read once: a second epoch from it trained nothing and reported a loss
    of 0. Several epochs from one are refused before training; one epoch per fit call, each
    from a fresh generator, trains them all."""
    data = batches(6)
    trainer = Trainer(split(tiny_mlp(), [2]), [1, 1], loss_fn, momentum, executor="reference",
                      progress=False)
    with pytest.raises(RuntimeConfigError, match=r"2 epochs from an iterator \(generator\)"):
        trainer.fit((b for b in data), epochs=2)
    assert trainer.history == []
    for _ in range(2):
        trainer.fit((b for b in data), epochs=1)
    assert [h["samples"] for h in trainer.history] == [24.0, 24.0]


def test_fingerprints_tell_whether_two_ranks_read_the_same_minibatches() -> None:
    from fxpipe.runtime.training.data import PartStream

    data = batches(5)
    twin = [(x.clone(), y.clone()) for x, y in data]
    other = [(x.clone(), y.clone()) for x, y in data]
    other[3][1][0, 1] += 1.0  # one label of one minibatch differs
    digests = []
    for loader, ins, tgt in ((data, True, False), (twin, False, True), (other, False, True)):
        stream = PartStream(loader, 0, 0, need_inputs=ins, need_targets=tgt)
        parts = [next(stream) for _ in range(5)]
        assert all((p[0] is None) != ins and (p[1] is None) != tgt for p in parts)
        digests.append(stream.digest())
    assert digests[0] == digests[1] != digests[2]
    sharded = PartStream(ShardedDataset(torch.randn(8, 4), torch.randn(8, 2), batch_size=4),
                         0, 0, need_inputs=True, need_targets=False)
    assert sharded.digest() is None  # pairing by construction (one seeded order)


# ----------------------------------------------------------------------------- state
def test_per_stage_checkpoints_reassemble_into_the_whole_model(tmp_path) -> None:
    from fxpipe.runtime.training.checkpoint import load_model_state

    model = Noisy()
    trainer = Trainer(split(model, [1, 3]), [1, 1, 1], loss_fn, momentum, executor="reference",
                      checkpoint_dir=str(tmp_path), progress=False)
    trainer.fit(batches(6), epochs=1)
    got = load_model_state(tmp_path)
    want = trainer.state_dict()
    assert set(got) == set(want) == set(model.state_dict())
    for name, t in want.items():
        assert torch.equal(got[name], t), name
    fresh = Noisy()
    fresh.load_state_dict(got)
    assert torch.equal(fresh.bn.running_mean, model.bn.running_mean)


def test_forward_returns_the_loss_on_the_device_not_a_number() -> None:
    """A Python float would make a GPU wait for every forward; the runtime reads losses once
    per segment."""
    from fxpipe.runtime.replica.stage import StageReplica

    (spec,) = split(tiny_mlp(), [])
    x, y = batches(1)[0]
    _, loss = StageReplica(spec, momentum, loss_fn=loss_fn).forward(0, None, [x], y)
    assert isinstance(loss, torch.Tensor) and loss.dim() == 0 and not loss.requires_grad


@pytest.mark.slow
def test_export_traced_model_trains_in_the_modes_it_has_as_plain_pytorch_does() -> None:
    """The Hugging Face path (torch.export): fit trains in the modes the user's modules have,
    as a plain loop does (issue 23: it used to switch everything to train mode): a model handed
    over in eval mode trains in eval mode (BatchNorm's statistics untouched), one put back in
    train mode trains in train mode; evaluation runs in eval mode and gives the modes back."""
    from fxpipe.codegen.split import placed_nodes, split_graph
    from fxpipe.tracing.trace import trace

    model = Noisy().eval()
    data, held = batches(6), batches(3, seed=7)
    gm = trace(model, (data[0][0],), method="export").gm
    nodes = placed_nodes(gm)
    stages = split_graph(gm, {n.name: int(i > len(nodes) // 2) for i, n in enumerate(nodes)})
    before = [m.training for st in stages for m in st.gm.modules()]
    trainer = Trainer(stages, [1, 1], loss_fn, momentum, executor="reference", progress=False)
    got = trainer.fit(data, epochs=1, eval_loader=held)[0]["eval_loss"]
    assert [m.training for st in stages for m in st.gm.modules()] == before
    assert not model.bn.training and not model.drop.training
    assert int(model.bn.num_batches_tracked) == 0  # eval mode: no statistics updated
    with torch.no_grad():
        want = sum(float(loss_fn(model(x), y)) for x, y in held) / len(held)
    assert got == pytest.approx(want, rel=1e-6)
    model.train()
    trainer = Trainer(stages, [1, 1], loss_fn, momentum, executor="reference", progress=False)
    trainer.fit(data, epochs=1, eval_loader=held)
    assert model.bn.training and model.drop.training  # given back after evaluation
    assert int(model.bn.num_batches_tracked) == 6  # one per training minibatch, none in eval


@pytest.mark.slow
def test_default_segments_ramp_up_in_whole_update_groups() -> None:
    """Without segment/checkpoint_every: 8, 16, 32, ... minibatches, then 256 at a time (one
    segment's minibatches in memory, training starting after 8 are read); with m = 6
    microbatches every boundary falls on a batch boundary (12, 24, 48, ... then 258)."""
    def sizes(trainer: Trainer, n: int) -> list[int]:
        out, pos = [], 0
        while pos < n:
            out.append(trainer._segment_at(pos))
            pos += out[-1]
        return out

    flat = Trainer(split(tiny_mlp(), [2]), [1, 1], loss_fn, momentum, executor="reference")
    assert sizes(flat, 1000) == [8, 16, 32, 64, 128, 256, 256, 256]
    flush = Trainer(split(tiny_mlp(), [2]), [1, 1], loss_fn, momentum, executor="reference",
                    schedule="1f1b-flush", microbatches=6)
    assert sizes(flush, 500) == [12, 24, 48, 96, 192, 258]
    fixed = Trainer(split(tiny_mlp(), [2]), [1, 1], loss_fn, momentum, executor="reference",
                    segment=5)
    assert sizes(fixed, 12) == [5, 5, 5]
