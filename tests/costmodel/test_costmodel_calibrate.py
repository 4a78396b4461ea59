"""Whole-step calibration: node times scaled to a whole training step, the caller's model untouched."""
from __future__ import annotations

import logging

import pytest
import torch
import torch.nn as nn
from cm_helpers import meta, traced

from fxpipe.costmodel import profile_graph, to_profile
from fxpipe.costmodel import calibrate as cal
from fxpipe.costmodel.calibrate import (CUDA_LOWEST, WholeStep, apply_calibration,
                                        time_whole_step)

FAST = dict(warmup=1, repeats=2)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 5)
        self.bn = nn.BatchNorm1d(5)
        self.fc2 = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.bn(self.fc1(x))))


def _set(gm: torch.fx.GraphModule, times: dict[str, tuple[float, float, float]]) -> None:
    for n in gm.graph.nodes:
        if n.name in times:
            f, b, u = times[n.name]
            n.meta["fxpipe"].update(forward_s=f, backward_s=b, update_s=u, forward_iqr_s=f / 10)


def test_apply_scales_each_part_by_its_own_ratio_by_hand() -> None:
    gm = traced(Net(), torch.randn(4, 6))
    _set(gm, {"x": (0.0, 0.0, 0.0), "fc1": (1.0, 2.0, 0.5), "bn": (1.0, 1.0, 0.25),
              "relu": (2.0, 1.0, 0.0), "fc2": (4.0, 4.0, 0.25)})
    # sums: forward 8, backward 8, update 1; the whole step: 12, 4, 1.5
    step = WholeStep(12.0, 4.0, 1.5, 8.0, 8.0, 1.0)
    apply_calibration(gm, step)
    assert meta(gm, "fc1")["forward_s"] == 1.5 and meta(gm, "fc2")["forward_s"] == 6.0
    assert meta(gm, "fc1")["backward_s"] == 1.0 and meta(gm, "relu")["backward_s"] == 0.5
    assert meta(gm, "fc1")["update_s"] == 0.75 and meta(gm, "bn")["update_s"] == 0.375
    assert meta(gm, "fc1")["forward_iqr_s"] == pytest.approx(0.15)
    assert meta(gm, "x")["forward_s"] == 0.0
    rec = meta(gm, "output")["calibration"]
    assert (rec["forward_ratio"], rec["backward_ratio"], rec["update_ratio"]) == (1.5, 0.5, 1.5)


@pytest.mark.parametrize("whole,nodes,expected", [
    (10.0, 1.0, 1.0),   # 10x: outside the plausible band, not applied
    (0.1, 1.0, 1.0),    # 0.1x: likewise
    (0.0, 1.0, 1.0),    # nothing measured
    (1.0, 0.0, 1.0),    # no node time to scale
    (4.9, 1.0, 4.9),
    (0.5, 1.0, 0.5),
])
def test_ratio_band(whole: float, nodes: float, expected: float) -> None:
    step = WholeStep(whole, 0.0, 0.0, nodes, 0.0, 0.0)
    assert step.ratio("forward") == expected


@pytest.mark.parametrize("whole,expected", [(0.4, 0.4), (0.1, 0.1), (0.09, 1.0), (5.1, 1.0)])
def test_on_a_gpu_the_band_starts_lower(whole: float, expected: float) -> None:
    """Synchronised per-node samples on a GPU pay a launch each that a whole step overlaps: a
    step at 0.4x its nodes is the device, not noise (on the CPU it stays unapplied, above)."""
    step = WholeStep(whole, 0.0, 0.0, 1.0, 0.0, 0.0, lowest=CUDA_LOWEST)
    assert step.ratio("forward") == expected
    assert WholeStep(whole, 0.0, 0.0, 1.0, 0.0, 0.0).ratio("forward") == (
        whole if 0.5 <= whole <= 5.0 else 1.0)


def test_calibrate_takes_the_gpu_band_when_told(monkeypatch: pytest.MonkeyPatch) -> None:
    """The nodes of a graph timed on a GPU (``on_gpu``, which the profiler sets when it
    synchronises CUDA) are scaled to a whole step 0.3x their sum; on the CPU they stand."""
    import fxpipe.costmodel.calibrate as cal

    torch.manual_seed(0)
    for on_gpu, expected in ((True, 0.3), (False, 1.0)):
        gm = traced(Net(), torch.randn(8, 6))
        profile_graph(gm, (torch.randn(8, 6),), **{**FAST, "whole_step": False})
        nodes = sum(n.meta["fxpipe"]["forward_s"] for n in gm.graph.nodes
                    if "forward_s" in n.meta.get("fxpipe", {}))
        monkeypatch.setattr(cal, "time_whole_step", lambda *a, **k: (0.3 * nodes, 0.0, 0.0))
        step = cal.calibrate(gm, (torch.randn(8, 6),), lambda ps: torch.optim.SGD(ps, lr=0.1),
                             lambda: None, on_gpu=on_gpu)
        assert step is not None and step.ratio("forward") == pytest.approx(expected)
        after = sum(n.meta["fxpipe"]["forward_s"] for n in gm.graph.nodes
                    if "forward_s" in n.meta.get("fxpipe", {}))
        assert after == pytest.approx(expected * nodes)


