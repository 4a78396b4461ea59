"""Re-planning a running trainer in place (runtime/training/trainer_switch.py, ``replan="auto"``),
with the reference executor.

The costs are estimated for a V100 (deterministic), so the planner's choices are fixed numbers.
A "deliberately wrong" profile multiplies the costs of the right plan's first stage by 4; the
plan solved on it cuts elsewhere. The measurements come from a perfect timer: each stage's
forward, backward and update as the RIGHT profile prices them (the reference executor records no
timeline). Oracles:
* the re-planned run equals a run that trains the first segment under the wrong plan, writes a
  checkpoint, crashes, and a FRESH trainer of the new plan resumes from that checkpoint
  (weights, Adam moments by parameter name, LR, per-epoch losses);
* it also equals the uninterrupted run under the wrong plan (1f1b-flush trains the same
  computation under every plan, up to float rounding);
* with the right profile nothing is proposed (factors 1, the current plan is the optimum).
"""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxpipe
from fxpipe.costmodel import Profile
from fxpipe.passes import Plan
from fxpipe.passes.partition import partition, plan_for
from fxpipe.runtime.errors import RuntimeConfigError
from fxpipe.runtime.training.param_names import weight_decay_groups
from fxpipe.runtime.pricing.replan import StageTimes, stage_starts

W, B, M = 256, 8, 4  # width, batch, microbatches (= segment: one batch per segment)
CLUSTER = fxpipe.Cluster(workers=2, device="V100", bandwidth="1Gbps")


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList([nn.Linear(W, W) for _ in range(6)])
        self.head = nn.Linear(W, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(x)


def data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(B, W, generator=g), torch.randint(0, 4, (B,), generator=g))
            for _ in range(12)]


def adamw(params: list[torch.Tensor], names: list[str]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(weight_decay_groups(params, names, 0.1), lr=0.003)


def warmup(opt: torch.optim.Optimizer) -> Any:
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / 3))


def example() -> torch.Tensor:
    return torch.randn(B, W, generator=torch.Generator().manual_seed(2))


def right_start() -> tuple[Profile, Plan]:
    """The right (estimated) profile and the plan solved on it."""
    c = fxpipe.compile(Net(), CLUSTER, example_inputs=(example(),), loss_fn=F.cross_entropy,
                       schedule="pipedream")  # the planner's own pricing, which re-plans use
    return c.profile, c.plan


@pytest.fixture(scope="module")
def right() -> tuple[Profile, Plan]:
    return right_start()


def times_x4(profile: Profile, names: set[str]) -> Profile:
    return replace(profile, nodes=tuple(
        replace(nd, forward_s=4 * nd.forward_s, backward_s=4 * nd.backward_s,
                update_s=4 * nd.update_s) if nd.name in names else nd for nd in profile.nodes))


def wrong_start() -> tuple[Profile, Profile, Plan]:
    """The right profile, the wrong one (the right plan's stage 0 costs x4), its plan."""
    profile, plan = right_start()
    bad = times_x4(profile, set(plan.stages[0].nodes))
    return profile, bad, replace(partition(bad, CLUSTER), model_fingerprint=plan.model_fingerprint)


@pytest.fixture(scope="module")
def wrong() -> tuple[Profile, Plan]:
    _, bad, plan = wrong_start()
    return bad, plan


def compiled(plan: Plan, profile: Profile) -> Any:
    """A fresh model (same initial weights) compiled to ``plan``, believing ``profile``."""
    c = fxpipe.compile(Net(), CLUSTER, example_inputs=(example(),), loss_fn=F.cross_entropy,
                       plan=plan, schedule="pipedream")
    c.profile = profile  # what the run believes its costs are
    return c


def perfect_timer(true: Profile) -> Any:
    """Per stage of the trainer's current plan: forward, backward, update as ``true`` prices
    them (what a timer without noise would measure on that hardware)."""
    def measure(trainer: Any) -> list[StageTimes]:
        plan = trainer.auto_options.plan
        out = []
        for st in plan.stages:
            nodes = [nd for nd in true.nodes if nd.name in set(st.nodes)]
            out.append(StageTimes(sum(nd.forward_s for nd in nodes),
                                  sum(nd.backward_s for nd in nodes),
                                  sum(nd.update_s for nd in nodes)))
        return out
    return measure


