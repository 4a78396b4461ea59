"""``pipedream+nesterov`` (fxpipe.runtime.replica.nesterov) against a float64 formula.

``nesterov_training`` is plain PyTorch in float64 written from the definitions, not from the
runtime: PipeDream's 1F1B with weight stashing (minibatch k on stage s reads the stage's weights
after max(0, k - d_s) updates, d_s = S - 1 - s; its gradient is update k), each stage stepped by
the Nesterov form of the optimizer with the delay-matched coefficient of Ajanthan et al.'s code
(``beta_s = beta + d_s (0.99 - beta) / S``):

* SGD with Nesterov momentum: ``b <- beta_s b + g`` (b = g at the first step), ``w <- w - lr (g +
  beta_s b)``;
* NAdam (Dozat 2016, torch's momentum-decay schedule ``mu_t = beta_s (1 - 0.96^(0.004 t) / 2)``),
  AdamW's weight decay decoupled: ``w <- w (1 - lr wd)``, then ``w <- w - lr (mu_(t+1) m /
  (1 - prod_(i<=t+1) mu_i) + (1 - mu_t) g / (1 - prod_(i<=t) mu_i)) / (sqrt(v / (1 - b2^t)) +
  eps)``.

The reference executor, running the real schedule, stash, stage and optimizer code, must agree to
float64 rounding (NAdam: to 1e-6 relative, 1e-8 absolute, as torch keeps its step count and
momentum product as float32 scalars; a wrong weight version or coefficient moves the result by
order lr * gradient, 1e-2 here); and the per-stage coefficient must matter (the same run with one
coefficient for every stage differs).
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from rt_helpers import split
from test_runtime_mitigation import data64, model64
from torch.func import functional_call

from fxpipe.errors import ConfigError
from fxpipe.runtime.errors import RuntimeConfigError
from fxpipe.runtime.execution.reference import ReferenceExecutor
from fxpipe.runtime.replica.nesterov import matched_momentum, nesterov_form
from fxpipe.runtime.schedules.kinds import make_schedule

LR, MOM, WD = 0.05, 0.5, 0.1
B1, B2, EPS, PSI = 0.9, 0.999, 1e-8, 0.004


def beta_of(base: float, d: int, S: int, matched: bool = True) -> float:
    return base + d * (0.99 - base) / S if matched else base


def nesterov_training(model, stage_of: dict[str, int], S: int, data: list, opt: str,
                      matched: bool = True) -> tuple[list[float], dict]:
    names = [n for n, _ in model.named_parameters()]
    hist = [{n: p.detach().clone() for n, p in model.named_parameters()}]
    state: dict[str, dict] = {n: {} for n in names}
    losses = []
    for k, (x, y) in enumerate(data):
        used = {n: hist[max(0, k - (S - 1 - stage_of[n]))][n].clone().requires_grad_(True)
                for n in names}
        loss = F.mse_loss(functional_call(model, used, (x,)), y)
        grads = dict(zip(names, torch.autograd.grad(loss, [used[n] for n in names])))
        losses.append(float(loss.detach()))
        new = {}
        for n in names:
            d, g, w, st = S - 1 - stage_of[n], grads[n], hist[k][n], state[n]
            if opt == "sgd":
                beta = beta_of(MOM, d, S, matched)
                st["b"] = g.clone() if "b" not in st else beta * st["b"] + g
                new[n] = w - LR * (g + beta * st["b"])
                continue
            beta = beta_of(B1, d, S, matched)
            t = st["t"] = st.get("t", 0) + 1
            mu = [beta * (1 - 0.5 * 0.96 ** (i * PSI)) for i in range(1, t + 2)]
            prod_t = prod_next = 1.0
            for i in range(t):
                prod_t *= mu[i]
            prod_next = prod_t * mu[t]
            if opt == "adamw":
                w = w * (1 - LR * WD)
            st["m"] = beta * st.get("m", 0) + (1 - beta) * g
            st["v"] = B2 * st.get("v", 0) + (1 - B2) * g * g
            denom = torch.sqrt(st["v"] / (1 - B2 ** t)) + EPS
            new[n] = w - LR * (mu[t] * st["m"] / (1 - prod_next)
                               + (1 - mu[t - 1]) * g / (1 - prod_t)) / denom
        hist.append(new)
    return losses, hist[-1]


FACTORIES = {"sgd": lambda ps: torch.optim.SGD(ps, lr=LR, momentum=MOM),
             "adam": lambda ps: torch.optim.Adam(ps, lr=LR),
             "adamw": lambda ps: torch.optim.AdamW(ps, lr=LR, weight_decay=WD)}


def run_reference(model, cuts: list[int], data: list, opt: str, mitigation: str | None = None):
    stages = split(copy.deepcopy(model), cuts)
    S = len(stages)
    stage_of = {n: s for s, st in enumerate(stages) for n, _ in st.gm.named_parameters()}
    ex = ReferenceExecutor(stages, [1] * S, make_schedule("pipedream", [1] * S, len(data)),
                           F.mse_loss, FACTORIES[opt], mitigation=mitigation)
    res = ex.run(data)
    return res.losses, res.merged_params(), S, stage_of, ex


@pytest.mark.parametrize("opt", sorted(FACTORIES))
@pytest.mark.parametrize("cuts", [[1, 3], [1, 2, 3]], ids=["S3", "S4"])
def test_nesterov_equals_the_formula(opt: str, cuts: list[int]) -> None:
    data, model = data64(10), model64()
    losses, params, S, stage_of, ex = run_reference(model, cuts, data, opt, "nesterov")
    want_losses, want = nesterov_training(model, stage_of, S, data, opt)
    tol = {"rtol": 1e-12, "atol": 1e-12} if opt == "sgd" else {"rtol": 1e-6, "atol": 1e-8}
    torch.testing.assert_close(losses, want_losses, **tol)
    torch.testing.assert_close(params, want, **tol)
    # the delay-matched coefficient matters: one coefficient for all stages is another run
    _, flat = nesterov_training(model, stage_of, S, data, opt, matched=False)
    assert not torch.allclose(flat["0.weight"], params["0.weight"], rtol=0, atol=1e-9)
    # and the mitigation changed the run (plain pipedream differs)
    _, plain, _, _, _ = run_reference(model, cuts, data, opt)
    assert not torch.allclose(plain["0.weight"], params["0.weight"], rtol=0, atol=1e-9)
    kind = {"sgd": torch.optim.SGD, "adam": torch.optim.NAdam, "adamw": torch.optim.NAdam}[opt]
    assert {type(w.stash.optimizer) for w in ex.workers.values()} - {type(None)} == {kind}


def test_matched_momentum_table() -> None:
    """By hand: beta 0.9 over S = 4 stages, delays 3, 2, 1, 0."""
    assert [matched_momentum(0.9, d, 4) for d in (3, 2, 1, 0)] == \
        pytest.approx([0.9675, 0.945, 0.9225, 0.9], abs=1e-15)
    assert matched_momentum(0.995, 3, 4) == 0.995  # already above the ceiling: kept
    assert matched_momentum(0.0, 1, 2) == pytest.approx(0.495)
    with pytest.raises(ConfigError):
        matched_momentum(0.9, -1, 4)


def test_nesterov_forms_keep_groups_and_refuse_what_they_do_not_define() -> None:
    w = torch.zeros(3, 2, requires_grad=True)
    b = torch.zeros(2, requires_grad=True)
    sgd = nesterov_form(torch.optim.SGD([{"params": [w], "lr": 0.1},
                                         {"params": [b], "lr": 0.2, "weight_decay": 0.5}],
                                        lr=0.3, momentum=0.9), delay=1, depth=2)
    assert [(g["lr"], g["weight_decay"], g["nesterov"], g["momentum"])
            for g in sgd.param_groups] == [(0.1, 0, True, pytest.approx(0.945)),
                                           (0.2, 0.5, True, pytest.approx(0.945))]
    muon = nesterov_form(torch.optim.Muon([w], lr=0.02, momentum=0.9, nesterov=False), 1, 2)
    assert isinstance(muon, torch.optim.Muon)
    assert (muon.param_groups[0]["momentum"], muon.param_groups[0]["nesterov"]) == \
        (pytest.approx(0.945), True)
    for bad, match in ((torch.optim.SGD([w], lr=0.1, momentum=0.9, dampening=0.1), "dampening"),
                       (torch.optim.AdamW([w], amsgrad=True), "amsgrad"),
                       (torch.optim.RMSprop([w]), "RMSprop")):
        with pytest.raises(ConfigError, match=match):
            nesterov_form(bad, 1, 2)


def test_nesterov_with_spike_compensation_is_refused() -> None:
    with pytest.raises(RuntimeConfigError, match="momentum and nesterov"):
        run_reference(model64(), [1, 3], data64(4), "sgd", "nesterov+momentum")
