"""The stash's copy of the weights, measured or estimated per model, and the overheads a profile
carries (fxpipe.costmodel.update, fxpipe.costmodel.overheads)."""
from __future__ import annotations

import torch
from torch import nn

from fxpipe.costmodel import Profile, estimate_graph, get_device, profile_graph, to_profile
from fxpipe.costmodel.overheads import Overheads, with_overheads
from fxpipe.costmodel.update import measure_stash_copy
from fxpipe.tracing import trace


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))


def test_estimated_copy_reads_and_writes_every_weight_once() -> None:
    """(32 x 64 + 64 + 64 x 8 + 8) floats = 2632 x 4 bytes, read and written at the V100's
    900 GB/s, plus one 5 us launch."""
    traced = trace(mlp(), (torch.randn(4, 32),))
    estimate_graph(traced.gm, traced.flat_inputs, "V100")
    prof = to_profile(traced.gm, batch_size=4)
    dev = get_device("V100")
    assert prof.meta["stash_copy_s"] == 2 * 2632 * 4 / dev.mem_bandwidth + dev.launch_overhead_s


def test_measured_copy_is_timed_per_group_and_summed() -> None:
    """Groups of at most ``group_bytes``: with 1-byte groups every parameter is its own group,
    four calls, each timed once by the timer passed in (which counts and says 1 ms)."""
    traced = trace(mlp(), (torch.randn(4, 32),))
    calls: list[int] = []

    def timer(thunk) -> float:
        thunk()
        calls.append(1)
        return 1e-3

    assert measure_stash_copy(traced.gm, timer, group_bytes=1) == 4e-3 and len(calls) == 4
    calls.clear()
    assert measure_stash_copy(traced.gm, timer) == 1e-3 and len(calls) == 1
    before = [p.detach().clone() for p in traced.gm.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(before, traced.gm.parameters()))


def test_the_profiler_records_the_copy() -> None:
    traced = trace(mlp(), (torch.randn(4, 32),))
    profile_graph(traced.gm, traced.flat_inputs, repeats=2, whole_step=False)
    assert to_profile(traced.gm, batch_size=4).meta["stash_copy_s"] > 0


def test_a_saved_profile_keeps_its_overheads(tmp_path) -> None:
    traced = trace(mlp(), (torch.randn(4, 32),))
    estimate_graph(traced.gm, traced.flat_inputs, "V100")
    prof = to_profile(traced.gm, batch_size=4)
    assert prof.overheads == Overheads()
    ov = Overheads(action_s=1e-4, message_s=2e-4, tensor_s=3e-6, source="test")
    prof = Profile(nodes=prof.nodes, batch_size=4, meta=with_overheads(prof.meta, ov))
    prof.save(tmp_path / "p.json")
    assert Profile.load(tmp_path / "p.json").overheads == ov
