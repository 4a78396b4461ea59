"""The plan's recomputation flags reach the trainer: ``fxpipe.compile(..., recompute=...)`` plans
with them and ``compiled.trainer()`` recomputes exactly in those stages by default, with the
numbers of training without recomputation (reference executor, bit for bit; dropout and
BatchNorm included, so the recomputed forward must redraw the same masks)."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxpipe
from fxpipe.costmodel.profile import Profile, ProfileNode
from fxpipe.passes import Plan, plan_for


class Noisy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.bn, self.drop = nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Dropout(0.3)
        self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(torch.tanh(self.bn(self.a(x))))
        return self.c(torch.tanh(self.b(h)))


def _data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 4, generator=g), torch.randint(0, 2, (8,), generator=g))
            for _ in range(8)]


def _compile(**kw: object) -> fxpipe.api.CompiledModel:
    return fxpipe.compile(Noisy(), fxpipe.Cluster(workers=2), example_inputs=(torch.randn(8, 4),),
                          loss_fn=F.cross_entropy, stages=2, repeats=1, **kw)


def _train(compiled: fxpipe.api.CompiledModel, **kw: object) -> tuple:
    trainer = compiled.trainer(optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
                               schedule="pipedream", executor="reference", progress=False, **kw)
    hist = trainer.fit(_data(), epochs=2)
    return trainer.options.recompute, [h["loss"] for h in hist], trainer.state_dict()


def test_compile_plans_with_recompute_and_the_trainer_uses_the_flags() -> None:
    every = _compile(recompute="always")
    assert every.plan.recompute == [True, True]
    assert all(s.recompute_s > 0 for s in every.plan.stages)
    assert "recompute" in every.summary().splitlines()[0]
    assert _train(every)[0] == (0, 1)  # the trainer takes the plan's flags...
    assert _train(every, recompute=False)[0] == ()  # ...unless the user says otherwise


@pytest.mark.slow
def test_training_with_the_plans_flags_equals_training_without() -> None:
    """One split for every run (measured costs could move a cut between compiles, and under
    pipedream the split decides the weight staleness): the plain plan, and the same partition
    with recomputation in stage 1, and in both stages, priced by ``plan_for`` and saved."""
    plain = _compile()
    assert plain.plan.recompute == [False, False]
    starts = [plain.profile.names.index(s.nodes[0]) for s in plain.plan.stages]
    runs = {(False, False): _train(plain)}
    for flags in ((False, True), (True, True)):
        plan = plan_for(plain.profile, fxpipe.Cluster(workers=2), starts, plain.plan.replicas,
                        recompute=list(flags))
        assert plan.recompute == list(flags)
        compiled = _compile(plan=Plan.from_dict(plan.to_dict()))  # as a saved plan carries it
        runs[flags] = _train(compiled)
    assert [runs[f][0] for f in runs] == [(), (1,), (0, 1)]
    _, base_loss, base_state = runs[(False, False)]
    assert len(set(base_loss)) > 1  # it trains: the losses move
    for flags in ((False, True), (True, True)):
        _, loss, state = runs[flags]
        assert loss == base_loss, flags
        assert state.keys() == base_state.keys()
        for k in state:  # BatchNorm's running statistics included
            torch.testing.assert_close(state[k], base_state[k], rtol=0.0, atol=0.0, msg=k)


def test_cli_plan_and_simulate_show_the_flags(tmp_path, capsys) -> None:
    """`fxpipe plan` and `fxpipe simulate` on a profile where only recomputation fits 400 B by
    the planner's rule: without --recompute auto, one clear line naming the option. With it, at
    1900 B, the plan recomputes stage 0: the cap is held against its walked peak
    (runtime/pricing/peak_fit.py; the walk by hand in
    tests/runtime/pricing/test_runtime_memory_walk.py), 1856 B
    (its state 16, its input per set, the recomputed set 310 with the working set 310, three
    gradients of 300 B posted ahead, one activation sent), where the plain plan's is 2146 B; and
    both commands print the recompute column. l1 holds 4 B of weights, so a gradient flows back
    to stage 0 (none does to a stage computed from the model's inputs alone)."""
    from fxpipe.cli import main

    def node(name: str, f: float, p: float, a: float, inputs: tuple[str, ...] = (),
             op: str = "call_module") -> ProfileNode:
        return ProfileNode(name=name, op=op, target=name, forward_s=f, backward_s=2 * f,
                           activation_bytes=a, parameter_bytes=p, inputs=inputs)

    prof = tmp_path / "profile.json"  # tests/passes/test_recompute.py's cap case, by hand
    Profile(nodes=(node("x", 0.0, 0.0, 10.0, op="placeholder"),
                   node("l1", 1.0, 4.0, 300.0, ("x",)), node("l2", 1.0, 100.0, 10.0, ("l1",))),
            batch_size=4).save(prof)
    assert main(["plan", str(prof), "--workers", "2", "--bandwidth", "1GB/s", "--memory",
                 "400B"]) != 0
    assert "recompute='auto'" in capsys.readouterr().err
    args = ["--workers", "2", "--bandwidth", "1GB/s", "--memory", "1900B", "--schedule",
            "pipedream"]
    assert main(["plan", str(prof), *args, "--recompute", "auto", "--save-plan",
                 str(tmp_path / "plan.json")]) == 0
    out = capsys.readouterr().out
    assert "recompute" in out.splitlines()[0] and out.splitlines()[2].endswith("1 s")
    assert Plan.load(tmp_path / "plan.json").recompute == [True, False]
    assert main(["simulate", str(prof), *args, "--recompute", "auto"]) == 0
    out = capsys.readouterr().out
    assert "recompute" in out.splitlines()[0] and "(recompute 1 s)" in out
