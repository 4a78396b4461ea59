"""schedule="auto" (fxpipe.runtime.training.auto): the decision rule on hand-made curves, the
simulated throughputs, and the trainer adopting the choice without perturbing training."""
from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch
from rt_helpers import batches, loss_fn, split, tiny_mlp

from fxpipe.runtime.training.auto import (AutoOptions, Level, budget, can_stop, choose, decide,
                                          equal_time, merge, periods, pilot, pilot_lengths,
                                          share_of, smooth, to_level)
from fxpipe.runtime.errors import RuntimeConfigError
from fxpipe.runtime.training.trainer import Trainer

P = 80


def line(start: float, end: float, n: int = P) -> list[float]:
    return [start + (end - start) * i / (n - 1) for i in range(n)]


def test_async_wins_when_throughput_beats_its_inefficiency() -> None:
    flush = line(2.0, 1.0)
    fast = [max(1.0, x) for x in line(2.0, 0.0)]  # twice the loss drop per minibatch
    d = decide({"1f1b-flush": flush, "gpipe": flush, "pipedream": fast},
               {"1f1b-flush": 2.0, "gpipe": 2.2, "pipedream": 1.0})
    rows = {r.schedule: r for r in d.rows}
    assert d.schedule == "pipedream" and "faster" in d.reason
    assert rows["pipedream"].minibatches < rows["1f1b-flush"].minibatches
    assert rows["pipedream"].time_s == rows["pipedream"].minibatches * 1.0


def test_a_near_tie_goes_to_the_synchronous_schedule() -> None:
    flush = line(2.0, 1.0)
    d = decide({"1f1b-flush": flush, "pipedream": flush}, {"1f1b-flush": 1.0, "pipedream": 0.97})
    assert d.schedule == "1f1b-flush" and "wins the tie" in d.reason


