"""schedule="auto" costs what training costs: its pilot streams its minibatches a training segment
at a time (runtime/training/auto_data.py) instead of holding them all, and its copies of the model
are priced against the rank's memory before anything is read or copied (auto_memory.py)."""
from __future__ import annotations

import logging
import weakref
from pathlib import Path
from typing import Iterator

import pytest
import torch
from rt_helpers import batches, loss_fn, split, tiny_mlp

import fxpipe.runtime.training.auto as auto_mod
import fxpipe.runtime.training.auto_resolve as resolve_mod
from fxpipe.runtime.errors import RuntimeConfigError
from fxpipe.runtime.training import auto_memory
from fxpipe.runtime.training.auto import AutoOptions, choose, pilot
from fxpipe.runtime.training.auto_data import PilotData
from fxpipe.runtime.training.auto_memory import GRADIENT_COPIES, copy_bytes, stage_bytes
from fxpipe.runtime.training.trainer import Trainer
from fxpipe.units import format_bytes



def SGD(ps: list) -> torch.optim.Optimizer:
    return torch.optim.SGD(ps, lr=0.05, momentum=0.5)


OPTS = {"pilot": 48, "min_pilot": 40, "max_fraction": 1.0, "max_cost": None,
        "candidates": ("1f1b-flush", "pipedream"), "where": "copies"}  # the pilot on copies


class Live:
    """A loader with ``iter_parts`` (as ShardedDataset) whose minibatches report when they die:
    ``live`` is how many exist now, ``peak`` the most that existed at once while ``watching``."""

    def __init__(self, n: int) -> None:
        self.data = batches(n, batch=6)
        self.live = self.peak = self.reads = 0
        self.watching = False

    def __len__(self) -> int:
        return len(self.data)

    def _gone(self) -> None:
        self.live -= 1

    def iter_parts(self, epoch: int, need_inputs: bool, need_targets: bool,
                   start: int = 0) -> Iterator[tuple]:
        for x, y in self.data[start:]:
            x = x.clone()  # a new tensor per read, as a loader makes them
            weakref.finalize(x, self._gone)
            self.live += 1
            self.reads += 1
            if self.watching:
                self.peak = max(self.peak, self.live)
            yield (x if need_inputs else None, y if need_targets else None)

    def __iter__(self) -> Iterator[tuple]:
        return self.iter_parts(0, True, True)


def trainer(**kw) -> Trainer:
    return Trainer(split(tiny_mlp(), [1, 3]), [1, 1, 1], loss_fn, SGD, schedule="auto",
                   executor="reference", progress=False, **kw)


@pytest.mark.slow
def test_the_pilot_holds_no_more_minibatches_than_a_segment() -> None:
    """Training holds one segment (8 minibatches here); while auto decides, so does the pilot
    (before: all 48 of the pilot at once), plus the minibatches still in flight from the
    segment before (3 on 3 stages: the pipeline does not drain at a segment's end, and the first
    layer's backward keeps each one's input). Each trained candidate reads the pilot again."""
    loader = Live(96)
    loader.watching = True
    decided = []

    def report(d: object) -> None:  # the end of the decision: what was read and held until then
        loader.watching = False
        decided.append(loader.reads)

    t = trainer(segment=8, auto_options={**OPTS, "report": report})
    t.fit(loader, epochs=1)
    d = t.auto_decision
    assert d.pilot_minibatches == 48 and {r.schedule for r in d.rows} == set(OPTS["candidates"])
    assert 0 < loader.peak <= 8 + 3
    piloted = {r.schedule: r.piloted for r in d.rows}
    assert piloted["1f1b-flush"] == 48 < piloted["pipedream"] <= 96  # flush's seconds
    assert decided == [48 + piloted["pipedream"] + 1]  # a pass per trained candidate, and the
    # first minibatch once more, on which the trainer tests how to cut (trainer_cut)
    assert "memory: the largest pilot copy" in d.summary()


