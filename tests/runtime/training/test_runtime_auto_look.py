"""auto looks again later (runtime/training/auto_look.py): after an asynchronous pick on the
pipeline, a second race against 1f1b-flush from where the run has got to; the run equals the
same steps trained by name (the winner kept, or flush continuing from the winner's state), and
the second look is priced with the pilot."""
from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from rt_helpers import batches, loss_fn, split, tiny_mlp

import fxpipe.runtime.training.auto_look as auto_look
from fxpipe.runtime.errors import RuntimeConfigError
from fxpipe.runtime.training.auto import AutoOptions, Decision, Row
from fxpipe.runtime.training.auto_look import plan_look
from fxpipe.runtime.training.auto_pipeline import load_state, pilot_step, save_state
from fxpipe.runtime.training.trainer import Trainer

STAGES = [1, 1, 1]
OPTIONS = {"pilot": 24, "min_pilot": 8, "max_fraction": 1.0, "max_cost": None,
           "candidates": ("1f1b-flush", "pipedream"), "where": "pipeline", "look_again": 1.0}


def trainer(schedule: str, **kw) -> Trainer:
    return Trainer(split(tiny_mlp(), [1, 3]), STAGES, loss_fn,
                   lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.5), schedule=schedule,
                   executor="reference", progress=False, segment=8, **kw)


def positions(d: Decision) -> tuple[int, int, bool]:
    """(where auto looked again, where fit went on, whether the pick was kept), from its note."""
    note = d.later[-1]
    got = re.search(r"looked again at minibatch (\d+): .* (kept|fell back).* continues at "
                    r"minibatch (\d+)", note)
    assert got, note
    return int(got.group(1)), int(got.group(3)), got.group(2) == "kept"


def same(a: Trainer, b: Trainer) -> None:
    want, got = a.state_dict(), b.state_dict()
    assert set(want) == set(got)
    for n, t in want.items():
        assert torch.allclose(t, got[n], rtol=0, atol=1e-6), n


@pytest.mark.slow
def test_a_pick_still_ahead_is_kept_and_goes_on_from_its_race() -> None:
    """pipedream wins the pilot and, raced against flush again from minibatch L, is still
    ahead: the run equals pipedream trained by name with the pipeline drained where auto drains
    (the pilot's end c, L, and the end E of its second race); flush's race leaves no trace."""
    data = batches(120)
    auto = trainer("auto", auto_options=OPTIONS)
    auto.fit(data, epochs=1)
    d = auto.auto_decision
    assert d.schedule == "pipedream" and auto.schedule_name == "pipedream"
    L, E, kept = positions(d)
    c = d.continued
    assert kept and L == 2 * c and L < E <= L + 2 * d.pilot_minibatches
    named = trainer("pipedream")
    for a, b in ((0, c), (c, L), (L, E), (E, len(data))):  # each fit drains at its end
        named.fit(data[a:b], epochs=1)
    same(named, auto)