def test_diverged_and_slow_candidates() -> None:
    flush = line(2.0, 1.0)
    half = line(2.0, 1.5)  # half of flush's drop within the pilot: never reaches the level
    w = max(5, P // 8)
    level = sum(flush[-w:]) / w
    assert to_level(half, level, w) == math.inf
    assert to_level(flush, smooth(flush, w)[-1], w) == P  # the baseline: at the end
    assert to_level([math.nan] * P, level, w) == math.inf
    # however much faster per minibatch, a candidate that has not reached the level loses
    d = decide({"1f1b-flush": flush, "pipedream": half}, {"1f1b-flush": 1.0, "pipedream": 0.01})
    assert d.schedule == "1f1b-flush"
    d = decide({"1f1b-flush": flush, "pipedream": [math.inf] * P},
               {"1f1b-flush": 1.0, "pipedream": 0.1})
    assert d.schedule == "1f1b-flush"
    with pytest.raises(RuntimeConfigError, match="baseline"):
        decide({"pipedream": flush}, {"pipedream": 1.0})


def test_a_pilot_shorter_than_the_window_reaches_its_own_level() -> None:
    """Four minibatches of flush (fewer than the 5-minibatch smoothing window): the level is
    their mean, which flush reaches at its 4th; before, its count was never and the reason
    said 'infx faster'."""
    flush = [2.0, 1.8, 1.6, 1.4]
    level = Level.of(flush)
    assert (level.level, level.window) == (pytest.approx(1.7), 4)
    assert level.minibatches(flush) == 4
    d = decide({"1f1b-flush": flush, "pipedream": [2.0, 1.8, 1.4, 1.2, 1.0, 0.9]},
               {"1f1b-flush": 3.0, "pipedream": 2.0})
    assert d.schedule == "pipedream" and "inf" not in d.reason
    assert {r.schedule: r.minibatches for r in d.rows} == {"1f1b-flush": 4, "pipedream": 4}


def test_equal_time_by_hand() -> None:
    """The baseline's seconds (100 x 2.0 s) bound every candidate's minibatches, as do their
    own lengths; a slower candidate gets fewer, never fewer than one."""
    per = {"1f1b-flush": 2.0, "pipedream": 1.2, "slow": 4.0, "huge": 1e9}
    got = equal_time({"1f1b-flush": 100, "pipedream": 500, "slow": 100, "huge": 100}, per)
    assert got == {"1f1b-flush": 100, "pipedream": 166, "slow": 50, "huge": 1}  # 200 / 1.2
    assert equal_time({"1f1b-flush": 100, "pipedream": 120}, per)["pipedream"] == 120
    # the pilot's lengths: at most the cap, whole steps (floor 166 -> 164, 133 -> 132)
    lengths = pilot_lengths(["1f1b-flush", "pipedream", "2bw"],
                            {"1f1b-flush": 2.0, "pipedream": 1.2, "2bw": 1.5}, 100, 300, step=4)
    assert lengths == {"1f1b-flush": 100, "pipedream": 164, "2bw": 132}
    assert pilot_lengths(["1f1b-flush", "pipedream"], per, 100, 150)["pipedream"] == 150
    assert pilot_lengths(["pipedream"], per, 100, 300) == {"pipedream": 166}  # a rank's share


def test_a_faster_candidate_is_judged_on_the_baselines_seconds() -> None:
    """A candidate twice as fast per minibatch but 5% less efficient per update reaches
    flush's level in about 84 of its minibatches: after flush's pilot of 80 (equal minibatches)
    it has not, and could never be chosen; in flush's seconds (160 of its minibatches) it
    has, and wins at about half flush's time."""
    flush = line(2.0, 1.0)
    slower = line(2.0, 1.0, round(P * 1.05))  # the same drop over 5% more minibatches
    stale = slower + [1.0] * (2 * P - len(slower))
    per = {"1f1b-flush": 2.0, "pipedream": 1.0}
    d = decide({"1f1b-flush": flush, "pipedream": stale}, per)
    rows = {r.schedule: r for r in d.rows}
    assert d.schedule == "pipedream" and rows["pipedream"].piloted == 2 * P
    assert P < rows["pipedream"].minibatches <= P * 1.05 + 1
    assert rows["pipedream"].time_s < 0.6 * rows["1f1b-flush"].time_s
    assert decide({"1f1b-flush": flush, "pipedream": stale[:P]}, per).schedule == "1f1b-flush"
    # a longer curve than flush's seconds allow is cut to them: it cannot buy the level late
    late = [2.0] * (2 * P) + [0.5] * P
    d = decide({"1f1b-flush": flush, "pipedream": late}, per)
    assert d.schedule == "1f1b-flush"
    assert {r.schedule: r.piloted for r in d.rows}["pipedream"] == 2 * P


@pytest.mark.parametrize("seed", range(40))
def test_stopping_a_pilot_early_never_changes_the_choice(seed: int) -> None:
    """The pipeline's early stop (auto.can_stop, asked after every segment of a candidate
    piloted after flush) on random curves and periods: decide on the stopped curves picks
    what decide on the whole curves picks, and the winner's minibatches to the level and
    time are the same."""
    import random

    rng = random.Random(seed)
    flush = [2.0 - i / P + rng.gauss(0, 0.05) for i in range(P)]
    per = {"1f1b-flush": 2.0}
    curves = {"1f1b-flush": flush}
    for name in ("pipedream", "pipedream+lr_scale", "2bw", "pipedream+nesterov"):
        per[name] = rng.uniform(0.8, 2.4)
        rate, floor = rng.uniform(0.3, 1.6), rng.uniform(0.6, 1.4)
        n = equal_time({"1f1b-flush": P, name: 4 * P}, per)[name]
        curves[name] = [max(floor, 2.0 - rate * i / P) + rng.gauss(0, 0.05) for i in range(n)]
    whole = decide(curves, per)
    level, bound = Level.of(flush), Level.of(flush).minibatches(flush) * per["1f1b-flush"]
    stopped = {"1f1b-flush": flush}
    sizes = [8, 16, 32, 64, 128, 256, 512]
    for name, curve in curves.items():
        if name == "1f1b-flush":
            continue
        end, k = 0, 0
        while end < len(curve):  # segments of the trainer's ramp
            end = min(end + sizes[min(k, len(sizes) - 1)], len(curve))
            k += 1
            if can_stop(curve[:end], per[name], level, bound):
                break
        stopped[name] = curve[:end]
        bound = min(bound, level.minibatches(stopped[name]) * per[name])
    early = decide(stopped, per)
    assert early.schedule == whole.schedule
    win = {r.schedule: r for r in whole.rows}[whole.schedule]
    got = {r.schedule: r for r in early.rows}[whole.schedule]
    assert (got.minibatches, got.time_s) == (win.minibatches, win.time_s)


def test_unit_cost_periods_see_the_flush_bubble() -> None:
    per, source = periods(["1f1b-flush", "pipedream", "pipedream+dc"], [1, 1, 1, 1])
    assert "unit-cost" in source
    assert per["pipedream"] == pytest.approx(3.0)        # forward 1 + backward 2 per minibatch
    assert per["pipedream+dc"] == per["pipedream"]
    assert per["1f1b-flush"] == pytest.approx(3.0 * (4 + 4 - 1) / 4)  # (m + S - 1) slots per m


def trainer(schedule: str, **kw) -> Trainer:
    return Trainer(split(tiny_mlp(), [1, 3]), [1, 1, 1], loss_fn,
                   lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.5), schedule=schedule,
                   executor="reference", progress=False, **kw)


