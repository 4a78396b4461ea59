"""Resume under another plan (runtime/training/repartition.py): a checkpoint written by one plan of
a model (stages, replicas) resumes under any other plan of the same model and trains on exactly as
an uninterrupted run would (reference executor, 1f1b-flush: every plan trains the same minibatch
sums, so every plan is one computation up to float rounding).

The oracle is the uninterrupted ONE-stage run: it shares no checkpoint, no re-partitioning and no
pipeline with the runs it judges."""
from __future__ import annotations

import json
import random
import shutil
import sys
from pathlib import Path

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from fxpipe.codegen.split import placed_nodes, split_graph
from fxpipe.runtime.training.checkpoint import CheckpointError, find_latest
from fxpipe.runtime.training.param_names import weight_decay_groups
from fxpipe.runtime.training.trainer import Trainer

M = 4  # microbatches per batch: the same under every plan, so every plan trains one computation
EPOCHS = 2


class Net(nn.Module):
    """Linear layers with a LayerNorm, a persistent buffer and a weight tied between two layers
    (held under two names when the two layers land on different stages)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.l1, self.l2 = nn.Linear(4, 8), nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.l3, self.l4, self.l5 = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 2)
        self.l4.weight = self.l2.weight
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.l1(x))
        h = self.norm(torch.tanh(self.l2(h)))
        h = torch.tanh(self.l3(h)) * self.scale
        h = torch.tanh(self.l4(h))
        return self.l5(h)


def stages(cuts: list[int]) -> list:
    gm = fx.symbolic_trace(Net())
    return split_graph(gm, {n.name: sum(i > c for c in cuts)
                            for i, n in enumerate(placed_nodes(gm))})


NODES = len(placed_nodes(fx.symbolic_trace(Net())))


def data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 4, generator=g), torch.randn(4, 2, generator=g)) for _ in range(16)]


def adamw(params: list[torch.Tensor], names: list[str]) -> torch.optim.Optimizer:
    """Two groups (decay / no decay) by name, as nanoGPT does: the groups a stage has depend on
    the plan, so re-partitioning must regroup the moments."""
    return torch.optim.AdamW(weight_decay_groups(params, names, 0.1), lr=0.01)


def warmup(step: int) -> float:
    return min(1.0, (step + 1) / 3)


def lambda_lr(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(opt, warmup)


class Crash(Exception):
    pass


def trainer(plan: tuple[list[int], list[int]], ckpt: Path, crash_after: int | None = None
            ) -> Trainer:
    cuts, replicas = plan
    seen: list[tuple[int, int]] = []

    def hook(epoch: int, pos: int) -> None:
        seen.append((epoch, pos))
        if len(seen) == crash_after:
            raise Crash(f"after checkpoint {seen[-1]}")
    return Trainer(stages(cuts), replicas, F.mse_loss, adamw, lr_scheduler=lambda_lr,
                   schedule="1f1b-flush", microbatches=M, checkpoint_dir=str(ckpt),
                   checkpoint_every=M, executor="reference", progress=False,
                   on_checkpoint=hook if crash_after else None)


def random_plan(rng: random.Random) -> tuple[list[int], list[int]]:
    k = rng.randint(0, 3)  # cuts: 1 to 4 stages
    cuts = sorted(rng.sample(range(1, NODES - 1), k))
    return cuts, [rng.choice([1, 1, 2, 4]) for _ in range(k + 1)]


@pytest.fixture(scope="module")
def oracle(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, list[float]]:
    t = trainer(([], [1]), tmp_path_factory.mktemp("oracle"))
    history = t.fit(data(), epochs=EPOCHS)
    return t.state_dict(), [h["loss"] for h in history]


def _check(t: Trainer, history: list[dict], oracle: tuple[dict, list[float]]) -> None:
    want, losses = oracle
    got = t.state_dict()
    for name, w in want.items():
        if name in got:  # a tied weight appears under the names its stages hold it by
            torch.testing.assert_close(got[name], w, rtol=1e-5, atol=1e-6, msg=name)
    assert {n for n in want} <= set(got) | {"l4.weight"}
    torch.testing.assert_close([h["loss"] for h in history], losses, rtol=1e-5, atol=1e-7)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(8))
def test_checkpoint_resumes_under_a_random_other_plan_as_if_uninterrupted(
        tmp_path: Path, seed: int, oracle: tuple[dict, list[float]]) -> None:
    rng = random.Random(seed)
    a, b = random_plan(rng), random_plan(rng)
    crash_after = rng.randint(1, EPOCHS * (len(data()) // M + 1) - 1)  # of 10 checkpoints
    with pytest.raises(Crash):
        trainer(a, tmp_path, crash_after).fit(data(), epochs=EPOCHS)
    resumed = trainer(b, tmp_path)
    history = resumed.fit(data(), epochs=EPOCHS, resume=True)
    _check(resumed, history, oracle)


@pytest.mark.slow
@pytest.mark.parametrize("a,b", [(([], [1]), ([2, 5], [1, 2, 1])),  # 1 stage -> 3 stages
                                 (([2, 5], [1, 2, 1]), ([], [1])),  # and back
                                 (([3], [2, 1]), ([3], [1, 1])),  # replicas only
                                 (([1, 4, 7], [1, 1, 1, 1]), ([6], [1, 2]))])
def test_chosen_plan_pairs(tmp_path: Path, a: tuple, b: tuple,
                           oracle: tuple[dict, list[float]]) -> None:
    with pytest.raises(Crash):
        trainer(a, tmp_path, crash_after=3).fit(data(), epochs=EPOCHS)
    assert find_latest(tmp_path, None).minibatch == 3 * M
    resumed = trainer(b, tmp_path)
    _check(resumed, resumed.fit(data(), epochs=EPOCHS, resume=True), oracle)


@pytest.mark.slow
def test_the_moments_move_with_their_parameters(tmp_path: Path) -> None:
    """After a resume from 1 stage onto 3, each stage's Adam state is the one the 1-stage run
    held for that very parameter (by name), not merely some state of the right shape."""
    with pytest.raises(Crash):
        trainer(([], [1]), tmp_path, crash_after=2).fit(data(), epochs=EPOCHS)
    saved = torch.load(find_latest(tmp_path, None).stage_file(0), weights_only=True)
    by_name = {n: saved["optimizer"]["state"][i] for i, n in enumerate(saved["optimizer_names"])}
    t = trainer(([2, 5], [1, 2, 1]), tmp_path)
    t.fit(data(), epochs=0, resume=True)  # loads, trains nothing
    for (s, _), w in t.local.items():
        opt = w.stash.optimizer
        names = {id(p): n for n, p in w.stash.latest.items()}
        for group in opt.param_groups:
            assert group["lr"] == pytest.approx(0.01 * warmup(2))  # two updates so far
            for p in group["params"]:
                name = "l2.weight" if names[id(p)] == "l4.weight" else names[id(p)]
                assert torch.equal(opt.state[p]["exp_avg"], by_name[name]["exp_avg"]), name
                assert torch.equal(opt.state[p]["exp_avg_sq"], by_name[name]["exp_avg_sq"])
        assert t.schedulers[(s, 0)].last_epoch == 2


class Other(Net):
    def __init__(self) -> None:
        super().__init__()
        self.l3 = nn.Linear(8, 8, bias=False)


@pytest.mark.slow
def test_a_different_model_is_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(Crash):
        trainer(([3], [1, 1]), tmp_path, crash_after=1).fit(data(), epochs=1)
    gm = fx.symbolic_trace(Other())
    other = Trainer(split_graph(gm, {n.name: 0 for n in placed_nodes(gm)}), [1], F.mse_loss,
                    adamw, schedule="1f1b-flush", microbatches=M, checkpoint_dir=str(tmp_path),
                    checkpoint_every=M, executor="reference", progress=False)
    with pytest.raises(CheckpointError, match=r"different model.*l3\.bias"):
        other.fit(data(), epochs=1, resume=True)


@pytest.mark.slow
def test_a_checkpoint_without_layout_resumes_only_under_its_own_plan(tmp_path: Path) -> None:
    """Checkpoints written before the layout was recorded: the same plan still resumes, another
    one is refused with what to do."""
    with pytest.raises(Crash):
        trainer(([3], [1, 1]), tmp_path, crash_after=1).fit(data(), epochs=1)
    found = find_latest(tmp_path, None)
    doc = json.loads((found.folder / "manifest.json").read_text())
    del doc["layout"]
    (found.folder / "manifest.json").write_text(json.dumps(doc))
    shutil.copytree(tmp_path, tmp_path / "copy", ignore=shutil.ignore_patterns("copy"))
    trainer(([3], [1, 1]), tmp_path).fit(data(), epochs=1, resume=True)
    for plan in (([5], [1, 1]), ([3], [2, 1])):
        with pytest.raises(CheckpointError, match="resumes only under the plan that wrote it"):
            trainer(plan, tmp_path / "copy").fit(data(), epochs=1, resume=True)


@pytest.mark.multiprocess
def test_torchrun_checkpoint_of_2_processes_resumes_on_3(tmp_path: Path,
                                                         oracle: tuple[dict, list[float]]) -> None:
    """Save under 2 ranks (2 stages), crash, resume under 3 ranks (another cut, stage 0 on 2
    replicas): the result is the uninterrupted one-stage run's."""
    from rt_procs import HERE, _port, _run

    def torchrun(n: int, *args: str) -> object:
        return _run([sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={n}",
                     "--master-addr=127.0.0.1", f"--master-port={_port()}",
                     str(HERE / "repartition_job.py"), str(tmp_path / "out.pt"), "--ckpt",
                     str(tmp_path / "ck"), *args])

    crashed = torchrun(2, "--cuts", "5", "--replicas", "1,1", "--crash-after", "4")
    assert crashed.returncode != 0 and not (tmp_path / "out.pt").exists()
    assert find_latest(tmp_path / "ck", None).manifest["replicas"] == [1, 1]
    resumed = torchrun(3, "--cuts", "4", "--replicas", "2,1", "--resume")
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    got = torch.load(tmp_path / "out.pt", weights_only=True)
    want, losses = oracle
    for name, w in want.items():
        torch.testing.assert_close(got["state"][name], w, rtol=1e-5, atol=1e-6, msg=name)
    torch.testing.assert_close([h["loss"] for h in got["history"]], losses, rtol=1e-5,
                               atol=1e-7)


