"""The Trainer under torchrun (2 gloo ranks): resume after a real crash, and `fxpipe train`."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from rt_procs import HERE, _port, _run, _torchrun


@pytest.mark.multiprocess
def test_distributed_resume_after_a_crash_matches_uninterrupted_and_reference(tmp_path: Path
                                                                              ) -> None:
    ref = _run([sys.executable, str(HERE / "trainer_job.py"), str(tmp_path / "ref.pt"),
                "--ckpt", str(tmp_path / "ref"), "--executor", "reference"])
    assert ref.returncode == 0, ref.stdout[-3000:]
    # the uninterrupted run records its timeline: recording must not change a single bit
    full = _torchrun(str(tmp_path / "full.pt"), "--ckpt", str(tmp_path / "full"), "--timeline")
    assert full.returncode == 0, full.stdout[-3000:]
    crashed = _torchrun(str(tmp_path / "run.pt"), "--ckpt", str(tmp_path / "run"),
                        "--crash-after", "5")  # mid epoch 2, after checkpoint (1, 2)
    assert crashed.returncode != 0 and not (tmp_path / "run.pt").exists()
    resumed = _torchrun(str(tmp_path / "run.pt"), "--ckpt", str(tmp_path / "run"), "--resume")
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    want = torch.load(tmp_path / "full.pt", weights_only=True)
    got = torch.load(tmp_path / "run.pt", weights_only=True)
    oracle = torch.load(tmp_path / "ref.pt", weights_only=True)
    for name, t in want["state"].items():
        assert torch.equal(got["state"][name], t), name
        torch.testing.assert_close(oracle["state"][name], t, rtol=1e-6, atol=1e-7)
    assert [h["loss"] for h in got["history"]] == [h["loss"] for h in want["history"]]
    # 7 minibatches per epoch in segments of checkpoint_every=2; rank 0 runs each F and B once
    assert want["timelines"] == [[n, n] for n in [2, 2, 2, 1] * 2]
    assert got["timelines"] == []  # not recorded unless asked
    # nothing gathered to rank 0 by fit; state_dict() gathers once, on request
    assert want["gathers"] == got["gathers"] == [0, 1]


@pytest.mark.multiprocess
def test_surplus_ranks_say_so_and_leave_while_the_plan_trains(tmp_path: Path) -> None:
    """3 processes for a 2-rank plan (the planner chose fewer workers than launched): rank 2
    logs that it is idle and exits 0; ranks 0-1 train exactly what the reference trains."""
    res = _torchrun(str(tmp_path / "out.pt"), "--ckpt", str(tmp_path / "ck"), nproc=3)
    assert res.returncode == 0, res.stdout[-3000:]
    assert "rank 2 is idle: the plan uses 2 of the job's 3 processes" in res.stdout
    ref = _run([sys.executable, str(HERE / "trainer_job.py"), str(tmp_path / "ref.pt"),
                "--ckpt", str(tmp_path / "ref"), "--executor", "reference"])
    assert ref.returncode == 0, ref.stdout[-3000:]
    got = torch.load(tmp_path / "out.pt", weights_only=True)["state"]
    want = torch.load(tmp_path / "ref.pt", weights_only=True)["state"]
    assert got.keys() == want.keys()
    for name, t in want.items():
        torch.testing.assert_close(got[name], t, rtol=1e-6, atol=1e-7)


@pytest.mark.multiprocess
def test_a_script_that_never_closes_leaves_the_job_before_the_interpreter_ends(tmp_path: Path
                                                                             ) -> None:
    """The README's script ends without trainer.close(): fxpipe's exit hook closes the process
    group while the interpreter is whole (a gloo thread torn down in finalisation aborted a rank
    with 'terminate called without an active exception' after a completed run in CI)."""
    res = _torchrun(str(tmp_path / "out.pt"), "--ckpt", str(tmp_path / "ck"), "--no-close")
    assert res.returncode == 0, res.stdout[-3000:]
    for rank in (0, 1):
        assert f"rank {rank} at exit: process group closed" in res.stdout, res.stdout[-3000:]
    assert "terminate called" not in res.stdout


def test_exit_after_an_uncaught_exception_leaves_without_the_closing_barrier(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """After an uncaught exception the peers may be gone: waiting for them at the closing barrier
    would hold a failed rank (and torchrun's verdict) for the pipeline timeout."""
    from fxpipe.runtime.execution import leave

    seen: list[bool] = []

    class Backend:
        def close(self, barrier: bool = True) -> None:
            seen.append(barrier)

    for failed in (False, True):
        monkeypatch.setitem(leave._STATE, "failed", failed)
        monkeypatch.setitem(leave._STATE, "hooked", True)  # no real hooks in the test process
        b = Backend()
        leave.close_at_exit(b)
        leave.leave_all()
    assert seen == [True, False]


@pytest.mark.multiprocess
def test_ranks_reading_different_data_stop_before_training(tmp_path: Path) -> None:
    """Each rank's loader seeded by its rank: rank 0 would feed one minibatch's inputs, rank 1
    compare the outputs with another minibatch's targets. Both stop at the first segment."""
    res = _torchrun(str(tmp_path / "out.pt"), "--ckpt", str(tmp_path / "ck"), "--rank-data")
    assert res.returncode != 0 and not (tmp_path / "out.pt").exists()
    assert "rank 1 read different minibatches of epoch 0 segment at 0 than rank 0" in res.stdout
    assert "no DistributedSampler" in res.stdout


def test_stage_may_start_with_an_in_place_op() -> None:
    """A received activation is a leaf that requires grad; a stage starting with
    ReLU(inplace=True) (AlexNet cut before a ReLU) must still run and give input gradients."""
    from fxpipe.codegen.split import placed_nodes, split_graph
    from fxpipe.runtime.replica.stage import StageReplica

    gm = torch.fx.symbolic_trace(nn.Sequential(nn.Linear(2, 2), nn.ReLU(inplace=True)))
    specs = split_graph(gm, {n.name: int(i > 1) for i, n in enumerate(placed_nodes(gm))})
    rep = StageReplica(specs[1], torch.optim.SGD, loss_fn=lambda o, t: o.sum())
    x = torch.tensor([[-1.0, 2.0]])
    _, loss = rep.forward(0, None, [x], None)
    assert loss == 2.0
    (grad,) = rep.backward(0, [None])
    torch.testing.assert_close(grad, torch.tensor([[0.0, 1.0]]))


@pytest.mark.multiprocess
def test_fxpipe_train_alexnet_end_to_end(tmp_path: Path) -> None:
    res = _run([sys.executable, "-m", "fxpipe.cli_train", "train", "alexnet", "--data",
                "synthetic", "--nproc", "2", "--epochs", "1", "--num-batches", "4",
                "--eval-batches", "1", "--no-progress", "--save", str(tmp_path / "w.pt")])
    assert res.returncode == 0, res.stdout[-4000:]
    assert "epoch 1: loss " in res.stdout and "eval_accuracy" in res.stdout
    assert (tmp_path / "w.pt").exists()


@pytest.mark.multiprocess
def test_fxpipe_train_world_size_mismatch_fails_fast(tmp_path: Path) -> None:
    from fxpipe.api import compile as fx_compile
    from fxpipe.models import get

    spec = get("alexnet")
    plan = fx_compile(spec.model, 3, example_inputs=spec.example_inputs, stages=3,
                      straight=True, repeats=1).plan
    plan.save(tmp_path / "plan.json")
    res = _run([sys.executable, "-m", "fxpipe.cli_train", "train", "alexnet", "--data",
                "synthetic", "--nproc", "2", "--plan", str(tmp_path / "plan.json")], timeout=60)
    assert res.returncode == 2  # the launcher's own usage error: no worker was started
    assert "--nproc 2 but the plan" in res.stdout and "needs 3 processes" in res.stdout
    # the same mismatch inside a torchrun job (a user launching workers by hand): every rank
    # refuses before it joins the process group
    res = _run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
                "--master-addr=127.0.0.1", f"--master-port={_port()}", "-m", "fxpipe.cli_train",
                "alexnet", "--data", "synthetic", "--plan", str(tmp_path / "plan.json")],
               timeout=90)
    assert res.returncode != 0
    assert "the job has 2 processes but the plan needs 3" in res.stdout


def test_digits_without_scikit_learn_names_the_package(monkeypatch: pytest.MonkeyPatch) -> None:
    from fxpipe.cli_train import _check_data
    from fxpipe.errors import ConfigError

    monkeypatch.setitem(sys.modules, "sklearn", None)  # as if scikit-learn were not installed
    with pytest.raises(ConfigError, match="scikit-learn"):
        _check_data("digits")
    with pytest.raises(ConfigError, match="unknown dataset 'mnist'"):
        _check_data("mnist")