@pytest.mark.slow
def test_auto_then_training_equals_training_the_chosen_schedule() -> None:
    data = batches(60)
    opts = {"pilot": 48, "min_pilot": 40, "max_fraction": 1.0, "max_cost": None,
            "candidates": ("1f1b-flush", "pipedream", "pipedream+lr_scale"), "where": "copies"}
    auto = trainer("auto", auto_options=opts)  # the pipeline's pilot: test_runtime_auto_pipeline
    auto.fit(data, epochs=1)
    d = auto.auto_decision
    assert d is not None and d.pilot_minibatches == 48 and len(d.rows) == 3
    assert auto.schedule_name == d.schedule and d.schedule in opts["candidates"]
    assert d.schedule in d.summary() and "pilot: 48 minibatches" in d.summary()
    direct = trainer(d.schedule)
    direct.fit(data, epochs=1)
    for n, t in direct.state_dict().items():  # the pilot touched neither weights nor RNG
        assert torch.equal(t, auto.state_dict()[n])


@pytest.mark.slow
def test_auto_without_a_pilot_picks_the_synchronous_schedule(tmp_path: Path) -> None:
    t = trainer("auto", auto_options={"pilot": 0}, checkpoint_dir=str(tmp_path))
    t.fit(batches(6), epochs=1)
    assert t.schedule_name == "1f1b-flush" and "disabled" in t.auto_decision.reason
    short = trainer("auto")  # half of 60 minibatches: a pilot may read 30 < min_pilot
    short.fit(batches(60), epochs=1)
    assert short.schedule_name == "1f1b-flush" and "may read 30 minibatches" in \
        short.auto_decision.reason
    class OneShot:  # yields its minibatches once: the pilot cannot read further epochs
        def __init__(self, data: list) -> None:
            self.data, self.used = data, False

        def __iter__(self):
            out, self.used = ([] if self.used else self.data), True
            return iter(out)

    few = trainer("auto")
    few.fit(OneShot(batches(6)), epochs=1)
    assert few.schedule_name == "1f1b-flush" and "only 6 minibatches" in few.auto_decision.reason
    # a resumed run keeps the checkpoint's schedule, whatever a pilot would say
    t2 = Trainer(split(tiny_mlp(), [1, 3]), [1, 1, 1], loss_fn,
                 lambda ps: torch.optim.SGD(ps, lr=0.05), schedule="pipedream+predict",
                 executor="reference", progress=False, checkpoint_dir=str(tmp_path / "b"))
    t2.fit(batches(6), epochs=1)
    again = trainer("auto", checkpoint_dir=str(tmp_path / "b"))
    again.fit(batches(6), epochs=2, resume=True)
    assert again.schedule_name == "pipedream+predict"
    assert "checkpoint" in again.auto_decision.reason


