"""bench/simcheck without processes: the sleeping model is profiled as it sleeps, and the
measured-timeline reduction is the simulator's own (fed the simulator's events, it must return
the simulator's numbers exactly)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.simcheck.model import SleepChain, SleepLayer, data  # noqa: E402
from bench.simcheck.run import measured  # noqa: E402
from fxpipe.api import compile as fx_compile  # noqa: E402
from fxpipe.costmodel import Cluster  # noqa: E402
from fxpipe.passes import plan_for  # noqa: E402
from fxpipe.runtime.pricing.plansim import simulate_plan  # noqa: E402


class FakeClock:
    """perf_counter advancing one tick (2**-10 s) per reading, and sleep advancing it by the
    time asked without waiting: what the profiler measures is then exact, whatever the load."""

    TICK = 2.0 ** -10

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        self.now += self.TICK
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_sleep_layers_are_profiled_as_leaves_with_their_sleep(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Each SleepLayer is one traced leaf whose measured forward and backward are its sleeps
    (plus the one tick between two clock readings): 20 and 40 ms, 1 and 2 ms."""
    import types

    import bench.simcheck.model as sleep_model
    import fxpipe.costmodel.profiler as profiler

    clock = FakeClock()
    monkeypatch.setattr(profiler, "time", types.SimpleNamespace(perf_counter=clock.perf_counter))
    monkeypatch.setattr(sleep_model, "time", types.SimpleNamespace(sleep=clock.sleep))
    x, _ = data(1)
    model = SleepChain(layers=((20.0, 40.0), (1.0, 2.0)), width=8)
    c = fx_compile(model, Cluster(workers=2, bandwidth="1Gbps"), example_inputs=(x[:4, :8],),
                   loss_fn=F.cross_entropy, leaf_modules=[SleepLayer], repeats=3)
    nodes = {n.name: n for n in c.profile.nodes}
    assert set(nodes) == {"x", "layers_0", "layers_1", "head"}
    tick = FakeClock.TICK
    got = {n: (nodes[n].forward_s, nodes[n].backward_s) for n in ("layers_0", "layers_1", "head")}
    want = {"layers_0": (0.020 + tick, 0.040 + tick), "layers_1": (0.001 + tick, 0.002 + tick),
            "head": (tick, tick)}
    for name, pair in want.items():
        assert got[name] == pytest.approx(pair, rel=1e-9, abs=1e-15), name
    out = c(x[:4, :8])  # and the pipeline computes what the model computes
    torch.testing.assert_close(out, model(x[:4, :8]))


@pytest.mark.parametrize("starts, replicas", [([0, 2], [1, 1]), ([0, 2], [2, 1]), ([0], [3])])
def test_measured_reduction_of_simulated_events_is_the_simulation(starts: list[int],
                                                                   replicas: list[int]) -> None:
    from fxpipe.costmodel.profile import Profile, ProfileNode

    prof = Profile(nodes=tuple(
        ProfileNode(name=f"n{i}", op="call_module", target="m", forward_s=0.01 * (i + 1),
                    backward_s=0.02 * (i + 1), activation_bytes=1e4, parameter_bytes=1e5,
                    inputs=(f"n{i - 1}",) if i else ()) for i in range(4)), batch_size=4)
    plan = plan_for(prof, Cluster(workers=3, bandwidth=1e7), starts, replicas)
    n = 24
    sim = simulate_plan(plan, prof, minibatches=n)
    ranks = []
    for g, evs in sim.events.items():
        stage, replica = (int(w) for w in sim.rank_names[g].split()[1::2])
        ranks.append({"rank": g, "stage_replica": [stage, replica], "segment_s": [sim.makespan],
                      "events": [{"category": e.category, "name": e.name, "start": e.start,
                                  "end": e.end, "args": dict(e.args)} for e in evs]})
    got = measured(plan, ranks, n)
    assert got["steady_s"] == pytest.approx(sim.steady_state_period, rel=1e-12)
    assert got["makespan_s"] == pytest.approx(sim.makespan, rel=1e-12)
