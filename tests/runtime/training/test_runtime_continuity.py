"""Asynchronous schedules run continuously across the trainer's segments (issue 27).

The oracle is written here, without fxpipe: stale-weight SGD with momentum per each schedule's
documented version rule, on a chain of S blocks (one per stage), float64. Under
``pipedream``, ``vertical_sync``, ``stashing=False`` and ``2bw`` the trainer must give the
oracle's weights to 1e-12 whatever its segments are (``segment=8``, the default ramp 8, 16, 32 ..,
one segment per epoch): segments are how the loader is read, not a boundary of the pipeline. Before
issue 27 every segment boundary drained the pipeline (the first forwards after it read fresh
weights); ``test_draining_every_segment_is_another_rule`` seeds that back and sees it fail.

Version rules on a straight pipeline of S stages (stage s admits w_s = S - s minibatches):
* pipedream: minibatch k's forward and backward on stage s read version max(0, k - (S-1-s)) (s's
  updates before it); stage s's update u applies minibatch u's gradient.
* vertical sync: every stage reads stage 0's version of k, max(0, k - (S-1)).
* stashing=False: forwards as pipedream; the backward on stage s comes after k updates of it and
  recomputes the stage's forward with version k on the input it received, back-propagating the
  gradient the next stage sent.
* 2bw (m microbatches per update): every stage reads version max(0, k // m - 1); update t
  applies the mean gradient of batch t.
"""
from __future__ import annotations

import math
from typing import Sequence

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from fxpipe.codegen.split import placed_nodes, split_graph
from fxpipe.runtime.training.trainer import Trainer

LR, MOMENTUM, WIDTH, BATCH = 0.05, 0.5, 6, 4
Weights = dict[str, torch.Tensor]


