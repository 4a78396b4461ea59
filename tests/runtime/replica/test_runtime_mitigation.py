"""Staleness mitigations (fxpipe.runtime.replica.mitigation) against an independent delayed-SGD
formula.

``delayed_training`` below is plain PyTorch in float64, written from the definitions (module doc
of fxpipe.runtime.replica.mitigation and the papers), not from the runtime: minibatch k on stage s
reads the stage's weights after v = max(0, k - d_s) updates, d_s = S - 1 - s (PipeDream's 1F1B); the
gradient is applied as update k. Each mitigation changes one line of it. The reference executor,
running the real schedule, stash and stage code, must agree to float64 rounding.
"""
from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from rt_helpers import split
from torch.func import functional_call

from fxpipe.runtime.errors import RuntimeConfigError
from fxpipe.runtime.execution.reference import ReferenceExecutor
from fxpipe.runtime.schedules.kinds import make_schedule

LR, MOM = 0.05, 0.5
DC_LAMBDA, DC_DECAY, DC_EPS = 2.0, 0.95, 1e-7


def model64(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(),
                         nn.Linear(8, 2)).double()


def data64(n: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(5, 4, generator=g, dtype=torch.float64),
             torch.randn(5, 2, generator=g, dtype=torch.float64)) for _ in range(n)]


def delayed_training(model: nn.Module, stage_of: dict[str, int], S: int, data: list, *,
                     opt: str = "sgd", lr_scale: bool = False, predict: bool = False,
                     dc: bool = False, spike: bool = False) -> tuple[list[float], dict]:
    """Plain delayed SGD (or Adam) with the mitigations written out; returns losses, weights."""
    names = [n for n, _ in model.named_parameters()]
    hist = [{n: p.detach().clone() for n, p in model.named_parameters()}]  # hist[j]: j updates
    state: dict[str, dict[str, torch.Tensor]] = {n: {} for n in names}
    losses = []
    for k, (x, y) in enumerate(data):
        used = {}
        for n in names:
            d = S - 1 - stage_of[n]
            v = max(0, k - d)
            w = hist[v][n]
            if predict and v >= 1:  # extrapolate the last step over the k - v updates to come
                w = w + (k - v) * (hist[v][n] - hist[v - 1][n])
            used[n] = w.clone().requires_grad_(True)
        loss = F.mse_loss(functional_call(model, used, (x,)), y)
        grads = dict(zip(names, torch.autograd.grad(loss, [used[n] for n in names])))
        losses.append(float(loss.detach()))
        new = {}
        for n in names:
            d, g, w, st = S - 1 - stage_of[n], grads[n], hist[k][n], state[n]
            if dc:
                st["ms"] = (1 - DC_DECAY) * g * g + (DC_DECAY * st["ms"] if "ms" in st else 0)
                g = g + DC_LAMBDA / torch.sqrt(st["ms"] + DC_EPS) * g * g * (w - used[n].detach())
            lr = LR / (1 + d) if lr_scale else LR
            if opt == "sgd":
                st["buf"] = g.clone() if "buf" not in st else MOM * st["buf"] + g
                a, b = (MOM ** d, (1 - MOM ** d) / (1 - MOM)) if spike else (1.0, 0.0)
                new[n] = w - lr * (a * st["buf"] + b * g)
            else:  # Adam, betas (0.9, 0.999), eps 1e-8, no weight decay
                b1, b2 = 0.9, 0.999
                st["t"] = st.get("t", 0) + 1
                st["m"] = b1 * st.get("m", 0) + (1 - b1) * g
                st["v"] = b2 * st.get("v", 0) + (1 - b2) * g * g
                a, b = (b1 ** d, 1 - b1 ** d) if spike else (1.0, 0.0)
                num = (a * st["m"] + b * g) / (1 - b1 ** st["t"])
                new[n] = w - lr * num / (torch.sqrt(st["v"] / (1 - b2 ** st["t"])) + 1e-8)
        hist.append(new)
    return losses, hist[-1]


def run_reference(model: nn.Module, cuts: list[int], data: list, opt: str,
                  mitigation: str | None) -> tuple[list[float], dict, int, dict]:
    stages = split(copy.deepcopy(model), cuts)
    S = len(stages)
    stage_of = {n: s for s, st in enumerate(stages) for n, _ in st.gm.named_parameters()}
    factory = ((lambda ps: torch.optim.SGD(ps, lr=LR, momentum=MOM)) if opt == "sgd"
               else (lambda ps: torch.optim.Adam(ps, lr=LR)))
    ex = ReferenceExecutor(stages, [1] * S, make_schedule("pipedream", [1] * S, len(data)),
                           F.mse_loss, factory, mitigation=mitigation)
    res = ex.run(data)
    return res.losses, res.merged_params(), S, stage_of


CASES = [("sgd", None, {}), ("sgd", "lr_scale", {"lr_scale": True}),
         ("sgd", "predict", {"predict": True}), ("sgd", "dc", {"dc": True}),
         ("sgd", "momentum", {"spike": True}), ("adam", "momentum", {"spike": True}),
         ("adam", "predict", {"predict": True}),
         ("sgd", "predict+dc+lr_scale", {"predict": True, "dc": True, "lr_scale": True})]


