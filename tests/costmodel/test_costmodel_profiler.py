"""Measured profiling: backward really measured, and no side effects on the model."""
from __future__ import annotations

import logging

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from cm_helpers import FakeClock, meta, traced

from fxpipe.costmodel import profile_graph, to_profile
from fxpipe.errors import InputMismatchError

FAST = dict(warmup=1, repeats=2)


class SmallNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.drop = nn.Dropout(0.5)
        self.fc = nn.Linear(8 * 8 * 8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn(self.conv(x)), inplace=True)
        return self.fc(self.drop(torch.flatten(y, 1)))


def test_forward_and_backward_measured() -> None:
    gm = traced(SmallNet(), torch.randn(4, 3, 8, 8))
    profile_graph(gm, (torch.randn(4, 3, 8, 8),), **FAST)
    for name in ("conv", "bn", "fc"):
        assert meta(gm, name)["forward_s"] > 0
        assert meta(gm, name)["backward_s"] > 0, name
    assert meta(gm, "x")["forward_s"] == 0 and meta(gm, "x")["backward_s"] == 0
    assert meta(gm, "conv")["parameter_bytes"] == (8 * 27 + 8) * 4  # annotate_parameters ran
    # torch.flatten is a view but it still has a (tiny) measured backward
    assert meta(gm, "flatten")["backward_s"] > 0


