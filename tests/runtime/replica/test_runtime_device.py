"""The device policy (cuda:LOCAL_RANK), proven without a GPU: the selection logic with a mocked
CUDA, a spawned rank's process-group set-up with a mocked torch.distributed, weights placed once,
the wire plan's dry run touching nothing, and device-timed timeline spans with a fake clock."""
from __future__ import annotations

import functools
import time
from typing import Any

import pytest
import torch
import torch.nn as nn
from rt_helpers import batches, split

from fxpipe.runtime.errors import RuntimeConfigError
from fxpipe.runtime.execution.wire import make_wire_plan

GPUS = dict(cuda_available=True, device_count=4)


def test_rank_device_follows_local_rank() -> None:
    from fxpipe.runtime.replica.device import rank_device

    env = {"LOCAL_RANK": "3"}
    assert rank_device(None, env=env, **GPUS) == torch.device("cuda", 3)
    assert rank_device("cuda", env=env, **GPUS) == torch.device("cuda", 3)
    assert rank_device("cuda:1", env=env, **GPUS) == torch.device("cuda", 1)  # pinned by hand
    assert rank_device("cpu", env=env, **GPUS) == torch.device("cpu")
    assert rank_device(None, env=env, cuda_available=False) == torch.device("cpu")
    assert rank_device("cuda", env={}, **GPUS) == torch.device("cuda", 0)
    with pytest.raises(RuntimeConfigError, match="cuda:5 .* has 4 GPU"):
        rank_device("cuda", env={"LOCAL_RANK": "5"}, **GPUS)
    with pytest.raises(RuntimeConfigError, match="CUDA is not available"):
        rank_device("cuda", env=env, cuda_available=False)
    with pytest.raises(RuntimeConfigError, match="LOCAL_RANK='x'"):
        rank_device("cuda", env={"LOCAL_RANK": "x"}, **GPUS)


def test_spawned_rank_i_drives_gpu_i(monkeypatch: pytest.MonkeyPatch) -> None:
    """run_distributed(device="cuda"): rank 2 of a spawned world sets GPU 2 and joins NCCL
    with it (it used to take GPU 0 whatever its rank)."""
    import torch.distributed as dist

    from fxpipe.runtime.execution import worker
    from fxpipe.runtime.execution.worker import WorkerConfig, init_rank

    calls: dict[str, Any] = {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.setdefault("set_device", d))
    monkeypatch.setattr(dist, "init_process_group",
                        lambda backend, **kw: calls.update(backend=backend, **kw))
    monkeypatch.setattr(worker, "synchronized_start", lambda timeout: 0.0)
    monkeypatch.setattr(worker, "warm_imports", lambda: None)
    cfg = WorkerConfig(stages=[], schedule_kind="pipedream", replicas=(1, 1, 1, 1),
                       num_minibatches=0, actions={}, loss_fn=None, optimizer_factory=None,
                       batches=[], wire=None, outdir="", port=1, device="cuda")
    init_rank(2, cfg, world_size=4)
    assert calls["set_device"] in (2, torch.device("cuda", 2)), calls["set_device"]
    assert calls["backend"] == "nccl" and calls["rank"] == 2


def test_host_copies_to_the_cpu_are_the_tensor_itself() -> None:
    from fxpipe.runtime.replica.device import to_device

    x = torch.randn(3)
    assert to_device(x, torch.device("cpu")) is x
    assert to_device(7, torch.device("cpu")) == 7


def test_a_replica_holds_its_weights_once_on_its_device() -> None:
    """The stage's GraphModule is not moved (its own tensors are never computed with); the
    replica's weights, buffers and constants go to the device. The meta device stands in for
    a GPU here: nothing is allocated, but every placement is visible."""
    from fxpipe.runtime.replica.stage import StageReplica

    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    (spec,) = split(model, [])
    before = {n: p for n, p in spec.gm.named_parameters()}
    rep = StageReplica(spec, functools.partial(torch.optim.SGD, lr=0.1),
                       device=torch.device("meta"))
    assert all(t.device.type == "meta" for t in rep.stash.latest.values())
    assert all(t.device.type == "meta" for t in rep.buffers.values())
    assert {n: p for n, p in spec.gm.named_parameters()} == before
    assert all(p.device.type == "cpu" for p in spec.gm.parameters())


class WithBN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.bn, self.drop, self.b = (nn.Linear(4, 6), nn.BatchNorm1d(6),
                                              nn.Dropout(0.5), nn.Linear(6, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.drop(self.bn(self.a(x))))


def test_wire_plan_dry_run_touches_no_state_and_mixes_no_devices() -> None:
    """In train mode a real dry run would update BatchNorm's running statistics and draw
    dropout's random numbers (on rank 0 only, so ranks would diverge); a stage whose weights
    are on another device than the inputs (the meta device here, a GPU in a job) would fail."""
    stages = split(WithBN().train(), [1, 3])
    stages[2].gm.to("meta")
    stats = [b.clone() for st in stages[:2] for b in st.gm.buffers()]
    rng = torch.get_rng_state()
    plan = make_wire_plan(stages, [x for x, _ in batches(2)])
    assert [tuple(plan.spec(n, 0).shape) for n in plan.values] == [(4, 6), (4, 6)]
    assert torch.equal(torch.get_rng_state(), rng)
    for old, new in zip(stats, [b for st in stages[:2] for b in st.gm.buffers()]):
        assert torch.equal(old, new)


def test_device_clock_times_compute_spans_and_host_clock_the_rest() -> None:
    from fxpipe.runtime.timeline import Recorder

    t0 = time.perf_counter()

    class FakeClock:
        """Marks numbered in order; mark i happened 10 + i seconds after t0."""

        def __init__(self) -> None:
            self.n = 0

        def mark(self) -> int:
            self.n += 1
            return self.n

        def seconds(self, mark: int) -> float:
            return t0 + 10 + mark

    rec = Recorder(t0, device_clock=FakeClock(), args={"rank": 0})
    with rec.span("forward", "F0", minibatch=0):
        pass
    with rec.span("recv", "recv x"):
        pass
    with rec.span("backward", "B0", minibatch=0):
        pass
    events = {e.name: e for e in rec.finish()}
    assert (events["F0"].start, events["F0"].end) == (11.0, 12.0)
    assert (events["B0"].start, events["B0"].end) == (13.0, 14.0)
    assert events["F0"].args == {"rank": 0, "minibatch": 0}
    assert events["recv x"].end < 11.0  # the host clock: well before the device's marks