@pytest.mark.parametrize("kw,match", [
    ({"schedule": "auto", "vertical_sync": True}, "vertical_sync=True with schedule='auto'"),
    ({"schedule": "auto", "auto_options": {"pilots": 3}}, "unknown auto option 'pilots'"),
    ({"schedule": "1f1b-flush+predict"}, "mitigations are options of the asynchronous"),
    ({"schedule": "pipedreamx"}, "unknown schedule 'pipedreamx'"),
    ({"schedule": "localsgd"}, r"(?s)replicas \[1, 1, 1\].*same number R >= 2"),
    ({"schedule": "localsgd+predict"}, "mitigations are options of the asynchronous"),
])
def test_bad_schedules_are_refused(kw: dict, match: str) -> None:
    with pytest.raises(RuntimeConfigError, match=match):
        Trainer(split(tiny_mlp(), [1, 3]), [1, 1, 1], loss_fn, torch.optim.SGD,
                executor="reference", progress=False, **kw)


@pytest.mark.slow
def test_compiled_trainer_defaults_to_auto_and_reports_in_the_summary() -> None:
    from fxpipe.api import compile as fx_compile

    data = batches(50)
    compiled = fx_compile(copy.deepcopy(tiny_mlp()), 3, example_inputs=(data[0][0],),
                          loss_fn=loss_fn, stages=3, straight=True, repeats=1)
    t = compiled.trainer(optimizer=lambda ps: torch.optim.SGD(ps, lr=0.05), executor="reference",
                         progress=False, auto_options={"pilot": 40, "max_fraction": 1.0,
                                                       "max_cost": None,
                                                       "candidates": ("1f1b-flush", "pipedream")})
    t.fit(data, epochs=1)
    assert t.auto_decision.periods_from == "the plan simulator"
    assert "schedule auto -> " in compiled.summary(detail=True)  # the pilot's table
    assert "fxpipe trains:\nschedule: " in compiled.summary()
    assert AutoOptions.make(None).pilot > 0


def test_pilot_shares_partition_the_trained_candidates() -> None:
    cands = AutoOptions().candidates  # gpipe and the zero-bubble kinds reuse flush's curve
    assert share_of(cands, 0, 1) == ["1f1b-flush", "pipedream", "pipedream+lr_scale",
                                     "pipedream+predict+momentum"]
    assert share_of(cands, 0, 2) == ["1f1b-flush", "pipedream+lr_scale"]
    assert share_of(cands, 1, 2) == ["pipedream", "pipedream+predict+momentum"]
    assert [share_of(cands, i, 3) for i in range(3)] == [
        ["1f1b-flush", "pipedream+predict+momentum"], ["pipedream"], ["pipedream+lr_scale"]]
    assert [share_of(cands, i, 8) for i in range(4, 8)] == [[]] * 4  # more ranks than work
    assert share_of(("gpipe", "pipedream"), 0, 1) == ["gpipe", "pipedream"]  # no flush to reuse


def test_merge_keeps_the_order_and_lends_flush_its_curve() -> None:
    cands = ("1f1b-flush", "gpipe", "pipedream", "zb-h1", "pipedream+momentum")
    parts = [({"pipedream": [3.0]}, {"pipedream+momentum": "not run: no velocity"}),
             ({"1f1b-flush": [1.0, 2.0]}, {})]
    curves, notes = merge(parts, cands)
    assert list(curves) == ["1f1b-flush", "gpipe", "pipedream", "zb-h1"]
    assert curves["gpipe"] == curves["zb-h1"] == [1.0, 2.0]
    assert notes == {"pipedream+momentum": "not run: no velocity"}


