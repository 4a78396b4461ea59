"""Wire plans (message shapes known ahead) and the runtime's configuration checks."""
from __future__ import annotations

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
from rt_helpers import batches, loss_fn, sgd, split, tiny_mlp

from fxpipe.codegen.split import placed_nodes, split_graph
from fxpipe.runtime.execution.comm import TensorSpec
from fxpipe.runtime.errors import RuntimeConfigError
from fxpipe.runtime.execution.reference import ReferenceExecutor
from fxpipe.runtime.schedules.kinds import make_schedule
from fxpipe.runtime.execution.wire import make_wire_plan


def test_dry_run_plan_has_one_signature_per_input_shape() -> None:
    stages = split(tiny_mlp(width=6), [1, 3])
    data = batches(3) + batches(1, batch=2)
    plan = make_wire_plan(stages, [x for x, _ in data])
    assert plan.values == ("_0", "_2")  # the first and third layers' outputs cross the cuts
    assert plan.signature_of == (0, 0, 0, 1)
    assert plan.spec("_0", 0) == TensorSpec((4, 6), torch.float32)
    assert plan.spec("_2", 3) == TensorSpec((2, 6), torch.float32)


def test_plan_from_tracer_metadata_when_it_fits(monkeypatch: pytest.MonkeyPatch) -> None:
    from fxpipe.runtime.execution import wire
    from fxpipe.tracing.shapes import propagate_shapes
    dry_runs = []
    real = wire._dry_run
    monkeypatch.setattr(wire, "_dry_run", lambda *a: dry_runs.append(1) or real(*a))
    gm = fx.symbolic_trace(tiny_mlp(width=6))
    propagate_shapes(gm, (torch.randn(4, 4),))
    stages = split_graph(gm, {n.name: int(i > 2) for i, n in enumerate(placed_nodes(gm))})
    plan = make_wire_plan(stages, [torch.randn(4, 4), torch.randn(3, 4)])
    assert plan.spec("_1", 0) == TensorSpec((4, 6), torch.float32)
    assert plan.spec("_1", 1) == TensorSpec((3, 6), torch.float32)
    assert len(dry_runs) == 1  # only for the batch of 3: the metadata describes batch 4


def test_lazy_facade() -> None:
    import fxpipe.runtime as rt
    import fxpipe.runtime.execution.reference
    import fxpipe.runtime.schedules.kinds
    assert rt.make_schedule is fxpipe.runtime.schedules.kinds.make_schedule
    assert rt.ReferenceExecutor is fxpipe.runtime.execution.reference.ReferenceExecutor
    with pytest.raises(AttributeError):
        rt.nothing_here  # noqa: B018


class TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.a(x)
        return h, self.b(h)


def test_model_output_made_on_an_early_stage_trains_through_the_last_stage() -> None:
    """h is a model output made on stage 0: it is routed to stage 1, which returns it with b(h),
    and the loss's gradient through h reaches stage 0 (plain SGD, one minibatch in flight)."""
    torch.manual_seed(0)
    model = TwoHeads()
    gm = fx.symbolic_trace(model)
    stages = split_graph(gm, {n.name: int(n.name == "b") for n in placed_nodes(gm)})
    assert stages[0].consumers == ((1,),) and stages[1].outputs == ("a", "b")

    def two_head_loss(out: tuple[torch.Tensor, torch.Tensor], y: torch.Tensor) -> torch.Tensor:
        h, z = out
        return (z - y).pow(2).mean() + 0.5 * h.pow(2).mean()

    data = [(torch.randn(3, 4), torch.randn(3, 2)) for _ in range(4)]
    ref_model = TwoHeads()
    ref_model.load_state_dict(model.state_dict())
    ex = ReferenceExecutor(stages, [1, 1], make_schedule("1f1b-flush", [1, 1], 4, microbatches=1),
                           two_head_loss, lambda ps: torch.optim.SGD(ps, lr=0.1))
    res = ex.run(data)
    opt = torch.optim.SGD(ref_model.parameters(), lr=0.1)
    for (x, y), got in zip(data, res.losses):
        opt.zero_grad()
        loss = two_head_loss(ref_model(x), y)
        assert got == pytest.approx(float(loss), rel=1e-6)
        loss.backward()
        opt.step()
    trained = res.merged_params()
    for name, p in ref_model.named_parameters():
        torch.testing.assert_close(trained[name], p.detach(), rtol=1e-6, atol=1e-7)