@pytest.mark.slow
def test_streaming_keeps_the_curves() -> None:
    """One chunk: the curves of a list, bit for bit. Chunks of a segment: the same curves too:
    flush's (every minibatch is a complete update) and pipedream's, which runs on across chunk
    ends as training does across segment ends (issue 27; it used to drain at each)."""
    data = batches(48, batch=6)
    stages = split(tiny_mlp(), [1, 3])
    cands = OPTS["candidates"]
    whole, _ = pilot(stages, [1, 1, 1], loss_fn, SGD, data, cands)
    loader = Live(48)
    one, _ = pilot(stages, [1, 1, 1], loss_fn, SGD, PilotData(loader, 48, chunk=256), cands)
    assert one == whole
    eight, _ = pilot(stages, [1, 1, 1], loss_fn, SGD, PilotData.held(data, chunk=8), cands)
    assert eight["1f1b-flush"] == whole["1f1b-flush"]
    assert eight["pipedream"] == whole["pipedream"] and len(eight["pipedream"]) == 48


def test_a_loader_that_changes_between_passes_is_refused() -> None:
    class Drifting:  # another order each time it is iterated: candidates would see other data
        def __init__(self) -> None:
            self.passes = 0

        def __len__(self) -> int:
            return 48

        def __iter__(self) -> Iterator[tuple]:
            self.passes += 1
            return iter(batches(48, seed=self.passes))

    data = PilotData(Drifting(), 48, chunk=16)
    with pytest.raises(RuntimeConfigError, match="different minibatches when auto's pilot"):
        pilot(split(tiny_mlp(), [1, 3]), [1, 1, 1], loss_fn, SGD, data, OPTS["candidates"])


class OnePass:
    """A stream: everything on its first iteration, nothing after."""

    def __init__(self, data: list) -> None:
        self.data, self.used = data, False

    def __iter__(self) -> Iterator[tuple]:
        if self.used:
            return iter(())
        self.used = True
        return iter(self.data)


@pytest.mark.slow
def test_passes_of_different_lengths_are_checked_against_each_other() -> None:
    """Each candidate reads its own number of minibatches (auto.pilot_lengths: flush's seconds),
    from views of one PilotData: every pass is still compared with the others where their
    chunks are whole, and one that finds fewer minibatches than an earlier pass read is
    refused (before, a stream read once left every candidate after the first an empty curve)."""
    cands, lengths = ("1f1b-flush", "pipedream"), {"1f1b-flush": 24, "pipedream": 40}
    steady = batches(48)
    curves, _ = pilot(split(tiny_mlp(), [1, 3]), [1, 1, 1], loss_fn, SGD,
                      PilotData(steady, 48, chunk=16), cands, lengths=lengths)
    assert [len(curves[c]) for c in cands] == [24, 40]
    alone, _ = pilot(split(tiny_mlp(), [1, 3]), [1, 1, 1], loss_fn, SGD, steady[:40],
                     ("pipedream",))
    assert curves["pipedream"] == alone["pipedream"]

    class Drifting:  # another order each time it is iterated
        passes = 0

        def __len__(self) -> int:
            return 48

        def __iter__(self) -> Iterator[tuple]:
            Drifting.passes += 1
            return iter(batches(48, seed=Drifting.passes))

    with pytest.raises(RuntimeConfigError, match="different minibatches when auto's pilot"):
        pilot(split(tiny_mlp(), [1, 3]), [1, 1, 1], loss_fn, SGD,
              PilotData(Drifting(), 48, chunk=16), cands, lengths=lengths)
    stream = PilotData(OnePass(steady), 48, chunk=16)
    assert stream.count() == 48  # as auto.choose counts first: a whole pass
    with pytest.raises(RuntimeConfigError, match="gave 0 minibatches when auto's pilot read it "
                       "again, 24 before"):
        pilot(split(tiny_mlp(), [1, 3]), [1, 1, 1], loss_fn, SGD, stream, cands,
              lengths=lengths)