@pytest.mark.slow
def test_a_stalled_pick_falls_back_to_flush_from_its_own_state(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The second race's verdict forced to flush: the run equals pipedream by name to L, then
    flush (each minibatch cut in 3, as auto trains it) from pipedream's state at L, its race's
    minibatches trained once; fit goes on from the end of flush's race."""
    real = auto_look.decide
    monkeypatch.setattr(auto_look, "decide",
                        lambda *a, **k: replace(real(*a, **k), schedule="1f1b-flush"))
    data = batches(120)
    auto = trainer("auto", auto_options=OPTIONS)
    auto.fit(data, epochs=1)
    L, E, kept = positions(auto.auto_decision)
    c = auto.auto_decision.continued
    assert not kept and auto.schedule_name == "1f1b-flush" and auto.split == 3
    assert E == L + OPTIONS["pilot"]  # flush's race: its pilot's length
    named = trainer("pipedream")
    named.fit(data[:c], epochs=1)
    named.fit(data[c:L], epochs=1)
    flush = trainer("1f1b-flush", split=3)
    load_state(flush, save_state(named, tmp_path, "at-L"))
    flush.fit(data[L:E], epochs=1)
    flush.fit(data[E:], epochs=1)
    same(flush, auto)
    assert "fell back to 1f1b-flush" in auto.auto_decision.summary()


def test_the_second_look_is_planned_only_where_it_fits_and_pays() -> None:
    """plan_look: after an asynchronous pick on the pipeline only; in the first epoch with room
    for a race of 2P; and priced with the pilot against max_cost."""
    rows = (Row("1f1b-flush", 5.0, 9, 45, piloted=24), Row("pipedream", 3.0, 9, 27, piloted=16),
            Row("gpipe", 5.5, 9, 49.5, piloted=21))
    d = Decision("pipedream", "", rows, pilot_minibatches=24, where="pipeline", continued=16)
    opts = AutoOptions(**{**OPTIONS, "max_cost": 0.25})
    step = pilot_step(STAGES, None)
    assert step == 1  # one replica a stage, a minibatch an update
    assert plan_look(opts, d, 1000, 1000, 5)[0] == 16 + 20  # whole steps: 16 rounded up to 20
    assert plan_look(opts, d, 1000, 1000, step) == (32, "looks again at minibatch 32 of the "
                                                     "first epoch")
    assert plan_look(replace(opts, look_again=3.0), d, 1000, 1000, step)[0] == 64
    assert plan_look(replace(opts, look_again=0), d, 1000, 1000, step) == (None, "")
    assert plan_look(opts, replace(d, schedule="zb-h1"), 1000, 1000, step) == (None, "")
    assert plan_look(opts, replace(d, where="copies"), 1000, 1000, step) == (None, "")
    at, why = plan_look(opts, d, 32 + 47, 1000, step)
    assert at is None and "no room for a race of 48 minibatches after minibatch 32" in why
    assert plan_look(opts, d, None, None, step)[0] is None  # no length: no room known
    # by hand: the pilot's losers (flush's 24 x 5 s + pipedream's 16 x 3 s, less the cheaper
    # pipedream's; gpipe reused flush's curve and cost nothing) 120 s, plus a race of flush's
    # 24 x 5 s = 240 s, against a quarter of the run at flush's 5 s per minibatch
    assert plan_look(opts, d, 1000, 192, step)[0] == 32     # 240 <= 0.25 x 192 x 5 = 240
    at, why = plan_look(opts, d, 1000, 191, step)
    assert at is None and "max_cost=25%" in why


def test_look_again_must_be_a_number_of_pilots() -> None:
    with pytest.raises(RuntimeConfigError, match="look_again"):
        AutoOptions.make({"look_again": -1})


@pytest.mark.slow
def test_checkpoints_stay_on_their_multiples_after_the_pilot_and_the_second_look(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """checkpoint_every=8 and a flush pilot of 20: with the second race forced to flush, fit
    goes on from the end of flush's 20-minibatch race (not a multiple of 8); the first segment
    from there is cut short, so every checkpoint still falls on a multiple of 8 and they go on
    to the epoch's end. So does a flush winning the pilot itself (fit goes on from 20)."""
    real = auto_look.decide
    monkeypatch.setattr(auto_look, "decide",
                        lambda *a, **k: replace(real(*a, **k), schedule="1f1b-flush"))
    for candidates in (("1f1b-flush", "pipedream"), ("1f1b-flush",)):
        seen: list[tuple[int, int]] = []
        auto = Trainer(split(tiny_mlp(), [1, 3]), STAGES, loss_fn,
                       lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.5), schedule="auto",
                       executor="reference", progress=False,
                       checkpoint_dir=str(tmp_path / str(len(candidates))), checkpoint_every=8,
                       on_checkpoint=lambda e, p: seen.append((e, p)),
                       auto_options={**OPTIONS, "pilot": 20, "candidates": candidates})
        auto.fit(batches(120), epochs=1)
        d = auto.auto_decision
        end = positions(d)[1] if len(candidates) > 1 else d.continued
        assert end % 8, (candidates, end)  # the test needs a position off the multiples
        inside = [p for e, p in seen if e == 0]
        assert inside and all(p % 8 == 0 for p in inside), inside
        assert [p for p in inside if p > end][0] == end + 8 - end % 8
        assert max(inside) == 120


@pytest.mark.slow
@pytest.mark.parametrize("pick", ["pipedream+nesterov", "pipedream+lr_scale"])
def test_flush_goes_on_from_a_mitigated_picks_state_with_its_own_hyperparameters(
        pick: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A mitigation gives the pick another optimizer configuration (nesterov: Nesterov's form
    with a larger momentum; lr_scale: a smaller lr on the stale stages). Where flush takes over
    at the second look, it keeps the pick's weights, momenta and LR-schedule position but its
    own hyperparameters: the user's momentum, no Nesterov, and its own lr times the warm-up
    factor reached (carry_into; load_state_dict alone carried the pick's over)."""
    import fxpipe.runtime.training.auto_pipeline as auto_pipeline

    real_pilot, real_look = auto_pipeline.decide, auto_look.decide
    monkeypatch.setattr(auto_pipeline, "decide",
                        lambda *a, **k: replace(real_pilot(*a, **k), schedule=pick))
    monkeypatch.setattr(auto_look, "decide",
                        lambda *a, **k: replace(real_look(*a, **k), schedule="1f1b-flush"))

    def warmup(step: int) -> float:
        return min(1.0, (step + 1) / 200)

    def make(schedule: str, **kw) -> Trainer:
        return trainer(schedule, lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(
            opt, warmup), **kw)

    auto = make("auto", auto_options={**OPTIONS, "candidates": ("1f1b-flush", pick)})
    auto.fit(batches(120), epochs=1)
    assert auto.schedule_name == "1f1b-flush" and "fell back" in auto.auto_decision.later[-1]
    fresh = make("1f1b-flush", split=3)
    for rank, w in auto.local.items():
        steps = auto.schedulers[rank].last_epoch
        assert steps > 24  # flush's updates after the pilot, the pick's before
        for g, mine in zip(w.stash.optimizer.param_groups,
                           fresh.local[rank].stash.optimizer.param_groups):
            assert (g["momentum"], g["nesterov"]) == (0.5, False)
            assert g["initial_lr"] == mine["initial_lr"] == 0.05
            assert g["lr"] == pytest.approx(0.05 * warmup(steps))
        assert auto.schedulers[rank].base_lrs == [0.05] * len(w.stash.optimizer.param_groups)


@pytest.mark.slow
def test_carry_into_sets_flushs_lr_at_the_picks_point_of_the_schedule(tmp_path: Path) -> None:
    """Right after carry_into, before any update: flush's lr is its own initial lr times the
    factor the pick's warm-up had reached (lr_scale's pick ran at half that lr on stage 0)."""
    from fxpipe.runtime.training.auto_look import carry_into

    def warmup(step: int) -> float:
        return min(1.0, (step + 1) / 200)

    t = trainer("pipedream+lr_scale", lr_scheduler=lambda opt:
                torch.optim.lr_scheduler.LambdaLR(opt, warmup))
    t.fit(batches(30), epochs=1)
    steps = {r: s.last_epoch for r, s in t.schedulers.items()}
    picked = {r: [g["lr"] for g in w.stash.optimizer.param_groups] for r, w in t.local.items()}
    assert picked[(0, 0)][0] == pytest.approx(0.05 / 3 * warmup(steps[(0, 0)]))  # delay 2
    path = save_state(t, tmp_path, "pick")
    t.adopt("1f1b-flush", 3)
    carry_into(t, path)
    for r, w in t.local.items():
        for g in w.stash.optimizer.param_groups:
            assert g["lr"] == pytest.approx(0.05 * warmup(steps[r]))
        assert t.schedulers[r].last_epoch == steps[r]
