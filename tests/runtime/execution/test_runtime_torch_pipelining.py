"""fxpipe's automatic split inside torch.distributed.pipelining: torch's own schedules
(Schedule1F1B, ScheduleInterleaved1F1B, ScheduleZBVZeroBubble, ScheduleDualPipeV) train fxpipe's
stages, skip connections carried through the stages in between, tied weights kept one
parameter, and land exactly where fxpipe's reference executor does with the same synchronous semantics (1f1b-flush:
one update per batch of m microbatches, the mean of their gradients)."""
from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from rt_helpers import SkipMLP, batches, loss_fn, split, tiny_mlp
from rt_tied import TiedLM, ce, token_batches

from fxpipe.codegen.carry import carried, carry_stages
from fxpipe.codegen.pipeline import run_stages
from fxpipe.runtime.errors import RuntimeConfigError
from fxpipe.runtime.execution.launch import free_port
from fxpipe.runtime.execution.reference import ReferenceExecutor
from fxpipe.runtime.schedules.kinds import make_schedule
from fxpipe.runtime.execution.torch_pipelining import stage_ranks

M = 4  # microbatches per step


def SGD(params: list) -> torch.optim.Optimizer:  # noqa: N802 - a factory, named like a class
    return torch.optim.SGD(params, lr=0.1)


def _whole(data: list, m: int) -> list:
    """m microbatches -> one batch per step (torch's schedule chunks it back along dim 0)."""
    return [(torch.cat([x for x, _ in data[i:i + m]]), torch.cat([y for _, y in data[i:i + m]]))
            for i in range(0, len(data), m)]


def _gpt_stages() -> list:
    """The zoo's mini GPT split by fxpipe into 4 stages: tied embedding/output weights on the
    first and last stage, residual streams and views crossing every boundary."""
    import fxpipe
    from fxpipe import models
    spec = models.get("gpt", batch_size=2)
    return fxpipe.compile(spec.model, fxpipe.Cluster(workers=4, device="V100"),
                          example_inputs=spec.example_inputs, stages=4,
                          straight=True).stage_specs


def _gpt_batches(n: int) -> list:
    from fxpipe import models
    spec = models.get("gpt", batch_size=2)
    return [(x, y) for (x,), y in (spec.make_batch(2, seed=k) for k in range(n))]


def _gpt_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(out.reshape(-1, out.size(-1)), y.reshape(-1))


CASES = {
    # name: (model, cuts, world, placement, torch schedule, loss, data)
    "1f1b-2stages": (tiny_mlp, [2], 2, "loop", "Schedule1F1B", loss_fn, batches(2 * M)),
    "interleaved-skip-4stages-2ranks": (SkipMLP, [1, 2, 4], 2, "loop", "ScheduleInterleaved1F1B",
                                        loss_fn, batches(2 * M)),
    "zbv-tied-4stages-2ranks": (TiedLM, [1, 2, 3], 2, "v", "ScheduleZBVZeroBubble", ce,
                                token_batches(2 * M)),
    "interleaved-tied-across-ranks": (TiedLM, [1, 2, 3], 2, "loop", "ScheduleInterleaved1F1B",
                                      ce, token_batches(2 * M)),
    "zbv-gpt-4stages-2ranks": (None, None, 2, "v", "ScheduleZBVZeroBubble", _gpt_loss,
                               _gpt_batches(2 * M)),
    "dualpipev-skip-4stages-2ranks": (SkipMLP, [1, 2, 4], 2, "v", "ScheduleDualPipeV", loss_fn,
                                      batches(2 * M)),
    "dualpipev-gpt-4stages-2ranks": (None, None, 2, "v", "ScheduleDualPipeV", _gpt_loss,
                                     _gpt_batches(2 * M)),
}


def _stages(name: str) -> list:
    make, cuts = CASES[name][:2]
    return _gpt_stages() if make is None else split(make(), cuts)


