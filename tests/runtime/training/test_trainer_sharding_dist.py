"""``shard="optimizer"`` under torchrun: a replicated stage's AdamW state split over its 2 and 3
replicas (torch's ZeroRedundancyOptimizer on the stage's replica group) trains what the unsharded
run trains, and a checkpoint gathers the shards so that a resume after a crash reaches exactly
the uninterrupted sharded run's weights; and what a sharded group holds is what the memory walk
predicts."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from rt_procs import HERE, _port, _run, _torchrun


def _train(tmp: Path, name: str, replicas: int, *extra: str):
    out = tmp / f"{name}.pt"
    # 2 epochs of 20 (R = 2) or 30 (R = 3) minibatches: 20 pipedream updates per replica
    res = _torchrun(str(out), "--ckpt", str(tmp / name), "--replicas", str(replicas),
                    "--optimizer", "adamw", "--dropout", "0", "--samples",
                    str(40 * replicas), *extra, nproc=2 * replicas)
    assert res.returncode == 0, res.stdout[-3000:]
    return torch.load(out, weights_only=True)


@pytest.mark.multiprocess
@pytest.mark.parametrize("replicas", [2, 3])
def test_sharded_optimizer_state_trains_what_the_whole_one_trains(tmp_path: Path,
                                                                  replicas: int) -> None:
    whole = _train(tmp_path, "whole", replicas)
    sharded = _train(tmp_path, "sharded", replicas, "--shard", "optimizer")
    # stage 0 is one Linear layer: its weight and bias; sharded, the first replica steps one
    assert whole["optimizer_states"] == 2 and sharded["optimizer_states"] == 1
    assert whole["state"].keys() == sharded["state"].keys()
    for name, t in whole["state"].items():
        torch.testing.assert_close(sharded["state"][name], t, rtol=1e-5, atol=1e-5)
    assert [h["loss"] for h in sharded["history"]] == pytest.approx(
        [h["loss"] for h in whole["history"]], rel=1e-5)
    # the checkpoint holds the whole optimizer state, gathered from the shards
    ckpt = sorted((tmp_path / "sharded").glob("e*"))[-1] / "stage0.pt"
    state = torch.load(ckpt, weights_only=True)["optimizer"]["state"]
    assert len(state) == 2 and all("exp_avg" in v for v in state.values())
    args = ["--replicas", str(replicas), "--optimizer", "adamw", "--dropout", "0", "--samples",
            str(40 * replicas), "--shard", "optimizer"]
    crashed = _torchrun(str(tmp_path / "run.pt"), "--ckpt", str(tmp_path / "run"), *args,
                        "--crash-after", "7", nproc=2 * replicas)
    assert crashed.returncode != 0 and not (tmp_path / "run.pt").exists()
    resumed = _torchrun(str(tmp_path / "run.pt"), "--ckpt", str(tmp_path / "run"), *args,
                        "--resume", nproc=2 * replicas)
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    got = torch.load(tmp_path / "run.pt", weights_only=True)
    for name, t in sharded["state"].items():
        assert torch.equal(got["state"][name], t), name


def _memory_job(tmp: Path, shard: str) -> dict:
    out = tmp / f"{shard}.json"
    res = _run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=3",
                "--master-addr=127.0.0.1", f"--master-port={_port()}",
                str(HERE / "shard_memory_job.py"), str(out), "--shard", shard])
    assert res.returncode == 0, res.stdout[-3000:]
    return json.loads(out.read_text())


@pytest.mark.multiprocess
def test_a_sharded_groups_measured_peak_is_the_walked_one(tmp_path: Path) -> None:
    """Stage 1 of tests/runtime/shard_memory_job.py (P1 bytes of float32 weights, AdamW) on 2
    replicas: unsharded each holds its weights, gradient sums, gradient bucket and both moments
    at its peak (5 P1), sharded one moment's worth less (4 P1). The walk
    (``compiled.memory_check``: the plan's state, the buckets, the schedule's buffers) is
    within 10% of each rank's measured peak of live tensors, sharded or not."""
    got = {shard: _memory_job(tmp_path, shard) for shard in ("never", "optimizer")}
    P1 = got["never"]["parameter_bytes"][1]
    for shard, run in got.items():
        assert run["replicas"] == [1, 2] and run["shard"] == (None if shard == "never"
                                                               else "optimizer")
        for stage, (measured, walked) in enumerate(zip(run["measured"], run["walked"])):
            assert 0.9 <= measured / walked <= 1.1, (shard, stage, measured, walked)
    assert got["never"]["state_bytes"][1] - got["optimizer"]["state_bytes"][1] == P1
    saved = got["never"]["measured"][1] - got["optimizer"]["measured"][1]
    assert abs(saved - P1) <= 0.02 * P1, (saved, P1)
    assert got["never"]["measured"][0] == got["optimizer"]["measured"][0]  # one replica