@pytest.mark.slow
@pytest.mark.parametrize("where", ["copies", "pipeline"])
def test_a_generator_trains_flush_without_a_pilot_and_a_stream_is_refused(where: str) -> None:
    """A generator (an iterator: one pass) gets no pilot: auto trains 1f1b-flush on every
    minibatch of it (before, the pilot read the minibatches and the run trained what was left:
    7 of 120 on copies). A re-iterable stream that gives nothing the second time is a clear
    error on either pilot, not a run on part of the data."""
    opts = {**OPTS, "pilot": 24, "min_pilot": 8, "max_fraction": 0.5, "where": where}
    data = batches(120)
    t = trainer(auto_options=opts)
    t.fit((b for b in data), epochs=1)
    assert t.schedule_name == "1f1b-flush" and "the loader is an iterator" in \
        t.auto_decision.reason
    assert t.history[0]["samples"] == sum(len(x) for x, _ in data)
    with pytest.raises(RuntimeConfigError, match="when auto's pilot read it again"):
        trainer(auto_options=opts).fit(OnePass(data), epochs=1)


def test_the_estimate_by_hand() -> None:
    stages = split(tiny_mlp(), [1, 3])  # 4x8 + 8, 8x8 + 8, 8x2 + 2 floats
    sizes = stage_bytes(stages)
    assert sizes == [(160, 160, True), (288, 288, True), (72, 72, True)]
    sgd = auto_memory.optimizer_state_factor(SGD, stages)
    adam = auto_memory.optimizer_state_factor(lambda ps: torch.optim.Adam(ps), stages)
    plain = auto_memory.optimizer_state_factor(lambda ps: torch.optim.SGD(ps, lr=0.1), stages)
    assert (sgd, adam, plain) == (1.0, 2.0, 0.0)
    weights = 160 + 288 + 72
    flush = copy_bytes("1f1b-flush", sizes, [1, 1, 1], sgd)
    assert flush == weights * (1 + GRADIENT_COPIES + 1)  # shared modules: the replicas' copies
    # pipedream on 3 stages: delays 2, 1, 0: d + 1 extra versions where d > 0
    assert copy_bytes("pipedream", sizes, [1, 1, 1], sgd) == flush + 3 * 160 + 2 * 288
    assert copy_bytes("1f1b-flush", sizes, [1, 1, 1], sgd, activations=100.0) == flush + 100
    assert copy_bytes("pipedream", sizes, [1, 1, 1], sgd, activations=100.0) == \
        flush + 3 * 160 + 2 * 288 + 300  # a minibatch in flight per stage


@pytest.mark.slow
def test_a_pilot_that_does_not_fit_is_not_run(caplog) -> None:
    """The pilot's copies priced against what the rank has (injected here), before anything is
    read: too little, and auto takes flush with both figures in its reason (and the log)."""
    loader = Live(96)
    decided = []
    t = trainer(auto_options={**OPTS, "available_bytes": lambda: 4000,
                              "report": lambda d: decided.append(loader.reads)})
    with caplog.at_level(logging.WARNING, logger="fxpipe.runtime.training.auto"):
        t.fit(loader, epochs=1)
    d = t.auto_decision
    need, _ = auto_memory.rank_estimate(OPTS["candidates"], t.stages, t.replicas, t.optimizer)
    assert (t.schedule_name, d.rows) == ("1f1b-flush", ())
    assert f"about {format_bytes(need)} on rank 0" in d.reason
    assert "more than 75% of the 4 KB available" in d.reason
    assert d.reason in d.summary() and "no pilot" in caplog.text
    assert decided == [0]  # the pilot read nothing
    roomy = trainer(auto_options={**OPTS, "available_bytes": lambda: need * 2})
    roomy.fit(Live(96), epochs=1)
    assert roomy.auto_decision.rows and "at least" in roomy.auto_decision.summary()
    unknown = trainer(auto_options={**OPTS, "available_bytes": lambda: None})
    unknown.fit(Live(96), epochs=1)
    assert unknown.auto_decision.rows and "not checked" in unknown.auto_decision.summary()


