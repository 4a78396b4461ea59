"""The probe that measures the runtime's overheads, its cache, and how compile uses them
(fxpipe.runtime.execution.overhead_probe, fxpipe.api.with_runtime_overheads)."""
from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn

import fxpipe
from fxpipe.api import with_runtime_overheads
from fxpipe.costmodel.overheads import Overheads, with_overheads
from fxpipe.errors import ConfigError
from fxpipe.runtime.execution import overhead_probe as op
from fxpipe.runtime.pricing.replan import StageTimes, rescale
from fxpipe.runtime.timeline import TimelineEvent

MS = 1e-3


def ev(cat: str, start: float, end: float, **args) -> TimelineEvent:
    return TimelineEvent(cat, cat, start * MS, end * MS, args)


def two_ranks() -> dict[int, list[TimelineEvent]]:
    """Two minibatches (0, 1) by hand, in ms. Rank 0: F 0-2, send 2-2.5 (act of 0, tag 10),
    idle 2.5-3, B 3-5, U 5-6, F 6-8 (minibatch 1), send 8-8.5 (tag 12), B 9-11, U 11-12.
    Rank 1: receive wait 0-3 for tag 10, F 3-5, B 5-7, U 7-8, receive wait 8-9 for tag 12
    posted late, at 8.8, after the send ended (8.5): 0.5 for the peer, 0.3 late, 0.2 transfer;
    F 9-10, B 10-11, U 11-12."""
    r0 = [ev("forward", 0, 2, minibatch=0), ev("send", 2, 2.5, msgs=[(1, 10)]),
          ev("idle", 2.5, 3), ev("backward", 3, 5, minibatch=0), ev("optimizer", 5, 6, update=0),
          ev("forward", 6, 8, minibatch=1), ev("send", 8, 8.5, msgs=[(1, 12)]),
          ev("backward", 9, 11, minibatch=1), ev("optimizer", 11, 12, update=1)]
    r1 = [ev("recv", 0, 3, src=0, tag=10, posted=0.0), ev("forward", 3, 5, minibatch=0),
          ev("backward", 5, 7, minibatch=0), ev("optimizer", 7, 8, update=0),
          ev("recv", 8, 9, src=0, tag=12, posted=8.8 * MS), ev("forward", 9, 10, minibatch=1),
          ev("backward", 10, 11, minibatch=1), ev("optimizer", 11, 12, update=1)]
    return {0: r0, 1: r1}


def test_host_seconds_counts_all_but_the_waits_for_the_peer() -> None:
    """Per minibatch (2): rank 0 = (F 4 + B 4 + U 2 + send 1 + idle 0.5) / 2 = 5.75 ms.
    Rank 1's window starts at its first forward (3 ms), so the first receive is outside it:
    (F 3 + B 3 + U 2 + late 0.3 + transfer 0.2) / 2 = 4.25 ms; the peer wait (0.5 ms) is the
    other rank's compute, not an overhead."""
    got = op.host_seconds(two_ranks(), 0, 2)
    assert got == pytest.approx([5.75 * MS, 4.25 * MS])