# ----------------------------------------------------------------------------- the oracle
def blocks(stages: int, seed: int = 0) -> nn.Sequential:
    """``stages`` blocks of Linear + Tanh (the last one Linear only), float64."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for b in range(stages):
        layers.append(nn.Linear(WIDTH, WIDTH if b < stages - 1 else 2))
        if b < stages - 1:
            layers.append(nn.Tanh())
    return nn.Sequential(*layers).double()


def block(w: Weights, b: int, x: torch.Tensor, last: bool) -> torch.Tensor:
    """Block b of :func:`blocks` (its Linear is layer 2b) with weights ``w``."""
    y = F.linear(x, w[f"{2 * b}.weight"], w[f"{2 * b}.bias"])
    return y if last else torch.tanh(y)


def data(n: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(BATCH, WIDTH, generator=g, dtype=torch.float64),
             torch.randn(BATCH, 2, generator=g, dtype=torch.float64)) for _ in range(n)]


class MomentumSGD:
    """torch.optim.SGD(lr, momentum) of one stage, written out: buf = g, then mu buf + g."""

    def __init__(self) -> None:
        self.buf: Weights = {}

    def step(self, w: Weights, g: Weights) -> Weights:
        self.buf = {n: g[n].clone() if n not in self.buf else MOMENTUM * self.buf[n] + g[n]
                    for n in g}
        return {n: w[n] - LR * self.buf[n] for n in w}


def stage_grads(hist_fwd: list[Weights], hist_bwd: list[Weights], x: torch.Tensor,
                y: torch.Tensor) -> list[Weights]:
    """Each stage's gradient for one minibatch: forward activations with ``hist_fwd[s]``; each
    stage's backward re-runs its block with ``hist_bwd[s]`` on the input its forward received
    and back-propagates the gradient the next stage sent (with stashing the two are equal)."""
    S = len(hist_fwd)
    acts = [x]
    with torch.no_grad():
        for s in range(S):
            acts.append(block(hist_fwd[s], s, acts[s], s == S - 1))
    out: list[Weights] = [{} for _ in range(S)]
    grad_out: torch.Tensor | None = None
    for s in reversed(range(S)):
        w = {n: t.detach().clone().requires_grad_(True) for n, t in hist_bwd[s].items()}
        inp = acts[s].detach().requires_grad_(s > 0)
        o = block(w, s, inp, s == S - 1)
        wrt = ([inp] if s > 0 else []) + list(w.values())
        gs = (torch.autograd.grad(F.mse_loss(o, y), wrt) if s == S - 1
              else torch.autograd.grad(o, wrt, grad_out))
        grad_out = gs[0] if s > 0 else None
        out[s] = dict(zip(w, gs[1:] if s > 0 else gs))
    return out


def oracle(rule: str, stages: int, batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
           m: int | None = None, noam: int | None = None) -> Weights:
    """The final weights of one epoch under ``rule`` (see the module doc); ``noam``: stage 0
    admits that many minibatches instead of S (its forward of k reads max(0, k - noam + 1))."""
    S, w0 = stages, {n: p.detach().clone() for n, p in blocks(stages).named_parameters()}
    hist = [[{n: t for n, t in w0.items() if n.split(".")[0] == str(2 * s)}] for s in range(S)]
    opts = [MomentumSGD() for _ in range(S)]
    pending: list[list[Weights]] = [[] for _ in range(S)]
    for k, (x, y) in enumerate(batches):
        if rule == "2bw":
            v = [max(0, k // m - 1)] * S  # type: ignore[operator]
        elif rule == "vsync":
            v = [max(0, k - (S - 1))] * S
        else:
            v = [max(0, k - ((noam or S) - 1 if s == 0 else S - 1 - s)) for s in range(S)]
        fwd = [hist[s][v[s]] for s in range(S)]
        bwd = [hist[s][k] for s in range(S)] if rule == "nostash" else fwd
        for s, g in enumerate(stage_grads(fwd, bwd, x, y)):
            pending[s].append(g)
            if rule != "2bw" or len(pending[s]) == m or k == len(batches) - 1:
                mean = {n: sum(p[n] for p in pending[s]) / len(pending[s]) for n in g}
                hist[s].append(opts[s].step(hist[s][-1], mean))
                pending[s] = []
    return {n: t for s in range(S) for n, t in hist[s][-1].items()}


# ----------------------------------------------------------------------------- fxpipe
def stages_of(model: nn.Module, stages: int) -> list:
    """One block per stage: cut after every Tanh."""
    gm = fx.symbolic_trace(model)
    stage_of, s = {}, 0
    for n in placed_nodes(gm):
        stage_of[n.name] = s
        if n.op == "call_module" and isinstance(gm.get_submodule(n.target), nn.Tanh):
            s += 1
    return split_graph(gm, stage_of)


def momentum(params: list[torch.Tensor]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR, momentum=MOMENTUM)


def train(rule: str, stages: int, n: int, segment: int | None, m: int | None = None,
          noam: int | None = None) -> Weights:
    kind = "2bw" if rule == "2bw" else "pipedream"
    model = blocks(stages)
    trainer = Trainer(stages_of(model, stages), [1] * stages, F.mse_loss, momentum,
                      schedule=kind, microbatches=m, segment=segment, executor="reference",
                      progress=False, stashing=rule != "nostash",
                      vertical_sync=rule == "vsync", noam=noam)
    trainer.fit(data(n), epochs=1)
    return {n_: p.detach().clone() for n_, p in model.named_parameters()}


RULES = [("pipedream", None), ("vsync", None), ("nostash", None), ("2bw", "m")]


@pytest.mark.parametrize("stages", [4, 8])
@pytest.mark.parametrize("rule, m", RULES)
@pytest.mark.parametrize("segment", [8, None, "epoch"])
def test_async_schedules_equal_their_rule_whatever_the_segments(rule, m, stages, segment) -> None:
    n = 48
    mb = stages if m else None  # 2bw: one update per S microbatches (fxpipe's default m)
    seg = n if segment == "epoch" else segment
    want = oracle(rule, stages, data(n), mb)
    got = train(rule, stages, n, seg, mb)
    assert sorted(got) == sorted(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-10, atol=1e-12, msg=name)


@pytest.mark.parametrize("segment", [3, None])
def test_a_deeper_window_at_the_input_stage_is_its_rule(segment) -> None:
    """noam=6 on 4 stages: stage 0 admits 6 minibatches (hiding a longer round trip), so its
    forwards read versions 5 behind; the other stages keep theirs. Equal to the rule, and a
    different run from PipeDream's window."""
    want = oracle("pipedream", 4, data(40), noam=6)
    got = train("pipedream", 4, 40, segment, noam=6)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-10, atol=1e-12, msg=name)
    base = oracle("pipedream", 4, data(40))
    assert max(float((base[k] - want[k]).abs().max()) for k in want) > 1e-4