@pytest.mark.slow
def test_a_pilot_split_over_ranks_decides_as_one_process() -> None:
    stages = split(tiny_mlp(), [1, 3])
    data = batches(48)
    opt = lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.5)  # noqa: E731
    opts = AutoOptions(pilot=48, min_pilot=40, max_cost=None)
    whole = choose(stages, [1, 1, 1], loss_fn, opt, data, opts)
    other = pilot(stages, [1, 1, 1], loss_fn, opt, data, share_of(opts.candidates, 1, 2))
    split_ = choose(stages, [1, 1, 1], loss_fn, opt, data, opts, share=(0, 2),
                    gather=lambda mine, what: [mine, other])
    assert (whole.pilot_ranks, split_.pilot_ranks) == (1, 2)
    assert split_.schedule == whole.schedule and split_.level == whole.level
    assert [(r.schedule, r.minibatches) for r in split_.rows] == \
        [(r.schedule, r.minibatches) for r in whole.rows]
    assert len(whole.rows) == len(opts.candidates)
    assert "split over 2 ranks" in split_.summary() and "split" not in whole.summary()
    idle = [({}, {})] * 4  # 8 ranks, 4 trained candidates: ranks 4-7 train none
    wide = choose(stages, [1, 1, 1], loss_fn, opt, data, opts, share=(7, 8),
                  gather=lambda mine, what: [*(pilot(stages, [1, 1, 1], loss_fn, opt, data,
                                               share_of(opts.candidates, i, 8))
                                         for i in range(4)), *idle])
    assert wide.pilot_ranks == 4 and wide.rows == whole.rows
    with pytest.raises(RuntimeConfigError, match="without a gather"):
        choose(stages, [1, 1, 1], loss_fn, opt, data, opts, share=(0, 2))