@pytest.mark.slow
def test_a_pilot_dearer_than_a_fifth_of_training_is_not_run() -> None:
    """max_memory: the copies may add at most that share of what the rank's training holds
    (its resident memory plus its replicas' gradients and optimizer state)."""
    stages = split(tiny_mlp(), [1, 3])
    assert auto_memory.training_bytes(stages, [0, 1, 2], 1.0, resident=10**6) == \
        10**6 + (160 + 288 + 72) * (GRADIENT_COPIES + 1)
    assert auto_memory.training_bytes(stages, [2], 1.0, resident=0) == 72 * (GRADIENT_COPIES + 1)
    assert auto_memory.resident_bytes() > 0
    t = trainer(auto_options={**OPTS, "max_memory": 1e-9})
    t.fit(Live(96), epochs=1)
    d = t.auto_decision
    assert (t.schedule_name, d.rows) == ("1f1b-flush", ())
    assert "more than max_memory=0% of the" in d.reason and "its training holds" in d.reason
    off = trainer(auto_options={**OPTS, "max_memory": None, "memory_margin": None})
    off.fit(Live(96), epochs=1)
    assert off.auto_decision.rows and "memory:" not in off.auto_decision.summary()


def test_every_rank_makes_the_same_call(monkeypatch) -> None:
    """One rank short of memory stops the pilot on all of them (the figures are exchanged),
    and the reason names that rank."""
    t = trainer(auto_options={**OPTS, "available_bytes": lambda: 10**12})
    monkeypatch.setattr(t.backend, "exchange",
                        lambda obj, what: [obj, (obj[0], 10, obj[2], "its copy")]
                        if what == "auto: pilot memory" else [obj])
    opts = AutoOptions.make({**OPTS, "available_bytes": lambda: 10**12})
    d, _ = resolve_mod.pilot_memory(t, opts)
    assert d is not None and d.schedule == "1f1b-flush" and "on rank 1 (its copy)" in d.reason


def test_a_rank_without_candidates_does_not_probe(monkeypatch) -> None:
    """3 ranks, 2 trained candidates: rank 2 trains none, so it neither probes (its 0 s does
    not count: the price takes the slowest rank's) nor copies the model."""
    stages = split(tiny_mlp(), [1, 3])
    opts = AutoOptions(pilot=48, min_pilot=40, max_cost=0.25, candidates=OPTS["candidates"])

    def no_probe(*a, **kw):
        raise AssertionError("a rank with nothing to train probed")

    monkeypatch.setattr(auto_mod, "probe", no_probe)
    flat = [1.0] * 48
    seen = []

    def gather(obj, what):
        seen.append((what, obj))
        if what == "auto: pilot probe":
            return [1e-6, 1e-6, obj]
        return [({"1f1b-flush": flat}, {}), ({"pipedream": flat}, {}), obj]

    d = choose(stages, [1, 1, 1], loss_fn, SGD, batches(48), opts, share=(2, 3), gather=gather,
               run_minibatches=10**6)
    assert seen == [("auto: pilot probe", 0.0), ("auto: pilot curves", ({}, {}))]
    assert d.pilot_ranks == 2 and len(d.rows) == 2


def test_available_memory(monkeypatch, tmp_path: Path) -> None:
    if Path("/proc/meminfo").exists():
        assert auto_memory.host_available() > 0
    monkeypatch.setattr(auto_memory, "host_available", lambda: 8000)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # two ranks on this host run pilots at once
    assert auto_memory.available_bytes() == 4000
    (tmp_path / "memory.max").write_text("1000000\n")
    (tmp_path / "memory.current").write_text("700000\n")
    (tmp_path / "memory.stat").write_text("anon 500000\ninactive_file 100000\n")
    assert auto_memory._cgroup_room(tmp_path) == 400000  # page cache that can go is room
    (tmp_path / "memory.max").write_text("max\n")
    assert auto_memory._cgroup_room(tmp_path) is None