def _slow_link_plan(capped: str | None):
    """A 2-stage plan (two nodes of 1 s forward + 1 s backward, 5 MB of weights each) whose cut
    takes 0.5 s each way: PipeDream's 2 in flight run at (4 + 1) / 2 = 2.5 s per minibatch,
    3 at the planned 2 s (test_runtime_plansim). ``capped``: a memory cap 1 MB over what
    PipeDream's window holds at its walked peak ("walk"), which has no room for one more weight
    version (5 MB) and activation set (0.5 MB); or 6.5 MB over the memory rule's figure
    ("rule"), which would have it if the rule's figure were all a stage holds, but the walked
    peak is 2.5 MB above it."""
    from fxpipe.api import choose_plan
    from fxpipe.costmodel.hardware import Cluster
    from fxpipe.costmodel.profile import Profile, ProfileNode
    from fxpipe.runtime.pricing.memory_walk import walk_memory

    prof = Profile(nodes=tuple(
        ProfileNode(name=f"n{i}", op="call_module", target="m", forward_s=1.0, backward_s=1.0,
                    activation_bytes=0.5e6 if i == 0 else 0.0, parameter_bytes=5e6,
                    inputs=(f"n{i - 1}",) if i else ()) for i in range(2)), batch_size=4)
    free = choose_plan(prof, Cluster(workers=2, bandwidth=1e6), choose="planner",
                       schedule="pipedream")
    rule = max(sp.memory_bytes for sp in free.stages)
    walked = max(p.peak for p in walk_memory(free, prof, "pipedream"))
    assert walked - rule > 1.5e6
    cap = {None: None, "walk": walked + 1e6, "rule": rule + 6.5e6}[capped]
    return choose_plan(prof, Cluster(workers=2, bandwidth=1e6, memory=cap),
                       choose="planner", schedule="pipedream"), prof


@pytest.mark.parametrize("noam, capped, window", [
    (None, None, 3), ("auto", None, 3), ("pipedream", None, None), (2, None, 2),
    (None, "walk", None), (None, "rule", None)])
def test_the_default_window_hides_the_plans_round_trips(noam, capped, window) -> None:
    """A Trainer with a plan (what compiled.trainer passes) admits by default the fewest
    minibatches that hide the plan's round trips (noam_for: 3 on this slow link), and trains
    exactly that rule (the oracle with stage 0 admitting 3); ``noam="pipedream"`` keeps
    PipeDream's 2, as does a memory cap without room for a third weight version at the walked
    peak. The recipe says which."""
    plan, prof = _slow_link_plan(capped)
    model = blocks(2)
    trainer = Trainer(stages_of(model, 2), [1, 1], F.mse_loss, momentum, schedule="pipedream",
                      executor="reference", progress=False, noam=noam, segment=5,
                      auto_options={"plan": plan, "profile": prof})
    trainer.fit(data(24), epochs=1)
    want = oracle("pipedream", 2, data(24), noam=window)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), want[name], rtol=1e-10, atol=1e-12, msg=name)
    line = [ln for ln in trainer.recipe().splitlines() if ln.startswith("in flight")]
    if window is None:
        assert line == []
    else:
        how = "noam=2" if noam == 2 else "the fewest that hide the plan's round trips"
        assert line == [f"in flight: {window} minibatches at the input stage ({how}; "
                        "PipeDream's NOAM would be 2)"]


def test_noam_is_checked() -> None:
    from fxpipe.runtime.errors import RuntimeConfigError

    model = blocks(2)
    for bad in (0, -1, 2.5, "deep", True):
        with pytest.raises(RuntimeConfigError, match="noam="):
            Trainer(stages_of(model, 2), [1, 1], F.mse_loss, momentum, noam=bad,
                    executor="reference", progress=False)
    with pytest.raises(RuntimeConfigError, match="flushing schedule"):
        Trainer(stages_of(model, 2), [1, 1], F.mse_loss, momentum, schedule="1f1b-flush",
                noam=3, executor="reference", progress=False)
    with pytest.raises(RuntimeConfigError, match="without a plan"):
        Trainer(stages_of(model, 2), [1, 1], F.mse_loss, momentum, noam="auto",
                executor="reference", progress=False)