def _spawned(name: str) -> tuple[dict, list[float]]:
    from torch_pipelining_job import run
    make, cuts, world, placement, schedule, lf, data = CASES[name]
    case = dict(stages=_stages(name), placement=placement, schedule=schedule,
                microbatches=M, loss_fn=lf, optimizer=SGD, data=_whole(data, M))
    with tempfile.TemporaryDirectory() as out:
        ctx = mp.get_context("spawn")
        port = free_port()
        procs = [ctx.Process(target=run, args=(r, world, port, case, out), daemon=True)
                 for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(120)
        for p in procs:
            if p.is_alive():
                p.kill()
        errors = [f.read_text() for f in Path(out).glob("*.err")]
        assert all(p.exitcode == 0 for p in procs) and not errors, errors
        params, losses = {}, []
        for r in range(world):
            got = torch.load(Path(out) / f"rank{r}.pt")
            params.update(got["params"])
            losses += got["losses"]
    return params, losses


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", sorted(CASES))
def test_torch_schedule_on_fxpipes_split_equals_the_reference(name: str) -> None:
    make, cuts, world, placement, schedule, lf, data = CASES[name]
    params, losses = _spawned(name)
    stages = _stages(name)
    ref = ReferenceExecutor(stages, [1] * len(stages),
                            make_schedule("1f1b-flush", [1] * len(stages), len(data),
                                          microbatches=M), lf, SGD).run(data)
    want = ref.merged_params()
    assert set(params) == set(want)
    for n in want:
        torch.testing.assert_close(params[n], want[n], rtol=1e-6, atol=1e-7, msg=n)
    torch.testing.assert_close(sorted(losses), sorted(ref.losses), rtol=1e-6, atol=1e-7)


def test_carried_values_reach_every_later_stage() -> None:
    """SkipMLP's h1 (made on stage 0, used on stages 1 and 3) crosses every boundary up to 3;
    the carry stages composed compute the model."""
    stages = split(SkipMLP(), [1, 2, 4])
    bounds = carried(stages)
    skips = [(n, src, st.index) for st in stages for n, src in zip(st.inputs, st.sources)
             if src >= 0 and st.index > src + 1]
    assert skips  # the split really skips a stage
    for n, src, dst in skips:
        assert [n in b for b in bounds] == [src <= b < dst for b in range(len(bounds))]
    x = torch.randn(3, 4)
    mods = carry_stages(stages)
    out = x
    for m in mods:
        out = m(*(out if isinstance(out, tuple) else (out,)))
    torch.testing.assert_close(out, run_stages(stages, (x,)), rtol=0, atol=0)


class MaskedMLP(torch.nn.Module):
    """Three layers reading one mask made from the input alone (as a decoder's layers read its
    attention mask)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        keep = (x.abs() > 0.1).float()
        h = torch.relu(self.a(x)) * keep
        h = torch.relu(self.b(h)) * keep
        return self.c(h * keep)


def test_a_value_made_from_the_inputs_is_carried_as_those_inputs() -> None:
    """The mask is made again by each stage that reads it (fxpipe.passes.made_here), so torch's
    one-edge convention carries the model input x through the stages, not the mask; the carry
    stages composed compute the model."""
    model = MaskedMLP()
    stages = split(model, [6, 9])  # [abs .. mul], [b .. mul_1], [mul_2, c]
    assert [st.inputs for st in stages] == [("x",), ("x", "mul"), ("x", "mul_1")]
    assert carried(stages) == [("x", "mul"), ("x", "mul_1")]
    x = torch.randn(3, 4)
    out = x
    for m in carry_stages(stages):
        out = m(*(out if isinstance(out, tuple) else (out,)))
    torch.testing.assert_close(out, model(x), rtol=0, atol=0)


def test_placements() -> None:
    assert stage_ranks(4, 2, "loop") == [0, 1, 0, 1]
    assert stage_ranks(4, 2, "v") == [0, 1, 1, 0]
    with pytest.raises(RuntimeConfigError, match="placement 'v' needs 2 x 2 stages"):
        stage_ranks(6, 2, "v")
    with pytest.raises(RuntimeConfigError, match="3 stages do not divide among 2 ranks"):
        stage_ranks(3, 2, "loop")
