"""The live-tensor counter (runtime/replica/live_bytes.py) against sums written by hand."""
from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

from fxpipe.runtime.replica.live_bytes import LiveBytes, PeakMemory, reachable_storages

F32 = 4


def test_counts_each_storage_once_and_frees() -> None:
    with LiveBytes() as m:
        a = torch.zeros(1000)                      # 4,000 bytes
        v = a.view(10, 100).t()                    # a view: nothing new
        assert (m.current, m.peak) == (4000, 4000)
        b = a * 2                                  # 4,000 more
        assert m.current == 8000
        del a, v
        gc.collect()
        assert m.current == 4000                   # a's storage went with its last view
        c = torch.empty(250)                       # 1,000
        assert (m.current, m.peak) == (5000, 8000)
        del b, c
    assert m.current == 0 and m.peak == 8000


def test_in_place_resize_is_counted() -> None:
    with LiveBytes() as m:
        one = torch.ones(10)                       # 40 bytes
        out = torch.empty(0)                       # 0
        torch.add(one, 1, out=out)                 # out resized to 40 bytes by the operator
        assert m.current == 80
        out.resize_(0)                             # a reused out= tensor, as torch asks
        torch.add(torch.ones(20), 1, out=out)      # the temporary freed, out grown to 80
        assert (m.current, m.peak) == (120, 40 + 80 + 80)


@pytest.mark.slow
def test_linear_forward_backward_by_hand() -> None:
    """A Linear(256, 256) with ReLU and a sum on a 64 x 256 input that requires grad. Seeded
    with the weights (W 262,144 bytes, b 1,024) and the input (65,536)."""
    torch.manual_seed(0)
    lin = nn.Linear(256, 256)
    x = torch.randn(64, 256, requires_grad=True)
    w, b, xb = 256 * 256 * F32, 256 * F32, 64 * 256 * F32
    m = LiveBytes(st for t in (lin.weight, lin.bias, x) for st in [t.untyped_storage()])
    assert m.current == w + b + xb
    with m:
        h = lin(x)                # addmm output 64 x 256 (W.t() is a view)
        y = torch.relu(h)         # relu output, saved for backward
        loss = y.sum()            # a scalar
        fwd = w + b + xb + 2 * xb + F32
        assert m.current == fwd
        loss.backward()
    gc.collect()
    # after backward: the graph and its saved tensors are gone; h, y and loss are still
    # referenced here; the three gradients are new
    assert m.current == fwd + w + b + xb
    # peak during backward: at least the gradients plus what is alive after the forward
    assert m.peak >= m.current
    del h, y, loss
    gc.collect()
    assert m.current == w + b + xb + w + b + xb


def test_reachable_storages_walks_fxpipe_objects_not_modules() -> None:
    from fxpipe.runtime.replica.stash import WeightStash

    lin = nn.Linear(8, 4)
    stash = WeightStash(dict(lin.named_parameters()), lambda ps: torch.optim.Adam(ps))
    found = reachable_storages(stash)
    # the stash's own copies of W (128 bytes) and b (16); the Linear's are not the stash's
    assert sorted(st.nbytes() for st in found) == [16, 128]
    ids = {st.data_ptr() for st in found}
    assert lin.weight.data_ptr() not in ids
    # an optimizer step adds Adam's two moments per parameter (and its step counters)
    for t in stash.latest.values():
        t.grad = torch.ones_like(t)
    stash.optimizer.step()
    sizes = sorted(st.nbytes() for st in reachable_storages(stash))
    assert sizes.count(128) == 4 and sizes.count(16) == 4  # weight, grad, exp_avg, exp_avg_sq
    holder = {"model": lin}  # a module inside a container is not entered
    assert reachable_storages(holder) == []


def test_peak_memory_restart_keeps_the_peak() -> None:
    held: list[torch.Tensor] = [torch.zeros(100)]
    pm = PeakMemory(torch.device("cpu"), lambda: [t.untyped_storage() for t in held])
    with pm:
        tmp = torch.zeros(1000)
        del tmp
    assert pm.peak == 400 + 4000
    pm.restart()
    held[:] = [torch.zeros(10)]
    with pm:
        pass
    assert pm.peak == 4400  # the first replica's peak stays the peak


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_peak_memory_cuda() -> None:
    dev = torch.device("cuda")
    pm = PeakMemory(dev, lambda: [])
    with pm:
        t = torch.empty(1 << 20, device=dev)
        del t
    assert pm.peak >= 4 << 20