def test_exactly_the_differentiable_nodes_get_a_backward(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under a clock that ticks once per reading every timed call takes exactly one tick, so the
    times say which calls were timed: a forward for every compute node, a backward for every node
    with a gradient to compute (flatten, a view, included), none for the input."""
    import types

    import fxpipe.costmodel.profiler as profiler

    clock = FakeClock()
    monkeypatch.setattr(profiler, "time", types.SimpleNamespace(perf_counter=clock.perf_counter))
    gm = traced(SmallNet(), torch.randn(4, 3, 8, 8))
    profile_graph(gm, (torch.randn(4, 3, 8, 8),), **FAST)
    got = {n.name: (n.meta["fxpipe"]["forward_s"], n.meta["fxpipe"]["backward_s"])
           for n in gm.graph.nodes if n.op != "output"}
    tick = FakeClock.TICK
    assert got == {"x": (0.0, 0.0), "conv": (tick, tick), "bn": (tick, tick),
                   "relu": (tick, tick), "flatten": (tick, tick), "drop": (tick, tick),
                   "fc": (tick, tick)}


def test_profiling_has_no_side_effects() -> None:
    model = SmallNet()
    model.eval()
    model.drop.train()  # mixed modes must come back exactly
    with torch.no_grad():
        model.bn.running_mean.uniform_()
    gm = traced(model, torch.randn(4, 3, 8, 8))
    params = {k: v.detach().clone() for k, v in gm.named_parameters()}
    buffers = {k: v.detach().clone() for k, v in gm.named_buffers()}
    modes = {k: m.training for k, m in gm.named_modules()}
    x = torch.randn(4, 3, 8, 8)
    rng = torch.get_rng_state()
    profile_graph(gm, (x,), **FAST)
    assert torch.equal(torch.get_rng_state(), rng)
    for k, v in gm.named_parameters():
        assert torch.equal(v, params[k]), k
        assert v.grad is None, k
    for k, v in gm.named_buffers():
        assert torch.equal(v, buffers[k]), k
    assert {k: m.training for k, m in gm.named_modules()} == modes


def test_existing_grads_untouched() -> None:
    gm = traced(SmallNet(), torch.randn(2, 3, 8, 8))
    gm(torch.randn(2, 3, 8, 8)).sum().backward()
    grads = {k: v.grad.clone() for k, v in gm.named_parameters()}
    profile_graph(gm, (torch.randn(2, 3, 8, 8),), **FAST)
    for k, v in gm.named_parameters():
        assert torch.equal(v.grad, grads[k]), k


class InPlaceAndTuples(nn.Module):
    """In-place ops, a tuple-returning op and an LSTM (nested tuple output)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.act = nn.ReLU(inplace=True)
        self.lstm = nn.LSTM(3, 4, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.act(self.fc(x))
        y.add_(1.0)
        a, b = torch.chunk(y, 2, dim=-1)
        out, _ = self.lstm(a.unsqueeze(1))
        return out.squeeze(1).sum(-1) + b.sum(-1)


def test_inplace_and_tuple_outputs() -> None:
    model = InPlaceAndTuples()
    x = torch.randn(5, 6)
    expected = model(x.clone())
    gm = traced(model, x)
    profile_graph(gm, (x,), **FAST)
    assert torch.allclose(gm(x.clone()), expected)
    assert meta(gm, "chunk")["backward_s"] > 0   # tuple output: both halves differentiated
    assert meta(gm, "lstm")["backward_s"] > 0    # nested tuple (out, (h, c))
    assert meta(gm, "act")["backward_s"] > 0     # in-place module
    assert meta(gm, "add_")["forward_s"] > 0     # in-place method
    assert meta(gm, "chunk")["sendable"] is False  # a tuple of tensors cannot cross a cut
    prof = to_profile(gm)
    assert prof.names[0] == "x" and prof.nodes[-1].inputs


def test_integer_and_no_grad_paths_have_no_backward() -> None:
    class Masked(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(10, 4)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            mask = (ids > 0).float().unsqueeze(-1)  # computed from the input alone
            return self.embed(ids) * mask

    ids = torch.tensor([[0, 3, 5]])
    gm = traced(Masked(), ids)
    profile_graph(gm, (ids,), **FAST)
    assert meta(gm, "gt")["backward_s"] == 0
    assert meta(gm, "float_1")["backward_s"] == 0
    assert meta(gm, "embed")["backward_s"] > 0  # weight gradient
    assert meta(gm, "mul")["backward_s"] > 0


def test_bad_example_inputs() -> None:
    gm = traced(SmallNet(), torch.randn(1, 3, 8, 8))
    with pytest.raises(InputMismatchError, match="2 example inputs"):
        profile_graph(gm, (torch.randn(1, 3, 8, 8), torch.randn(1)), **FAST)
    with pytest.raises(InputMismatchError, match="node 'conv'"):
        profile_graph(gm, (torch.randn(1, 5, 8, 8),), **FAST)


def test_mini_cnn_profiles_every_node(caplog: pytest.LogCaptureFixture) -> None:
    """94 nodes, default warm-up and repeats (how long it takes: bench/plan_speed.py)."""
    def block(c: int) -> nn.Module:
        return nn.Sequential(nn.Conv2d(c, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU())

    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), *[block(8) for _ in range(30)],
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10))
    x = torch.randn(4, 3, 16, 16)
    gm = traced(model, x)
    with caplog.at_level(logging.INFO, logger="fxpipe.costmodel.profiler"):
        profile_graph(gm, (x,))
    assert len(gm.graph.nodes) == 96  # x, 94 compute nodes, output
    assert f"profiled {len(gm.graph.nodes)} nodes" in caplog.text
    prof = to_profile(gm, batch_size=4)
    assert prof.total_parameter_bytes == sum(p.numel() * 4 for p in model.parameters())
    assert all(n.compute_s > 0 for n in prof.nodes if n.op == "call_module")


class HiddenInPlace(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, scale: float = 2.0) -> torch.Tensor:
        y = self.fc(x)
        y.mul_(2)
        return y.view(x.size(0), -1) * scale


def test_unforeseen_inplace_write_is_retried(monkeypatch: pytest.MonkeyPatch) -> None:
    import fxpipe.costmodel.profiler as profiler

    monkeypatch.setattr(profiler, "_is_inplace", lambda node, gm: False)
    x = torch.randn(3, 4)
    gm = traced(HiddenInPlace(), x)
    expected = gm(x)
    profile_graph(gm, (x,), **FAST)  # placeholder 'scale' takes its default
    assert meta(gm, "mul_")["forward_s"] > 0
    assert torch.allclose(gm(x), expected)
    assert meta(gm, "scale")["sendable"] is True


def test_profiles_with_host_memory_kept_as_the_ranks_keep_it(monkeypatch) -> None:
    """Every rank keeps freed host memory in the process; the profile is measured the same
    way, before the first node is timed (else it prices page faults no rank pays: 14-25% of
    VGG16's step on this machine, fxpipe/host_memory.py)."""
    import fxpipe.costmodel.profiler as profiler

    events: list[str] = []
    monkeypatch.setattr(profiler, "keep_freed_memory", lambda: events.append("keep") or True)
    real_timing = profiler._timing
    monkeypatch.setattr(profiler, "_timing",
                        lambda *a, **k: events.append("time") or real_timing(*a, **k))
    gm = traced(SmallNet(), torch.randn(4, 3, 8, 8))
    profile_graph(gm, (torch.randn(4, 3, 8, 8),), **FAST)
    assert events[0] == "keep" and "time" in events