def test_whole_step_leaves_the_model_as_it_was() -> None:
    torch.manual_seed(0)
    model = Net()
    gm = traced(model, torch.randn(4, 6))
    for p in gm.parameters():
        p.grad = torch.full_like(p, 7.0)
    before = {k: v.clone() for k, v in gm.state_dict().items()}
    f, b, u = time_whole_step(gm, (torch.randn(4, 6),),
                              lambda ps: torch.optim.SGD(ps, lr=1.0, momentum=0.9),
                              lambda: None, warmup=1, repeats=2)
    assert f > 0 and b > 0 and u > 0
    after = gm.state_dict()
    # parameters: the steps moved clones only (buffers: the profiler's isolated() restores them)
    for k, p in gm.named_parameters():
        assert torch.equal(after[k], before[k]), k
        assert torch.equal(p.grad, torch.full_like(p, 7.0)), k


def test_profile_sums_equal_the_whole_step() -> None:
    torch.manual_seed(0)
    gm = traced(Net(), torch.randn(8, 6))
    profile_graph(gm, (torch.randn(8, 6),), **FAST)
    rec = meta(gm, "output")["calibration"]
    prof = to_profile(gm)
    assert prof.meta["calibration"] == rec
    for part in ("forward", "backward", "update"):
        total = sum(getattr(n, f"{part}_s") for n in prof.nodes)
        if rec[f"{part}_ratio"] != 1.0:  # applied: the nodes now sum to the whole step
            assert total == pytest.approx(rec[f"{part}_s"], rel=1e-9), part
        else:
            assert total == pytest.approx(rec[f"node_{part}_s"], rel=1e-9), part


def test_off_and_failing_calibration_leave_node_times(monkeypatch: pytest.MonkeyPatch,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    x = torch.randn(8, 6)
    gm = traced(Net(), x)
    profile_graph(gm, (x,), whole_step=False, **FAST)
    assert "calibration" not in meta(gm, "output") and "calibration" not in to_profile(gm).meta

    def broken(*a: object, **k: object) -> tuple[float, float, float]:
        raise RuntimeError("cannot run whole")

    monkeypatch.setattr(cal, "time_whole_step", broken)
    gm2 = traced(Net(), x)
    with caplog.at_level(logging.WARNING, logger="fxpipe.costmodel.calibrate"):
        profile_graph(gm2, (x,), **FAST)
    assert "calibration" not in meta(gm2, "output")
    assert "whole-step calibration skipped (RuntimeError: cannot run whole)" in caplog.text


def test_a_large_model_update_is_not_cloned(monkeypatch: pytest.MonkeyPatch) -> None:
    """Above UPDATE_CLONE_BYTES no clone of the weights is made: the update is not timed (0),
    so its ratio stays 1; forward and backward are still timed."""
    monkeypatch.setattr(cal, "UPDATE_CLONE_BYTES", 16)
    made: list[int] = []
    gm = traced(Net(), torch.randn(4, 6))
    f, b, u = time_whole_step(gm, (torch.randn(4, 6),),
                              lambda ps: made.append(len(ps)) or torch.optim.SGD(ps, lr=1.0),
                              lambda: None, warmup=1, repeats=2)
    assert f > 0 and b > 0 and u == 0.0 and made == []
    assert WholeStep(f, b, u, 1.0, 1.0, 1.0).ratio("update") == 1.0


def test_the_profiler_calibrates_with_the_gpu_band_where_it_synchronises_cuda(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """profile_graph tells calibrate ``on_gpu`` exactly when its per-sample sync is CUDA's
    (stood in for by a no-op here: this machine has no GPU)."""
    import fxpipe.costmodel.profiler as prof

    seen: list[bool] = []
    monkeypatch.setattr(prof, "calibrate", lambda *a, on_gpu, **k: seen.append(on_gpu))
    gm = traced(Net(), torch.randn(8, 6))
    profile_graph(gm, (torch.randn(8, 6),), **FAST)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(prof, "_sync_fn", lambda *a: torch.cuda.synchronize)
    profile_graph(gm, (torch.randn(8, 6),), **FAST)
    assert seen == [False, True]