@pytest.mark.slow
def test_stages_whose_lr_schedules_drifted_apart_are_not_merged(tmp_path: Path) -> None:
    """pipedream with stage 0 on 2 replicas: stage 0 steps its LR schedule once per 2
    minibatches, stage 1 every minibatch. One stage cannot continue both: a clear error; a plan
    that keeps the stages apart (the same cut, other replicas) resumes."""
    def make(cuts: list[int], replicas: list[int], hook=None) -> Trainer:
        return Trainer(stages(cuts), replicas, F.mse_loss, adamw, lr_scheduler=lambda_lr,
                       schedule="pipedream", checkpoint_dir=str(tmp_path), checkpoint_every=4,
                       executor="reference", progress=False, on_checkpoint=hook)

    def crash(epoch: int, pos: int) -> None:
        raise Crash(f"after {(epoch, pos)}")
    with pytest.raises(Crash):
        make([NODES - 2], [2, 1], crash).fit(data(), epochs=1)  # l2, l4 (tied) on stage 0
    with pytest.raises(CheckpointError, match="LR schedulers differ in 'last_epoch'"):
        make([], [1]).fit(data(), epochs=1, resume=True)
    make([NODES - 3], [1, 2]).fit(data(), epochs=1, resume=True)


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_float32_masters_and_the_loss_scale_move_with_their_parameters(tmp_path: Path,
                                                                       precision: str) -> None:
    """A bfloat16 model keeps float32 master weights, an fp16 run a loss scale: resumed on
    another plan, the run goes on exactly as without the crash. Without the masters the bf16
    weights would restart them (a rounding the uninterrupted run never makes); without the
    scale the fp16 resume is refused."""
    low = torch.bfloat16 if precision == "bf16" else torch.float32

    def bf16_trainer(plan: tuple[list[int], list[int]], ckpt: Path,
                     crash_after: int | None = None) -> Trainer:
        t_stages = stages(plan[0])
        for st in t_stages:
            st.gm.to(low)
        seen: list[tuple[int, int]] = []

        def hook(epoch: int, pos: int) -> None:
            seen.append((epoch, pos))
            if len(seen) == crash_after:
                raise Crash(f"after checkpoint {seen[-1]}")
        return Trainer(t_stages, plan[1], F.mse_loss, adamw, schedule="1f1b-flush",
                       microbatches=M, checkpoint_dir=str(ckpt), checkpoint_every=M,
                       executor="reference", progress=False, precision=precision,
                       on_checkpoint=hook if crash_after else None)

    bf16_data = [(x.to(low), y.to(low)) for x, y in data()]
    # the oracle: plan A uninterrupted (a one-stage run rounds differently at bf16 boundaries)
    whole = bf16_trainer(([3], [1, 1]), tmp_path / "whole")
    want = [h["loss"] for h in whole.fit(bf16_data, epochs=EPOCHS)]
    want_state = whole.state_dict()
    with pytest.raises(Crash):
        bf16_trainer(([3], [1, 1]), tmp_path / "run", crash_after=3).fit(bf16_data,
                                                                          epochs=EPOCHS)
    resumed = bf16_trainer(([1, 6], [1, 2, 1]), tmp_path / "run")
    got = [h["loss"] for h in resumed.fit(bf16_data, epochs=EPOCHS, resume=True)]
    got_state = resumed.state_dict()
    # masters restarted from the bf16 weights end 4e-3 away in weights, 1e-4 in loss
    assert got == pytest.approx(want, rel=1e-6)
    for name, w in want_state.items():
        if name in got_state:
            torch.testing.assert_close(got_state[name], w, rtol=0, atol=0, msg=name)
