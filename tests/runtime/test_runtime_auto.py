"""schedule="auto" (fxpipe.runtime.auto): the decision rule on hand-made curves, the simulated
throughputs, and the trainer adopting the choice without perturbing training."""
from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch
from rt_helpers import batches, loss_fn, split, tiny_mlp

from fxpipe.runtime.auto import AutoOptions, decide, periods, to_level
from fxpipe.runtime.errors import RuntimeConfigError
from fxpipe.runtime.trainer import Trainer

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
    half = line(2.0, 1.5)  # half of flush's drop: extrapolated to twice the pilot
    w = max(5, P // 8)
    start = sum(flush[:w]) / w
    level = sum(flush[-w:]) / w
    done = start - sum(half[-w:]) / w
    assert to_level(half, level, start, w) == pytest.approx(P * (start - level) / done)
    assert to_level([math.nan] * P, level, start, w) == math.inf
    d = decide({"1f1b-flush": flush, "pipedream": [math.inf] * P},
               {"1f1b-flush": 1.0, "pipedream": 0.1})
    assert d.schedule == "1f1b-flush"
    with pytest.raises(RuntimeConfigError, match="baseline"):
        decide({"pipedream": flush}, {"pipedream": 1.0})


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


def test_auto_then_training_equals_training_the_chosen_schedule() -> None:
    data = batches(60)
    opts = {"pilot": 48, "min_pilot": 40, "max_fraction": 1.0,
            "candidates": ("1f1b-flush", "pipedream", "pipedream+lr_scale")}
    auto = trainer("auto", auto_options=opts)
    auto.fit(data, epochs=1)
    d = auto.auto_decision
    assert d is not None and d.pilot_minibatches == 48 and len(d.rows) == 3
    assert auto.schedule_name == d.schedule and d.schedule in opts["candidates"]
    assert d.schedule in d.summary() and "pilot: 48 minibatches" in d.summary()
    direct = trainer(d.schedule)
    direct.fit(data, epochs=1)
    for n, t in direct.state_dict().items():  # the pilot touched neither weights nor RNG
        assert torch.equal(t, auto.state_dict()[n])


def test_auto_without_a_pilot_picks_the_synchronous_schedule(tmp_path: Path) -> None:
    t = trainer("auto", auto_options={"pilot": 0}, checkpoint_dir=str(tmp_path))
    t.fit(batches(6), epochs=1)
    assert t.schedule_name == "1f1b-flush" and "disabled" in t.auto_decision.reason
    short = trainer("auto")  # 2 x 60 minibatches: a pilot may read 30 < min_pilot
    short.fit(batches(60), epochs=2)
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
    ({"schedule": "localsgd"}, "(?s)reference executor only.*LocalSGDExecutor"),
])
def test_bad_schedules_are_refused(kw: dict, match: str) -> None:
    with pytest.raises(RuntimeConfigError, match=match):
        Trainer(split(tiny_mlp(), [1, 3]), [1, 1, 1], loss_fn, torch.optim.SGD,
                executor="reference", progress=False, **kw)


def test_compiled_trainer_defaults_to_auto_and_reports_in_the_summary() -> None:
    from fxpipe.api import compile as fx_compile

    data = batches(50)
    compiled = fx_compile(copy.deepcopy(tiny_mlp()), 3, example_inputs=(data[0][0],),
                          loss_fn=loss_fn, stages=3, straight=True, repeats=1)
    t = compiled.trainer(optimizer=lambda ps: torch.optim.SGD(ps, lr=0.05), executor="reference",
                         progress=False, auto_options={"pilot": 40, "max_fraction": 1.0,
                                                       "candidates": ("1f1b-flush", "pipedream")})
    t.fit(data, epochs=1)
    assert t.auto_decision.periods_from == "the plan simulator"
    assert "schedule auto -> " in compiled.summary()
    assert AutoOptions.make(None).pilot > 0