def test_cached_overheads_are_used_without_a_probe(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("FXPIPE_CACHE_DIR", str(tmp_path))
    ov = Overheads(action_s=1e-4, message_s=2e-4, tensor_s=1e-6, source="cached")
    (tmp_path / op.CACHE_FILE).write_text(json.dumps({op.machine_key(): ov.to_dict(),
                                                      "another machine": {"action_s": 9.0}}))
    monkeypatch.setattr(op, "measure_in_subprocess",
                        lambda: pytest.fail("probed despite a cache"))
    assert op.machine_overheads() == ov


def test_a_missing_or_broken_cache_is_measured_and_written(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("FXPIPE_CACHE_DIR", str(tmp_path / "new"))
    measured = Overheads(action_s=3e-4, source="probe")
    calls: list[int] = []
    monkeypatch.setattr(op, "measure_in_subprocess", lambda: calls.append(1) or measured)
    assert op.machine_overheads() == measured and calls == [1]
    saved = json.loads((tmp_path / "new" / op.CACHE_FILE).read_text())
    assert saved == {op.machine_key(): measured.to_dict()}
    assert op.machine_overheads() == measured and calls == [1]  # now from the cache
    (tmp_path / "new" / op.CACHE_FILE).write_text("{not json")
    assert op.machine_overheads() == measured and calls == [1, 1]
    assert op.machine_overheads(refresh=True) == measured and calls == [1, 1, 1]


def test_a_probe_that_fails_is_a_warning_not_a_failed_compile(tmp_path, monkeypatch,
                                                                caplog) -> None:
    monkeypatch.setenv("FXPIPE_CACHE_DIR", str(tmp_path))

    def broken() -> Overheads:
        raise RuntimeError("no port")
    monkeypatch.setattr(op, "measure_in_subprocess", broken)
    with caplog.at_level("WARNING"):
        ov = op.machine_overheads()
    assert ov.zero and "probe failed (RuntimeError)" in ov.source
    assert "could not measure the runtime's overheads (RuntimeError: no port)" in caplog.text
    assert not (tmp_path / op.CACHE_FILE).exists()  # the next compile tries again


def test_compile_prices_the_overheads_it_is_given() -> None:
    """A 2-stage MLP with 1 ms per message: each stage's compute holds its overhead, which the
    plan's time includes (stage 0: the action, 2 tensors, 2 messages; no stash at flush)."""
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    ov = Overheads(action_s=1e-4, message_s=1e-3, tensor_s=1e-6, source="given")
    c = fxpipe.compile(model, fxpipe.Cluster(workers=2), example_inputs=(torch.randn(4, 16),),
                       loss_fn=nn.functional.cross_entropy, stages=2, straight=True,
                       schedule="1f1b-flush", choose="planner", overheads=ov)
    assert c.profile.overheads.source == "given"
    tensors = [len({p for n in c.profile.nodes if n.name in s.nodes for p in n.params})
               for s in c.plan.stages]
    assert [s.overhead_s for s in c.plan.stages] == pytest.approx(
        [1e-4 + t * 1e-6 + 2e-3 for t in tensors])
    assert c.plan.time_per_minibatch >= 2e-3


def test_overheads_modes() -> None:
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    c = fxpipe.compile(model, fxpipe.Cluster(workers=2, device="A100"),
                       example_inputs=(torch.randn(4, 16),), overheads="auto")
    ov = c.profile.overheads  # estimated: the stash's copy only, the rest not measured there
    assert ov.stash_copy_s == c.profile.meta["stash_copy_s"] > 0
    assert ov.action_s == ov.message_s == ov.tensor_s == 0 and "A100" in ov.source
    off = with_runtime_overheads(c.profile, fxpipe.Cluster(workers=2), "off")
    assert off.overheads.zero and off.overheads.source == "off"
    with pytest.raises(ConfigError, match="overheads='sometimes'"):
        with_runtime_overheads(c.profile, fxpipe.Cluster(workers=2), "sometimes")


def test_environment_sets_the_default(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("FXPIPE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("FXPIPE_OVERHEADS", "auto")
    cached = Overheads(action_s=5e-4, source="cached")
    (tmp_path / op.CACHE_FILE).write_text(json.dumps({op.machine_key(): cached.to_dict()}))
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    c = fxpipe.compile(model, fxpipe.Cluster(workers=1), example_inputs=(torch.randn(4, 16),),
                       loss_fn=nn.functional.cross_entropy)
    assert c.profile.overheads.action_s == 5e-4
    assert c.plan.stages[0].overhead_s == pytest.approx(5e-4)


def test_a_replan_keeps_only_the_messages() -> None:
    """Stage times measured by the runtime hold its calls and copies already."""
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    ov = Overheads(action_s=1e-4, message_s=1e-3, tensor_s=1e-6, stash_copy_s=1e-5,
                   tie_s=2e-3, source="x")
    c = fxpipe.compile(model, fxpipe.Cluster(workers=2), example_inputs=(torch.randn(4, 16),),
                       loss_fn=nn.functional.cross_entropy, stages=2, straight=True,
                       overheads=ov)
    times = [StageTimes(1e-3, 2e-3, 1e-4)] * 2
    scaled, _ = rescale(c.profile, c.plan, times)
    assert scaled.overheads == Overheads(message_s=1e-3, tie_s=2e-3, source="x; messages only")
    # a stage calibration (the reference executor) measured the tied sums in its updates
    cal = c.calibrate_stages([(torch.randn(4, 16), torch.randint(0, 4, (4,)))] * 8,
                             lambda ps: torch.optim.SGD(ps, lr=0.1))
    assert cal.profile.overheads == Overheads(message_s=1e-3, source="x; messages only")
    bare = fxpipe.compile(model, fxpipe.Cluster(workers=2), example_inputs=(torch.randn(4, 16),),
                          loss_fn=nn.functional.cross_entropy, stages=2, straight=True)
    assert rescale(bare.profile, bare.plan, [StageTimes(1e-3, 2e-3, 1e-4)] * 2)[0].meta \
        .get("overheads") == with_overheads({}, Overheads(source="off"))["overheads"]


def test_the_stash_adds_a_little_per_tensor() -> None:
    got = op.stash_per_tensor(32)
    assert math.isfinite(got) and 0 <= got < 1e-3


def test_each_round_is_derived_by_the_module_docs_arithmetic() -> None:
    """By hand: a one-rank run of 1.0 ms per minibatch against a plain step of 0.7 ms, 5 us per
    tensor (the probe's 8 tensors: 0.04 ms) leave 0.26 ms per stage; the two-rank stages (0.8
    and 0.6 ms, mean 0.7) less half the plain step, that and 4 tensors leave 0.07 ms for their
    2 messages."""
    r = op.ProbeRound(one=1.0e-3, two=(0.8e-3, 0.6e-3), eager_one=0.7e-3, per_tensor=5e-6)
    action, tensor, message = op.derive(r)
    assert action == pytest.approx(0.26e-3) and tensor == 5e-6
    assert message == pytest.approx(0.035e-3)
    # a run faster than the plain step measures no overhead, not a negative one
    assert op.derive(op.ProbeRound(0.5e-3, (0.1e-3, 0.1e-3), 0.7e-3, -1e-6)) == (0.0, 0.0, 0.0)


def test_a_value_beyond_the_first_is_the_fan_runs_excess() -> None:
    """By hand, FAN = 3: the fan run's stages (2.0 and 1.8 ms, mean 1.9) against the plain
    two-rank run's (1.5 and 1.3, mean 1.4: 0.5 ms more), less half the fan's extra plain
    compute (0.2 ms of 0.4), over the 6 messages more each stage posts or takes: 0.05 ms."""
    assert op.FAN == 3
    r = op.ProbeRound(one=1e-3, two=(1.5e-3, 1.3e-3), eager_one=2e-3, per_tensor=0.0,
                      fan_two=(2.0e-3, 1.8e-3), eager_fan=2.4e-3)
    assert op.derive_value(r) == pytest.approx(0.05e-3)
    assert op.derive_value(op.ProbeRound(1e-3, (1e-3,), 1e-3, 0.0)) is None  # no fan run
    assert op.combine_value([op.ProbeRound(1e-3, (1e-3,), 1e-3, 0.0)]) is None
    assert op.combine_value([r, r, op.ProbeRound(**{**r.__dict__, "fan_two": (9e-3, 9e-3)})]) \
        == pytest.approx(0.05e-3)


def test_the_rounds_median_ignores_one_disturbed_launch() -> None:
    base = dict(two=(0.8e-3, 0.6e-3), eager_one=0.7e-3)
    rounds = [op.ProbeRound(one=1.0e-3, per_tensor=3e-6, **base),
              op.ProbeRound(one=1.1e-3, per_tensor=4e-6, **base),
              op.ProbeRound(one=9.0e-3, per_tensor=50e-6, **base)]  # the disturbed one
    action, tensor, _ = op.combine(rounds)
    assert tensor == 4e-6
    assert action == pytest.approx(1.1e-3 - 0.7e-3 - 8 * 4e-6)  # the middle round's
    with pytest.raises(ValueError):
        op.combine([])


@pytest.mark.multiprocess
def test_the_probe_measures_this_machine() -> None:
    """The real probe (one round: one world of two ranks, the replica in this process): finite,
    non-negative, and a stage costs something."""
    ov = op.measure_overheads(minibatches=48, rounds=1)
    assert ov.action_s + ov.message_s > 0 and "measured on" in ov.source
    assert ov.value_s is not None
    for v in (ov.action_s, ov.message_s, ov.tensor_s, ov.stash_tensor_s, ov.tie_s, ov.value_s):
        assert math.isfinite(v) and 0 <= v < 0.05


SCRIPT = """
import torch, fxpipe
print("script body ran", flush=True)
model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
c = fxpipe.compile(model, fxpipe.Cluster(workers=2), example_inputs=(torch.randn(4, 16),),
                   loss_fn=torch.nn.functional.cross_entropy)
print("overheads:", c.profile.overheads.source, flush=True)
"""


@pytest.mark.multiprocess
def test_a_script_without_a_main_guard_probes_once(tmp_path) -> None:
    """The README's pattern: ``fxpipe.compile`` at a script's top level, no ``__main__`` guard.
    The probe runs in a fresh interpreter, so its ranks never run the script again (with
    multiprocessing's spawn in this process they would: the body would print 3 more times)."""
    import os
    import subprocess
    import sys

    (tmp_path / "user.py").write_text(SCRIPT)
    env = {**os.environ, "FXPIPE_OVERHEADS": "auto", "FXPIPE_CACHE_DIR": str(tmp_path / "c"),
           "WORLD_SIZE": "1"}
    res = subprocess.run([sys.executable, str(tmp_path / "user.py")], capture_output=True,
                         text=True, timeout=300, env=env, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.count("script body ran") == 1
    assert "overheads: measured on" in res.stdout
    assert (tmp_path / "c" / op.CACHE_FILE).exists()