@pytest.mark.slow
def test_the_pilot_steps_the_trainers_lr_scheduler() -> None:
    """A schedule whose rate is 0 for the first 40 updates: a pilot that honours it does not
    train at all, so every candidate's curve is the untrained model's loss on each minibatch;
    one that ignored it would train at the base rate."""
    data = batches(48, batch=6)  # flush cuts each into 3 microbatches of 2: the same mean loss
    frozen = lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda k: float(k >= 40))  # noqa: E731
    with torch.no_grad():
        untrained = [float(loss_fn(tiny_mlp()(x), y)) for x, y in data]
    stages = split(tiny_mlp(), [1, 3])
    opt = lambda ps: torch.optim.SGD(ps, lr=0.5, momentum=0.5)  # noqa: E731
    cands = ("1f1b-flush", "pipedream", "pipedream+lr_scale")
    curves, _ = pilot(stages, [1, 1, 1], loss_fn, opt, data, cands, lr_scheduler=frozen)
    for c in cands:  # every candidate updates once per minibatch: frozen for the first 40
        assert curves[c][:40] == pytest.approx(untrained[:40], rel=1e-6), c
        assert curves[c][-1] != pytest.approx(untrained[-1], rel=1e-3), c
    moving, _ = pilot(stages, [1, 1, 1], loss_fn, opt, data, ("pipedream",))
    assert moving["pipedream"][-1] != pytest.approx(untrained[-1], rel=1e-3)
    t = trainer("auto", lr_scheduler=frozen, auto_options={
        "pilot": 36, "min_pilot": 30, "max_fraction": 1.0, "max_cost": None, "candidates": cands})
    t.fit(data, epochs=1)  # the trainer hands its scheduler to the pilot: nothing moves in it
    w = max(5, 36 // 8)
    assert t.auto_decision.level == pytest.approx(sum(untrained[36 - w:36]) / w, rel=1e-6)


@pytest.mark.slow
def test_the_pilot_trains_the_window_the_trainer_admits() -> None:
    """``noams`` (the trainer's window per asynchronous kind, what auto_resolve passes): the
    pilot's pipedream curve is that of pipedream with 5 in flight at the input stage (the
    reference executor on that schedule, whose staleness test_runtime_continuity holds against
    an oracle), not PipeDream's 3; a kind without an entry keeps PipeDream's."""
    from fxpipe.runtime.execution.reference import ReferenceExecutor
    from fxpipe.runtime.schedules.kinds import make_schedule

    data = batches(30, batch=4)
    stages = split(tiny_mlp(), [1, 3])
    opt = lambda ps: torch.optim.SGD(ps, lr=0.5, momentum=0.5)  # noqa: E731
    torch.manual_seed(0)
    ex = ReferenceExecutor(split(tiny_mlp(), [1, 3]), [1, 1, 1],
                           make_schedule("pipedream", [1, 1, 1], len(data), noam=5), loss_fn, opt)
    ex.run(data)
    want = [ex.last_losses[i] for i in range(len(data))]
    wide, _ = pilot(stages, [1, 1, 1], loss_fn, opt, data, ("pipedream", "2bw"),
                    noams={"pipedream": 5})
    plain, _ = pilot(stages, [1, 1, 1], loss_fn, opt, data, ("pipedream", "2bw"))
    assert wide["pipedream"] == pytest.approx(want, rel=1e-6)
    assert wide["pipedream"][-1] != pytest.approx(plain["pipedream"][-1], rel=1e-4)
    assert wide["2bw"] == plain["2bw"]


def test_pilot_budget_by_hand() -> None:
    # with a plan: 2 candidates x 50 minibatches x 40 ms = 4 s; 110 minibatches x 20 ms = 2.2 s
    assert budget(0.04, 2, 50, 110, 0.02) == pytest.approx((4.0, 2.2))
    # unit costs (no plan, S = 4: a whole step is 12 units; flush 21 units per minibatch): the
    # run is priced at the measured speed, 1000 x 0.04 x 21 / 12 = 70 s
    assert budget(0.04, 1, 200, 1000, 21.0, 12.0) == pytest.approx((8.0, 70.0))


@pytest.mark.slow
def test_an_unaffordable_or_pointless_pilot_is_not_run() -> None:
    data = batches(48)
    opt = lambda ps: torch.optim.SGD(ps, lr=0.05)  # noqa: E731
    stages = split(tiny_mlp(), [1, 3])
    opts = AutoOptions(pilot=48, min_pilot=40, max_cost=0.25)
    short = choose(stages, [1, 1, 1], loss_fn, opt, data, opts, run_minibatches=96)
    assert short.schedule == "1f1b-flush" and not short.rows  # 4 x 48 steps for a 96-step run
    assert "more than 25% of the run's predicted" in short.reason
    assert "4 candidates, 192 whole-model steps" in short.reason
    long = choose(stages, [1, 1, 1], loss_fn, opt, data, opts, run_minibatches=10**6)
    assert long.pilot_minibatches == 48 and len(long.rows) == len(opts.candidates)
    unknown = choose(stages, [1, 1, 1], loss_fn, opt, data, opts)  # no length: no limit
    assert unknown.pilot_minibatches == 48
    one = choose(split(tiny_mlp(), []), [1], loss_fn, opt, data, opts)
    assert one.schedule == "1f1b-flush" and "one worker" in one.reason and not one.rows
    dp = choose(split(tiny_mlp(), []), [2], loss_fn, opt, data, opts)
    assert dp.schedule == "1f1b-flush" and "(data parallelism)" in dp.reason and not dp.rows
    t = trainer("auto", auto_options={"pilot": 48, "min_pilot": 40})
    t.fit(batches(96), epochs=1)  # 96 minibatches: a 4 x 48-step pilot is too dear
    assert t.schedule_name == "1f1b-flush" and "would cost" in t.auto_decision.reason


@pytest.mark.slow
def test_ranks_price_the_pilot_at_the_slowest_ranks_probe() -> None:
    """Every rank must make the same call (one that skipped the pilot while another ran it
    would meet it at a different collective): the probe's time is the slowest rank's."""
    from fxpipe.api import compile as fx_compile

    data = batches(48)
    opt = lambda ps: torch.optim.SGD(ps, lr=0.05)  # noqa: E731
    compiled = fx_compile(copy.deepcopy(tiny_mlp()), 3, example_inputs=(data[0][0],),
                          loss_fn=loss_fn, stages=3, straight=True, repeats=1)
    stages = compiled.stage_specs  # with a plan the run is priced in the plan's seconds
    opts = AutoOptions(pilot=48, min_pilot=40, max_cost=0.25, plan=compiled.plan,
                       profile=compiled.profile)
    seen = []

    def gather(obj, what):
        seen.append(what)
        if what == "auto: pilot probe":
            return [obj, 1e3]  # the other rank: 1000 s per step
        return [obj, pilot(stages, [1, 1, 1], loss_fn, opt, data, share_of(opts.candidates, 1, 2))]

    alone = choose(stages, [1, 1, 1], loss_fn, opt, data, opts, run_minibatches=10**8)
    assert alone.pilot_minibatches == 48  # at this process's speed the pilot is cheap enough
    d = choose(stages, [1, 1, 1], loss_fn, opt, data, opts, share=(0, 2), gather=gather,
               run_minibatches=10**8)
    assert seen == ["auto: pilot probe"] and d.schedule == "1f1b-flush"
    assert "2 candidates, 96 whole-model steps on a rank x 1e+06 ms" in d.reason


@pytest.mark.slow
def test_a_pilot_the_profile_prices_out_is_skipped_without_a_probe(monkeypatch) -> None:
    """The plan's profile prices the pilot first (its stages' compute summed is one whole-model
    step): where that already costs more than max_cost of the run, no probe is timed and no
    pilot minibatch is read."""
    import fxpipe.runtime.training.auto as auto_mod
    from fxpipe.api import compile as fx_compile

    data = batches(48)
    compiled = fx_compile(copy.deepcopy(tiny_mlp()), 3, example_inputs=(data[0][0],),
                          loss_fn=loss_fn, stages=3, straight=True, repeats=1)
    plan = compiled.plan
    opts = AutoOptions(pilot=48, min_pilot=40, max_cost=0.25, plan=plan,
                       profile=compiled.profile)
    step = sum(st.compute_s * st.replicas for st in plan.stages)
    flush = periods(("1f1b-flush",), [1, 1, 1], plan=plan, profile=compiled.profile)[0]
    # by hand: 4 trained candidates x 48 minibatches x step against 96 x flush's period
    cost, run = 4 * 48 * step, 96 * flush["1f1b-flush"]
    assert cost > 0.25 * run  # the whole model per step: dearer than a quarter of this run

    def no_probe(*a, **kw):
        raise AssertionError("probed although the profile priced the pilot out")

    monkeypatch.setattr(auto_mod, "probe", no_probe)
    opt = lambda ps: torch.optim.SGD(ps, lr=0.05)  # noqa: E731
    d = choose(compiled.stage_specs, [1, 1, 1], loss_fn, opt, data, opts, run_minibatches=96)
    assert d.schedule == "1f1b-flush" and not d.rows
    assert f"about {cost:.3g} s (4 candidates, 192 whole-model steps on a rank x " \
        f"{step * 1e3:.3g} ms, the profile's compute)" in d.reason
    assert f"predicted {run:.3g} s" in d.reason

    class Counted(list):  # how often the trainer iterates the loader
        reads = 0

        def __iter__(self):
            Counted.reads += 1
            return super().__iter__()

    t = Trainer(compiled.stage_specs, [1, 1, 1], loss_fn, opt, schedule="auto",
                executor="reference", progress=False,
                auto_options={"pilot": 48, "min_pilot": 40, "plan": plan,
                              "profile": compiled.profile, "where": "copies"})
    t.fit(Counted(batches(96)), epochs=1)  # half the run may be read, but is not
    assert Counted.reads == 1 and "the profile's compute" in t.auto_decision.reason
