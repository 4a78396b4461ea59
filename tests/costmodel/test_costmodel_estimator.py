"""Analytical estimates: exact FlopCounterMode FLOPs and the roofline formula."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from cm_helpers import meta, traced

from fxpipe.costmodel import DEVICES, DeviceSpec, estimate_graph, get_device, to_profile
from fxpipe.errors import ConfigError

B, IN, HID, OUT = 8, 32, 16, 4


class TwoLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(IN, HID)
        self.fc2 = nn.Linear(HID, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)).reshape(B, HID))


def test_linear_flops_exact() -> None:
    x = torch.randn(B, IN)
    gm = estimate_graph(traced(TwoLinear(), x), (x,), "v100")
    fc1, fc2 = meta(gm, "fc1"), meta(gm, "fc2")
    assert fc1["flops"] == 2 * B * IN * HID
    assert fc2["flops"] == 2 * B * HID * OUT
    # fc2's input needs a gradient (it depends on fc1): dgrad + wgrad = exactly 2x forward
    assert fc2["backward_flops"] == 2 * fc2["flops"]
    # fc1 reads the model input, whose gradient training never computes: wgrad only
    assert fc1["backward_flops"] == fc1["flops"]
    assert meta(gm, "relu")["flops"] == 0 and meta(gm, "relu")["forward_s"] > 0  # memory bound
    assert meta(gm, "x")["forward_s"] == 0 and meta(gm, "x")["flops"] == 0


def test_conv_flops_exact() -> None:
    conv = nn.Conv2d(3, 8, 3, padding=1)
    x = torch.randn(2, 3, 10, 10)
    gm = estimate_graph(traced(nn.Sequential(conv), x), (x,), DEVICES["a100"])
    assert meta(gm, "_0")["flops"] == 2 * 2 * 8 * 10 * 10 * 3 * 3 * 3
    assert meta(gm, "_0")["backward_s"] > 0


def test_roofline_formula() -> None:
    spec = DeviceSpec("toy", flops=1e9, mem_bandwidth=1e9, memory=1e9, efficiency=0.5,
                      launch_overhead_s=1e-6)
    x = torch.randn(B, IN)
    gm = estimate_graph(traced(TwoLinear(), x), (x,), spec)
    m = meta(gm, "fc1")
    # input + output + weight + bias, fp32
    assert m["bytes_moved"] == 4 * (B * IN + B * HID + IN * HID + HID)
    assert m["forward_s"] == pytest.approx(
        max(m["flops"] / 0.5e9, m["bytes_moved"] / 1e9) + 1e-6)
    assert m["backward_s"] == pytest.approx(
        max(m["backward_flops"] / 0.5e9, 2 * m["bytes_moved"] / 1e9) + 1e-6)
    view = meta(gm, "reshape")  # a view moves nothing and launches nothing
    assert view["bytes_moved"] == 0 and view["forward_s"] == 0 and view["backward_s"] == 0
    prof = to_profile(gm, device="toy", source="estimate")
    assert prof.device == "toy" and prof.total_compute_s > 0


# a device whose every kind of unit has its own peak, so the time says which one was used
ARITH = DeviceSpec("arith", flops=1e9, mem_bandwidth=1e15, memory=1e9, efficiency=0.5,
                   launch_overhead_s=0.0, tf32_flops=4e9, bf16_flops=16e9, fp16_flops=32e9)


@pytest.fixture
def torch_tf32():
    """torch's TF32 settings, restored after the test."""
    saved = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    yield
    torch.set_float32_matmul_precision(saved[0])
    torch.backends.cudnn.allow_tf32 = saved[1]


def test_peak_per_arithmetic_from_the_datasheets() -> None:
    h100, v100 = DEVICES["h100"], DEVICES["v100"]
    assert h100.peak_flops("float32") == 67e12           # torch's default: no TF32 products
    assert h100.peak_flops("float32", tf32=True) == 494.7e12
    assert h100.peak_flops("bfloat16") == h100.peak_flops("float16") == 989.4e12
    assert DEVICES["a100"].peak_flops("bfloat16") == 312e12
    # Volta: fp16 tensor cores only; TF32 and bf16 run on the plain cores
    assert v100.peak_flops("float16") == 125e12
    assert v100.peak_flops("bfloat16") == v100.peak_flops("float32", tf32=True) == 15.7e12
    assert h100.peak_flops("float64") == 67e12           # anything else: float32's figure