@pytest.mark.parametrize("opt,mitigation,rule", CASES, ids=[f"{o}-{m}" for o, m, _ in CASES])
def test_mitigation_equals_the_formula(opt: str, mitigation: str | None, rule: dict) -> None:
    data = data64(10)
    model = model64()
    losses, params, S, stage_of = run_reference(model, [1, 3], data, opt, mitigation)
    want_losses, want = delayed_training(model, stage_of, S, data, opt=opt, **rule)
    torch.testing.assert_close(losses, want_losses, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(params, want, rtol=1e-10, atol=1e-12)
    if mitigation is not None:  # and the mitigation changed something
        _, plain = delayed_training(model, stage_of, S, data, opt=opt)
        assert not torch.allclose(plain["0.weight"], params["0.weight"], rtol=0, atol=1e-9)


def test_factory_receives_stage_and_delay() -> None:
    data, model = data64(6), model64()
    calls: list[tuple[int, int]] = []

    def factory(params, stage, delay):  # a user's own staleness-aware step sizes
        calls.append((stage, delay))
        return torch.optim.SGD(params, lr=LR / (1 + delay), momentum=MOM)

    stages = split(copy.deepcopy(model), [1, 3])
    res = ReferenceExecutor(stages, [1, 1, 1], make_schedule("pipedream", [1, 1, 1], 6),
                            F.mse_loss, factory).run(data)
    assert sorted(calls) == [(0, 2), (1, 1), (2, 0)]
    _, mine, _, _ = run_reference(model, [1, 3], data, "sgd", "lr_scale")
    torch.testing.assert_close(res.merged_params(), mine, rtol=0, atol=0)
    kw_only = ReferenceExecutor(split(copy.deepcopy(model), [1, 3]), [1, 1, 1],
                                make_schedule("pipedream", [1, 1, 1], 6), F.mse_loss,
                                lambda ps, **kw: torch.optim.SGD(ps, lr=LR * (1 + kw["stage"])))
    assert [w.stash.optimizer.param_groups[0]["lr"] for w in kw_only.workers.values()] == \
        pytest.approx([LR, 2 * LR, 3 * LR])


def test_momentum_correction_is_a_no_op_without_momentum_or_delay() -> None:
    from fxpipe.runtime.replica.compensate import spike_compensate

    w = torch.randn(3, dtype=torch.float64, requires_grad=True)
    for opt, delay in ((torch.optim.SGD([w], lr=0.1), 3), (torch.optim.SGD([w], lr=0.1,
                                                                              momentum=0.9), 0)):
        before = opt.step
        assert spike_compensate(opt, delay) is opt
        if delay == 0:
            assert opt.step == before
    with pytest.raises(Exception, match="nesterov"):
        spike_compensate(torch.optim.SGD([w], lr=0.1, momentum=0.9, nesterov=True), 2)
    with pytest.raises(Exception, match="(?s)RMSprop.*stage= and delay="):
        spike_compensate(torch.optim.RMSprop([w]), 2)


def test_adamw_weight_decay_compensated_step_matches_torch_at_delay_0_shape() -> None:
    """With a = 1, b = 0 the replacement step is torch's AdamW (checks the transcription)."""
    from fxpipe.runtime.replica.compensate import _adam_step

    torch.manual_seed(0)
    a = torch.randn(5, dtype=torch.float64, requires_grad=True)
    b = a.detach().clone().requires_grad_(True)
    ta, tb = torch.optim.AdamW([a], lr=0.01, weight_decay=0.1), torch.optim.AdamW([b], lr=0.01,
                                                                                  weight_decay=0.1)
    tb._fxpipe_delay = 0
    for _ in range(4):
        g = torch.randn(5, dtype=torch.float64)
        a.grad, b.grad = g.clone(), g.clone()
        ta.step()
        _adam_step(tb)
    torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-13)
    assert set(tb.state[b]) == set(ta.state[a])  # same state keys: checkpoints load either way


@pytest.mark.parametrize("kw,match", [
    ({"mitigation": "predict", "kind": "1f1b-flush"}, "options of the asynchronous schedule"),
    ({"mitigation": "dc", "stashing": False}, "need weight stashing"),
    ({"mitigation": "predict", "vertical_sync": True}, "need weight stashing"),
    ({"mitigation": "shampoo"}, "unknown mitigation 'shampoo'"),
])
def test_bad_combinations_are_refused(kw: dict, match: str) -> None:
    kind = kw.pop("kind", "pipedream")
    stages = split(model64(), [1, 3])
    with pytest.raises(RuntimeConfigError, match=match):
        ReferenceExecutor(stages, [1, 1, 1], make_schedule(kind, [1, 1, 1], 6), F.mse_loss,
                          lambda ps: torch.optim.SGD(ps, lr=LR), **kw)


def test_replicated_stage_stays_identical_under_dc_and_predict() -> None:
    """Replicas of a stage all-reduce DC-corrected gradients and predict from the same step, so
    their weights stay bit-identical (the invariant every replicated stage relies on)."""
    data, model = data64(12), model64()
    stages = split(copy.deepcopy(model), [1, 3])
    ex = ReferenceExecutor(stages, [2, 1, 1], make_schedule("pipedream", [2, 1, 1], 12),
                           F.mse_loss, lambda ps: torch.optim.SGD(ps, lr=LR, momentum=MOM),
                           mitigation="predict+dc")
    res = ex.run(data)
    assert all(math.isfinite(v) for v in res.losses)
    for n, t in res.replica_params[(0, 0)].items():
        assert torch.equal(t, res.replica_params[(0, 1)][n])