def options(**kw: Any) -> dict[str, Any]:
    return dict(optimizer=adamw, lr_scheduler=warmup, schedule="1f1b-flush", microbatches=M,
                segment=M, executor="reference", progress=False, **kw)


def opt_state(t: Any) -> dict[str, dict[str, torch.Tensor]]:
    """Adam state per parameter NAME (replica 0 of each stage), plus its group's lr."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for (s, j), w in t.local.items():
        if j:
            continue
        names = {id(p): n for n, p in w.stash.latest.items()}
        for g in w.stash.optimizer.param_groups:
            for p in g["params"]:
                st = w.stash.optimizer.state[p]
                out[names[id(p)]] = {"exp_avg": st["exp_avg"], "exp_avg_sq": st["exp_avg_sq"],
                                     "step": torch.as_tensor(st["step"]),
                                     "lr": torch.tensor(g["lr"])}
    return out


def recipe(name: str, opts: dict[str, Any]) -> dict[str, Any]:
    """How updates are made: ``microbatches`` (M loader minibatches per update, named),
    ``default`` (1f1b-flush's default: as many as the plan's workers) or ``split`` (each loader
    minibatch cut into 2 microbatches, one update per minibatch)."""
    opts = dict(opts)
    if name != "microbatches":
        del opts["microbatches"]
    if name == "split":
        opts["split"] = 2
    return opts


class Crash(Exception):
    pass


@pytest.mark.slow
def test_wrong_profile_replans_and_equals_a_resume_under_the_new_plan(
        right: tuple[Profile, Plan], wrong: tuple[Profile, Plan], tmp_path: Path) -> None:
    true, right_plan = right
    bad, bad_plan = wrong
    assert stage_starts(bad, bad_plan) != stage_starts(true, right_plan)  # the x4 misleads

    t = compiled(bad_plan, bad).trainer(**options(replan="auto", replan_max=1,
                                                  replan_measure=perfect_timer(true)))
    history = t.fit(data(), epochs=2)
    [rec] = t.replanner.records
    assert rec.adopted and (rec.epoch, rec.position) == (0, M)
    new_plan = t.replanner.plan
    assert (stage_starts(true, new_plan), new_plan.replicas) != (
        stage_starts(bad, bad_plan), bad_plan.replicas)
    assert t.replicas == list(new_plan.replicas)
    assert [st.index for st in t.stages] == list(range(len(new_plan.stages)))
    # the new plan's trainer reads the rescaled profile; one worker's time (the harm verdict)
    # still comes from the profile the job was compiled with
    assert t.auto_options.profile is not bad and t._one_worker_profile is bad
    # the new plan is faster on the TRUE costs than the wrong one (independent costing)
    cost = lambda p: plan_for(true, CLUSTER, stage_starts(true, p), list(p.replicas))  # noqa
    assert cost(new_plan).time_per_minibatch < cost(bad_plan).time_per_minibatch

    # oracle 1: first segment under the wrong plan, checkpoint, crash; resume under the new plan
    def crash(epoch: int, pos: int) -> None:
        raise Crash(f"after {epoch}, {pos}")
    a = compiled(bad_plan, bad).trainer(**options(checkpoint_dir=str(tmp_path),
                                                  checkpoint_every=M, on_checkpoint=crash))
    with pytest.raises(Crash):
        a.fit(data(), epochs=2)
    b = compiled(new_plan, true).trainer(**options(checkpoint_dir=str(tmp_path)))
    resumed = b.fit(data(), epochs=2, resume=True)
    got, want = t.state_dict(), b.state_dict()
    assert set(got) == set(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-6, atol=1e-7, msg=name)
    go, wo = opt_state(t), opt_state(b)
    assert set(go) == set(wo) and go
    for name in wo:
        for k in wo[name]:
            torch.testing.assert_close(go[name][k], wo[name][k], rtol=1e-6, atol=1e-9,
                                       msg=f"{name} {k}")
    assert [h["loss"] for h in history] == pytest.approx([h["loss"] for h in resumed], rel=1e-6)

    # oracle 2: the uninterrupted run under the wrong plan (the same computation)
    u = compiled(bad_plan, bad).trainer(**options())
    plain = u.fit(data(), epochs=2)
    for name, w in u.state_dict().items():
        torch.testing.assert_close(got[name], w, rtol=1e-5, atol=1e-6, msg=name)
    assert [h["loss"] for h in history] == pytest.approx([h["loss"] for h in plain], rel=1e-5)


def test_right_profile_keeps_the_plan(right: tuple[Profile, Plan]) -> None:
    true, plan = right
    t = compiled(plan, true).trainer(**options(replan="auto", replan_measure=perfect_timer(true)))
    t.fit(data(), epochs=1)
    [rec] = t.replanner.records
    assert not rec.adopted
    assert rec.proposal.factors == tuple((1.0, 1.0, 1.0) for _ in plan.stages)
    assert rec.proposal.gain == pytest.approx(0.0, abs=1e-9)
    assert t.replanner.plan is not None and t.replicas == list(plan.replicas)


def test_threshold_decides(right: tuple[Profile, Plan], wrong: tuple[Profile, Plan]) -> None:
    """The same wrong start with a threshold above the predicted gain keeps the plan."""
    true, _ = right
    bad, bad_plan = wrong
    t = compiled(bad_plan, bad).trainer(**options(replan="auto", replan_threshold=100.0,
                                                  replan_measure=perfect_timer(true)))
    t.fit(data()[:2 * M], epochs=1)
    [rec] = t.replanner.records
    assert rec.proposal.gain > 0.05 and not rec.adopted
    assert t.replicas == list(bad_plan.replicas)


@pytest.mark.parametrize("kw, match", [
    (dict(schedule="pipedream", microbatches=None), "pipedream"),
    (dict(schedule="auto"), "auto"),
    (dict(replan_measure=None), "replan_measure"),
    (dict(replan_threshold=-1.0), "replan_threshold"),
    (dict(replan_after=0), "replan_after"),
    (dict(replan_max=0), "replan_max"),
    (dict(replan_max=True), "replan_max"),
    (dict(replan="sometimes"), "sometimes"),
])
def test_bad_options(right: tuple[Profile, Plan], kw: dict[str, Any], match: str) -> None:
    true, plan = right
    opts = {**options(replan="auto", replan_measure=perfect_timer(true)), **kw}
    if opts.get("replan_measure") is None:
        opts.pop("replan_measure")
    with pytest.raises(RuntimeConfigError, match=match):
        compiled(plan, true).trainer(**opts)


def test_options_without_replan(right: tuple[Profile, Plan]) -> None:
    true, plan = right
    with pytest.raises(RuntimeConfigError, match="without replan"):
        compiled(plan, true).trainer(**options(replan_threshold=0.1))


@pytest.mark.multiprocess
@pytest.mark.parametrize("mode", ["perfect", "timeline"])
def test_torchrun_replans_in_place(mode: str, right: tuple[Profile, Plan],
                                   wrong: tuple[Profile, Plan], tmp_path: Path) -> None:
    """2 torchrun ranks start from the wrong plan with replan="auto". ``perfect``: the switch is
    certain (the right profile's times), both ranks switch to the same plan on the same
    processes, and the result equals the reference executor's uninterrupted run (1f1b-flush:
    the same computation under every plan). ``timeline``: the ranks measure their own
    timelines; whatever they decide, they decide it together and train on to the same result."""
    import sys

    from rt_procs import HERE, _port, _run

    out = tmp_path / "got"
    res = _run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
                "--master-addr=127.0.0.1", f"--master-port={_port()}",
                str(HERE / "replan_switch_job.py"), str(out), mode])
    assert res.returncode == 0, res.stdout[-3000:]
    got = [torch.load(f"{out}.{r}.pt", weights_only=False) for r in range(2)]
    recs = [g["records"] for g in got]
    assert 1 <= len(recs[0]) <= 3 and [r[:6] for r in recs[0]] == [r[:6] for r in recs[1]]
    # a loopback job may also measure slower than one worker (Trainer.harm) and fall back
    assert got[0]["replicas"] == got[1]["replicas"]
    bad, bad_plan = wrong
    if mode == "perfect":  # adopted at 4; measured again on 8..11, kept at 12 (the optimum)
        assert [(r[0], r[1], r[2]) for r in recs[0]] == [(0, M, True), (0, 3 * M, False)]
        assert sum(got[0]["replicas"]) == 2  # the same 2 processes, all of them busy
    ref = compiled(bad_plan, bad).trainer(**options())
    plain = ref.fit(data(), epochs=2)
    for name, w in ref.state_dict().items():
        torch.testing.assert_close(got[0]["state"][name], w, rtol=1e-5, atol=1e-6, msg=name)
    assert [h["loss"] for h in got[0]["history"]] == pytest.approx(
        [h["loss"] for h in plain], rel=1e-5)


@pytest.mark.multiprocess
@pytest.mark.parametrize("how", ["microbatches", "default", "split"])
def test_a_plan_that_does_harm_falls_back_to_one_worker(how: str, right: tuple[Profile, Plan],
                                                       tmp_path: Path) -> None:
    """Do no harm (issue 27): rank 0's verdict after its second segment (forced: a loopback
    job's timing decides nothing) is everyone's. Both ranks switch at minibatch 8 to one
    worker: rank 0 trains the whole model on in its own process (no process group left), rank 1
    is idle and returns from fit; the result equals the reference executor's uninterrupted run
    of the 2-stage plan (1f1b-flush: the same computation under every plan), whatever the
    recipe: M minibatches per update named, the default (as many as the 2 workers: the one
    worker keeps 2), or each minibatch split in 2 (the one worker runs it whole)."""
    import sys

    from rt_procs import HERE, _port, _run

    out = tmp_path / "got"
    res = _run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
                "--master-addr=127.0.0.1", f"--master-port={_port()}",
                str(HERE / "replan_switch_job.py"), str(out), "harm", how])
    assert res.returncode == 0, res.stdout[-3000:]
    assert "re-planning onto one worker: 2 workers took 1 s" in res.stdout
    got = [torch.load(f"{out}.{r}.pt", weights_only=False) for r in range(2)]
    for g in got:  # the kept plan at 4 (the right profile), the fall back at 8
        assert [(r[0], r[1], r[2], r[5]) for r in g["records"]] == [
            (0, M, False, [1, 1]), (0, 2 * M, True, [1])]
        assert g["records"][1][3] == pytest.approx(1.0)  # the verdict's 2.00x
        assert g["replicas"] == [1]
    assert (got[0]["idle"], got[0]["executor"], got[0]["local"]) == (
        False, "ReferenceBackend", [(0, 0)])
    assert (got[1]["idle"], got[1]["history"]) == (True, [])
    assert len(got[0]["history"]) == 2
    true, plan = right
    ref = compiled(plan, true).trainer(**recipe(how, options()))
    plain = ref.fit(data(), epochs=2)
    for name, w in ref.state_dict().items():
        torch.testing.assert_close(got[0]["state"][name], w, rtol=1e-5, atol=1e-6, msg=name)
    assert [h["loss"] for h in got[0]["history"]] == pytest.approx(
        [h["loss"] for h in plain], rel=1e-5)


@pytest.mark.slow
def test_successive_replans_find_the_cut_one_rescale_cannot(right: tuple[Profile, Plan]
                                                            ) -> None:
    """One factor per stage cannot say which nodes of a stage the profile got wrong: at 100
    Gbit/s (compute decides the cut) the first re-plan from the wrong plan [0, 5] lands on
    [0, 6], not the right plan's [0, 7]. Measured again on [0, 6] (segment 4..7 warms up, 8..11
    is measured), the second re-plan reaches [0, 7]; measured on it (epoch 1, 0..3 warms up,
    4..7 measured), the third keeps it and the decisions stop. With replan_max=1 the run stays
    on [0, 6]. Every run trains what the wrong plan's uninterrupted run trains (1f1b-flush: the
    same computation under every plan)."""
    fast = fxpipe.Cluster(workers=2, device="V100", bandwidth="100Gbps")
    true, _ = right
    right_plan = partition(true, fast)
    bad = times_x4(true, set(right_plan.stages[0].nodes))
    bad_plan = replace(partition(bad, fast), model_fingerprint=right_plan.model_fingerprint)
    assert [stage_starts(true, p) for p in (right_plan, bad_plan)] == [[0, 7], [0, 5]]
    plain = compiled(bad_plan, bad).trainer(**options())
    want = plain.fit(data(), epochs=2)
    for most, moves in ((3, [((0, M), [0, 6], True), ((0, 3 * M), [0, 7], True),
                             ((1, 2 * M), [0, 7], False)]),
                        (1, [((0, M), [0, 6], True)])):
        t = compiled(bad_plan, bad).trainer(**options(replan="auto", replan_max=most,
                                                      replan_measure=perfect_timer(true)))
        got = t.fit(data(), epochs=2)
        assert [((r.epoch, r.position), stage_starts(true, r.proposal.proposed), r.adopted)
                for r in t.replanner.records] == moves
        assert stage_starts(true, t.replanner.plan) == moves[-1][1]
        assert [h["loss"] for h in got] == pytest.approx([h["loss"] for h in want], rel=1e-5)
        for name, w in plain.state_dict().items():
            torch.testing.assert_close(t.state_dict()[name], w, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.slow
def test_checkpoints_after_a_switch_resume(right: tuple[Profile, Plan],
                                           wrong: tuple[Profile, Plan], tmp_path: Path) -> None:
    """With a checkpoint dir the state travels through ``<dir>/.replan-*`` (removed after the
    switch); the checkpoints written after the switch carry the NEW plan's layout: the run
    crashes after its 2nd checkpoint (minibatch 8, after the switch at 4) and a fresh trainer
    of the WRONG plan resumes from it, reaching the uninterrupted run's weights and losses."""
    true, _ = right
    bad, bad_plan = wrong
    seen: list[tuple[int, int]] = []

    def crash(epoch: int, pos: int) -> None:
        seen.append((epoch, pos))
        if len(seen) == 2:
            assert not list(tmp_path.glob(".replan*"))  # the transfer folder is gone
            raise Crash(f"after {epoch}, {pos}")
    t = compiled(bad_plan, bad).trainer(**options(
        replan="auto", replan_measure=perfect_timer(true), checkpoint_dir=str(tmp_path),
        checkpoint_every=M, on_checkpoint=crash))
    with pytest.raises(Crash):
        t.fit(data(), epochs=2)
    assert t.replanner.records[0].adopted and seen == [(0, M), (0, 2 * M)]
    manifest = json.loads((tmp_path / "e0000-m0000008" / "manifest.json").read_text())
    weights = lambda stages: [[n for n, _ in st.gm.named_parameters()]  # noqa: E731
                              for st in stages]
    assert [manifest["layout"][str(k)]["weights"] for k in range(len(t.stages))] == weights(
        t.stages) != weights(compiled(bad_plan, bad).stage_specs)  # the new plan's layout
    r = compiled(bad_plan, bad).trainer(**options(checkpoint_dir=str(tmp_path)))
    resumed = r.fit(data(), epochs=2, resume=True)
    u = compiled(bad_plan, bad).trainer(**options())
    plain = u.fit(data(), epochs=2)
    got = r.state_dict()
    for name, w in u.state_dict().items():
        torch.testing.assert_close(got[name], w, rtol=1e-5, atol=1e-6, msg=name)
    assert [h["loss"] for h in resumed] == pytest.approx([h["loss"] for h in plain], rel=1e-5)