@pytest.mark.slow
def test_draining_every_segment_is_another_rule(monkeypatch) -> None:
    """Seeded regression: every window final again (each segment a complete schedule that
    fills and drains, as before issue 27). With segment=8 on 4 stages the weights leave the
    oracle by far more than rounding; with one segment per epoch they would not."""
    monkeypatch.setattr(Trainer, "_drain_due", lambda self, pos: True)  # every boundary
    want = oracle("pipedream", 4, data(48))
    got = train("pipedream", 4, 48, 8)
    worst = max(float((got[k] - want[k]).abs().max()) for k in want)
    assert worst > 1e-3
    same = train("pipedream", 4, 48, 48)
    assert max(float((same[k] - want[k]).abs().max()) for k in want) < 1e-12


def test_the_oracle_tells_the_rules_apart() -> None:
    """Each rule's weights differ from the others' and from plain SGD's (rule 'sync': every
    version the latest), so matching one is not matching any."""
    batches = data(24)
    finals = {r: oracle(r, 4, batches, 4 if r == "2bw" else None)
              for r in ("pipedream", "vsync", "nostash", "2bw")}
    S = 4
    w = {n: p.detach().clone() for n, p in blocks(S).named_parameters()}
    opt = MomentumSGD()
    for x, y in batches:  # plain SGD with momentum, one step per minibatch
        leaves = {n: t.clone().requires_grad_(True) for n, t in w.items()}
        h = x
        for s in range(S):
            h = block(leaves, s, h, s == S - 1)
        g = dict(zip(leaves, torch.autograd.grad(F.mse_loss(h, y), list(leaves.values()))))
        w = opt.step(w, g)
    finals["sync"] = w
    names = sorted(finals)
    for a in range(len(names)):
        for b in range(a + 1, len(names)):
            fa, fb = finals[names[a]], finals[names[b]]
            assert max(float((fa[n] - fb[n]).abs().max()) for n in fa) > 1e-4, names[a:b + 1]
    assert math.isfinite(sum(float(t.sum()) for t in finals["sync"].values()))


# ----------------------------------------------------------------------------- the rest
def _final(model: nn.Module, stages: list, replicas: list[int], schedule: str,
           batches: list, segment: int, **kw) -> Weights:
    trainer = Trainer(stages, replicas, F.mse_loss if kw.pop("mse", True) else F.cross_entropy,
                      kw.pop("optimizer", momentum), schedule=schedule, segment=segment,
                      executor="reference", progress=False, **kw)
    trainer.fit(batches, epochs=2)
    return {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["pipedream+predict", "pipedream+dc", "pipedream+lr_scale",
                                      "pipedream+momentum", "2bw"])
def test_mitigations_and_replicas_do_not_depend_on_the_segments(schedule: str) -> None:
    """Weight prediction's horizons, DC-ASGD's stashed point, the stage's delays and replicated
    stages (replicas [2, 1, 1]) across windows: every segmentation gives the weights of one
    segment per epoch (two epochs: the stretch ends and restarts at the epoch boundary)."""
    n = 30
    runs = []
    for segment in (2, 6, None, n):
        model = blocks(3)
        runs.append(_final(model, stages_of(model, 3), [2, 1, 1], schedule, data(n), segment))
    for got in runs[:-1]:
        for name, t in runs[-1].items():
            torch.testing.assert_close(got[name], t, rtol=1e-12, atol=1e-12, msg=name)


