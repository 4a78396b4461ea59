"""Stage calibration: the plan priced on its stages as the runtime runs them, before the run."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxpipe
from fxpipe.runtime.errors import RuntimeConfigError
from fxpipe.runtime.pricing.replan import stage_starts
from fxpipe.runtime.training.stage_calibration import calibrate_stages


def sgd(params: list[torch.Tensor]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.01, momentum=0.9)


def batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)) for _ in range(n)]


def compiled(stages: int):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(),
                          nn.Linear(32, 4))
    return fxpipe.compile(model, fxpipe.Cluster(workers=stages), example_inputs=(batches(1)[0][0],),
                          loss_fn=F.mse_loss, stages=stages, straight=True)


@pytest.mark.parametrize("stages", [1, 2])
def test_the_plan_is_priced_on_the_stage_times_measured_in_this_process(stages: int) -> None:
    c = compiled(stages)
    before = {k: v.clone() for k, v in c.model.state_dict().items()}
    cal = calibrate_stages(c.stage_specs, c.plan, c.profile, F.mse_loss, sgd, batches(8))
    # the same cuts and replicas, priced again
    assert stage_starts(cal.profile, cal.plan) == stage_starts(c.profile, c.plan)
    assert cal.plan.replicas == c.plan.replicas and len(cal.measured) == stages
    # each stage's rescaled profile sums to what was measured, kind by kind
    for st, m in zip(cal.plan.stages, cal.measured):
        nodes = [n for n in cal.profile.nodes if n.name in set(st.nodes)]
        assert sum(n.forward_s for n in nodes) == pytest.approx(m.forward_s, rel=1e-9)
        assert sum(n.backward_s for n in nodes) == pytest.approx(m.backward_s, rel=1e-9)
        assert sum(n.update_s for n in nodes) == pytest.approx(m.update_s, rel=1e-9)
        assert m.forward_s > 0 and m.backward_s > 0 and m.update_s > 0
    if stages == 1:  # one worker, no links: its time per minibatch is its measured compute
        m = cal.measured[0]
        assert cal.time_per_minibatch == pytest.approx(m.forward_s + m.backward_s + m.update_s,
                                                       rel=1e-9)
    for k, v in c.model.state_dict().items():  # the replicas trained copies
        assert torch.equal(v, before[k]), k


def test_too_few_minibatches_or_the_wrong_stages_are_refused() -> None:
    c = compiled(2)
    with pytest.raises(RuntimeConfigError, match="pass more minibatches"):
        calibrate_stages(c.stage_specs, c.plan, c.profile, F.mse_loss, sgd, batches(1))
    with pytest.raises(RuntimeConfigError, match="1 stages for a plan of 2"):
        calibrate_stages(c.stage_specs[:1], c.plan, c.profile, F.mse_loss, sgd, batches(8))


def test_the_compiled_model_calibrates_its_own_stages() -> None:
    c = compiled(2)
    cal = c.calibrate_stages(batches(8), sgd)
    assert stage_starts(cal.profile, cal.plan) == stage_starts(c.profile, c.plan)
    assert len(cal.factors) == 2 and all(len(f) == 3 for f in cal.factors)