@pytest.mark.parametrize("dtype, precision, peak", [
    (torch.float32, "highest", 1e9),    # torch's default: the plain cores
    (torch.float32, "high", 4e9),       # set_float32_matmul_precision("high"): TF32
    (torch.bfloat16, "highest", 16e9),
    (torch.float16, "highest", 32e9),
])
def test_a_product_is_timed_at_its_arithmetics_peak(torch_tf32, dtype: torch.dtype,
                                                     precision: str, peak: float) -> None:
    torch.set_float32_matmul_precision(precision)
    x = torch.randn(B, IN, dtype=dtype)
    gm = estimate_graph(traced(TwoLinear().to(dtype), x), (x,), ARITH)
    m = meta(gm, "fc2")  # input needs a gradient: backward = 2x forward FLOPs
    assert m["forward_s"] == pytest.approx(2 * B * HID * OUT / (0.5 * peak))
    assert m["backward_s"] == pytest.approx(2 * 2 * B * HID * OUT / (0.5 * peak))


@pytest.mark.parametrize("cudnn_tf32, peak", [(True, 4e9), (False, 1e9)])
def test_a_convolution_follows_cudnns_tf32_setting(torch_tf32, cudnn_tf32: bool,
                                                   peak: float) -> None:
    torch.backends.cudnn.allow_tf32 = cudnn_tf32  # on by default: convolutions use TF32
    torch.set_float32_matmul_precision("highest")  # products do not
    x = torch.randn(2, 3, 10, 10)
    gm = estimate_graph(traced(nn.Sequential(nn.Conv2d(3, 8, 3, padding=1)), x), (x,), ARITH)
    assert meta(gm, "_0")["forward_s"] == pytest.approx(2 * 2 * 8 * 10 * 10 * 3 * 3 * 3
                                                        / (0.5 * peak))


def test_faster_device_is_faster() -> None:
    x = torch.randn(256, 256)
    gm = traced(nn.Sequential(nn.Linear(256, 256), nn.GELU()), x)
    slow = to_profile(estimate_graph(gm, (x,), "cpu")).total_compute_s
    fast = to_profile(estimate_graph(gm, (x,), "h100")).total_compute_s
    assert fast < slow


def test_unknown_device() -> None:
    with pytest.raises(ConfigError, match="unknown device 'tpu9'") as e:
        get_device("tpu9")
    assert "V100" in str(e.value) and "H100" in str(e.value)
    assert get_device("A100") is DEVICES["a100"]
    x = torch.randn(B, IN)
    with pytest.raises(ConfigError, match="known devices"):
        estimate_graph(traced(TwoLinear(), x), (x,), "tpu9")


def test_estimator_has_no_side_effects() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)).eval()
    x = torch.randn(3, 4)
    gm = traced(model, x)
    before = {k: v.clone() for k, v in gm.state_dict().items()}
    estimate_graph(gm, (x,), "v100")
    assert not gm.training
    assert all(torch.equal(v, before[k]) for k, v in gm.state_dict().items())
    assert all(p.grad is None for p in gm.parameters())


class Repeated(nn.Module):
    """Four identical blocks of function calls (a matmul with a weight, a bias, a GELU), then
    one of another width: the estimator counts each distinct backward once."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.ParameterList([nn.Parameter(torch.randn(HID, HID)) for _ in range(4)])
        self.b = nn.ParameterList([nn.Parameter(torch.randn(HID)) for _ in range(4)])
        self.out = nn.Parameter(torch.randn(HID, OUT))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for w, b in zip(self.w, self.b):
            x = torch.nn.functional.gelu(torch.matmul(x, w) + b)
        return torch.matmul(x, self.out)


def test_repeated_blocks_are_estimated_as_each_alone(monkeypatch) -> None:
    import fxpipe.costmodel.estimator as est

    x = torch.randn(B, HID)
    calls = []
    real = torch.autograd.grad

    def grad(*a, **k):  # noqa: ANN002, ANN003, ANN202
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(torch.autograd, "grad", grad)
    fields = ("flops", "backward_flops", "bytes_moved", "forward_s", "backward_s", "update_s")

    def estimates() -> dict[str, tuple]:
        gm = estimate_graph(traced(Repeated(), x), (x,), "a100")
        return {n.name: tuple(n.meta["fxpipe"].get(f) for f in fields) for n in gm.graph.nodes
                if "fxpipe" in n.meta}

    shared = estimates()
    counted = len(calls)
    calls.clear()
    monkeypatch.setattr(est, "_backward_key", lambda *a: None)  # every backward counted alone
    alone = estimates()
    assert shared == alone
    assert counted < len(calls)  # the repeated blocks' backwards were not run again
    assert any((v[1] or 0) > 0 for v in shared.values())  # and backward FLOPs to count