@pytest.mark.slow
def test_tied_weights_across_windows() -> None:
    """TiedLM's embedding on stages 0 and 2: its delayed rounds (pipedream applies round i - d
    at update i, the last d at the stretch's end) carry over between windows."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1]))  # tests/runtime: the helpers
    from rt_helpers import split
    from rt_tied import TiedLM, sgd_m, token_batches

    runs = []
    for segment in (2, 5, 24):
        model = TiedLM().double()
        runs.append(_final(model, split(model, [1, 3]), [1, 1, 1], "pipedream",
                           [(x, y) for x, y in token_batches(24)], segment, mse=False,
                           optimizer=sgd_m))
    for got in runs[:-1]:
        for name, t in runs[-1].items():
            torch.testing.assert_close(got[name], t, rtol=1e-12, atol=1e-12, msg=name)


@pytest.mark.slow
def test_a_plan_slower_than_its_own_compute_says_so_once(caplog) -> None:
    """Do no harm: a segment that took longer than all its stages' compute together means one
    worker would have been faster; the trainer says so once, after the warm-up segment, and
    keeps it in ``harm``. (Numbers handed in as a 2-process backend would measure them.)"""
    model = blocks(2)
    trainer = Trainer(stages_of(model, 2), [1, 1], F.mse_loss, momentum, executor="reference",
                      progress=False)
    trainer.backend.world = 2  # as if these were two processes
    trainer._check_harm([1.0, 1.0], 3.0, 8)  # the warm-up segment: never judged
    assert trainer.harm is None
    trainer._check_harm([1.0, 1.0], 1.5, 8)  # pipelined: faster than the 2 s of compute
    trainer._check_harm([1.0, 0.5], 1.8, 8)  # one slow segment (1.2x)...
    trainer._check_harm([1.0, 1.0], 1.5, 8)  # ...then a fast one: the streak is broken
    assert trainer.harm is None
    trainer._check_harm([1.0, 0.5], 1.95, 8)  # 1.3x
    assert trainer.harm is None
    with caplog.at_level("WARNING"):
        trainer._check_harm([1.0, 0.5], 1.8, 8)  # 1.2x: two in a row, the lesser is said
    assert trainer.harm is not None and "one worker would have been 1.20x faster" in trainer.harm
    assert trainer.harm_ratio == pytest.approx(1.2)
    assert "this plan is slower than one worker" in caplog.text
    assert "training goes on with this plan" in caplog.text  # no replan: what happens next
    trainer._check_harm([1.0, 0.5], 9.0, 8)  # said once
    assert "1.20x" in trainer.harm
    ref = Trainer(stages_of(blocks(2), 2), [1, 1], F.mse_loss, momentum, executor="reference",
                  progress=False)  # one process: the ranks ran in turn, nothing to judge
    for _ in range(3):
        ref._check_harm([1.0, 0.5], 9.0, 8)
    assert ref.harm is None



@pytest.mark.parametrize("calibrated,step_s,want", [
    (True, 0.125, 1.43),   # one worker by the profile: 32 samples = 1.0 s (+5%) < 2 s of compute
    (True, 0.5, None),     # a profile slower than the compute sum: the sum (2 s) rules
    (False, 0.125, None),  # not measured here (an estimate): only the compute sum counts
])
def test_one_workers_time_is_the_least_of_the_compute_sum_and_the_profiles_step(
        calibrated: bool, step_s: float, want: float | None) -> None:
    """Split compute is not one worker's (microbatches, per-stage costs): the verdict also
    holds the segment against the compiled profile's measured whole step for its samples,
    with a 5% margin, when the profile was measured (calibrated) on this machine."""
    from fxpipe.costmodel.profile import Profile, ProfileNode

    prof = Profile((ProfileNode("x", "call_module", "x", step_s / 2, step_s / 2, 0.0, 0.0),),
                   batch_size=4, meta={"calibration": {"forward_s": 1.0}} if calibrated else {})
    trainer = Trainer(stages_of(blocks(2), 2), [1, 1], F.mse_loss, momentum, executor="reference",
                      progress=False, auto_options={"profile": prof})
    trainer.backend.world = 2
    trainer._samples = 32  # the segment's samples: 8 profiled batches
    trainer._check_harm([1.0, 1.0], 3.0, 8)  # warm-up
    for _ in range(2):  # two segments in a row of 1.5 s: under the 2 s of compute
        trainer._check_harm([1.0, 1.0], 1.5, 8)
    if want is None:
        assert trainer.harm is None
    else:
        assert trainer.harm_ratio == pytest.approx(1.5 / 1.05, abs=1e-12)
        assert f"one worker would have been {want:.2f}x faster" in trainer.harm
        assert "the profile's whole steps: 1 s" in trainer.harm