"""precision="fp16": float16 autocast with dynamic loss scaling equals an eager loop with
torch.amp.GradScaler("cpu") + torch.autocast("cpu", dtype=torch.float16) (written here; CPU
float16 autocast exists in torch 2.13). A forced overflow on ONE stage skips that step on every
stage and halves the one scale; the scaler state survives a checkpoint; asynchronous schedules
are refused. One process (executor="reference")."""
from __future__ import annotations

import copy
import functools
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from rt_helpers import split

from fxpipe.runtime.errors import RuntimeConfigError
from fxpipe.runtime.training.trainer import Trainer

sgd = functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9)
SCALER = {"init_scale": 2.0 ** 12, "growth_interval": 3}
HUGE = 2000.0


class Net(nn.Module):
    """Stage 0 (cut after node 1): a Linear with small weights, so a HUGE input keeps its output
    moderate while its weight gradient (input x upstream gradient, a float16 matmul under
    autocast) overflows; stage 1 sees tanh-bounded activations and finite gradients."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 2)
        with torch.no_grad():
            self.a.weight.mul_(1e-3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


def data(n: int, huge: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Random minibatches; minibatch ``huge``'s inputs HUGE times larger (the first layer's
    output stays below 1, its float16 weight gradient overflows)."""
    g = torch.Generator().manual_seed(1)
    out = [(torch.randn(4, 4, generator=g), torch.randn(4, 2, generator=g)) for _ in range(n)]
    if huge is not None:
        out[huge] = (out[huge][0] * HUGE, out[huge][1])
    return out


def eager_gradscaler(model: nn.Module, batches: list, m: int, clip: float | None = None,
                     epochs: int = 1, opt_factory=sgd) -> tuple[float, list[float]]:
    """The loop of torch's AMP recipe (gradient accumulation over m, unscale before clipping,
    scaler.step / scaler.update per batch). Returns the final scale and the scale after each
    update."""
    opt = opt_factory(model.parameters())
    scaler = torch.amp.GradScaler("cpu", **SCALER)
    scales = []
    for _ in range(epochs):
        for b in range(0, len(batches), m):
            opt.zero_grad()
            for x, y in batches[b:b + m]:
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = F.mse_loss(model(x), y) / m
                scaler.scale(loss).backward()
            scaler.unscale_(opt)
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
    return scaler.get_scale(), scales


def fp16_trainer(model: nn.Module, replicas: list[int], m: int, opt_factory=sgd, **kw
                 ) -> Trainer:
    return Trainer(split(copy.deepcopy(model), [1]), replicas, F.mse_loss, opt_factory,
                   schedule=kw.pop("schedule", "1f1b-flush"), microbatches=m,
                   executor="reference", progress=False, precision="fp16",
                   loss_scaler=SCALER, **kw)


def scales(trainer: Trainer) -> set[float]:
    return {w.scaler.scale for w in trainer.local.values()}  # type: ignore[union-attr]


@pytest.mark.parametrize("replicas,clip", [([1, 1], None), ([2, 1], 0.5)])
def test_fp16_equals_eager_autocast_with_gradscaler(replicas: list[int], clip: float | None
                                                    ) -> None:
    """m = 4 (a power of two: dividing the loss first, as eager does, is exact). The scale grows
    after every 3 clean updates: 4 updates per epoch, 2 epochs -> two growths."""
    batches, m, model = data(16), 4, Net()
    trainer = fp16_trainer(model, replicas, m, clip_grad_norm=clip)
    trainer.fit(batches, epochs=2)
    final, _ = eager_gradscaler(model, batches, m, clip, epochs=2)
    assert final == SCALER["init_scale"] * 2 ** 2
    assert scales(trainer) == {final}  # one scale, every stage and replica
    got = trainer.state_dict()
    for name, p in model.named_parameters():
        torch.testing.assert_close(got[name], p.detach(), rtol=1e-6, atol=1e-7, msg=name)


def test_overflow_on_one_stage_skips_that_step_on_every_stage_and_halves_the_scale() -> None:
    m, model = 1, Net()
    batches = data(8, huge=5)
    small = functools.partial(torch.optim.SGD, lr=1e-3)  # keeps the first layer's weights small
    trainer = fp16_trainer(model, [1, 1], m, small)
    seen: dict[int, list] = {}  # update -> stage 1's weights after it
    last = trainer.local[(1, 0)]
    last.on_update = lambda: seen.setdefault(len(seen), [t.clone() for t in
                                                          last.stash.latest.values()])
    found_on: dict[int, list[bool]] = {}
    real = {r: w.scaler.unscale for r, w in trainer.local.items()}  # type: ignore[union-attr]
    for r, w in trainer.local.items():
        def spy(grads, r=r):
            out, flag = real[r](grads)
            found_on.setdefault(r[0], []).append(bool(flag))
            return out, flag
        w.scaler.unscale = spy  # type: ignore[union-attr,method-assign]
    trainer.fit(batches, epochs=1)
    final, eager_scales = eager_gradscaler(model, batches, m, opt_factory=small)
    # only stage 0 saw the overflow, at update 5; stage 1's own gradients were finite
    assert found_on[0] == [k == 5 for k in range(8)] and found_on[1] == [False] * 8
    # ... yet stage 1 skipped it too: its weights after update 5 are those after update 4
    assert all(torch.equal(a, b) for a, b in zip(seen[4], seen[5]))
    assert not all(torch.equal(a, b) for a, b in zip(seen[3], seen[4]))
    # 2^12 -> x2 after 3 clean updates -> /2 at the overflow (tracker reset) -> no growth yet
    assert eager_scales == [4096.0, 4096.0, 8192.0, 8192.0, 8192.0, 4096.0, 4096.0, 4096.0]
    assert scales(trainer) == {final}
    got = trainer.state_dict()
    for name, p in model.named_parameters():
        torch.testing.assert_close(got[name], p.detach(), rtol=1e-6, atol=1e-7, msg=name)


@pytest.mark.slow
def test_loss_scaler_state_survives_a_checkpoint(tmp_path: Path) -> None:
    batches, model = data(8, huge=1), Net()
    small = functools.partial(torch.optim.SGD, lr=1e-3)

    class Crash(Exception):
        pass

    def crash(epoch: int, pos: int) -> None:
        if (epoch, pos) == (0, 4):
            raise Crash()

    def make(ckpt: Path, **kw) -> Trainer:
        return fp16_trainer(model, [1, 1], 1, small, checkpoint_dir=str(ckpt), checkpoint_every=2,
                            segment=2, **kw)
    full = make(tmp_path / "full")
    full.fit(batches, epochs=2)
    with pytest.raises(Crash):
        make(tmp_path / "run", on_checkpoint=crash).fit(batches, epochs=2)
    saved = torch.load(tmp_path / "run" / "e0000-m0000004" / "stage0.pt", weights_only=True)
    assert saved["loss_scaler"] == {"scale": 2048.0, "growth_tracker": 2}  # halved at update 1
    resumed = make(tmp_path / "run")
    resumed.fit(batches, epochs=2, resume=True)
    assert scales(resumed) == scales(full)
    want, got = full.state_dict(), resumed.state_dict()
    assert all(torch.equal(want[n], got[n]) for n in want)


@pytest.mark.parametrize("schedule", ["pipedream", "2bw", "auto"])
def test_fp16_with_an_asynchronous_or_auto_schedule_is_refused(schedule: str) -> None:
    with pytest.raises(RuntimeConfigError, match="fp16"):
        fp16_trainer(Net(), [1, 1], 2, schedule=schedule)


def test_bad_loss_scaler_options_are_clear_errors() -> None:
    for bad, match in (({"init_scal": 1.0}, "init_scal"), ({"backoff_factor": 2.0}, "backoff")):
        with pytest.raises(RuntimeConfigError, match=match):
            Trainer(split(Net(), [1]), [1, 1], F.mse_loss, sgd, schedule="1f1b-flush",
                    executor="reference", precision="fp16", loss_scaler=bad)


@pytest.mark.parametrize("dtypes", [(torch.float32,), (torch.float16,), (torch.bfloat16,),
                                    (torch.float32, torch.float16)])
@pytest.mark.parametrize("scale", [2.0 ** 16, 3.0, 2.0 ** -20])
@pytest.mark.parametrize("bad", [None, "inf", "nan", "overflow"])
def test_unscale_is_the_per_gradient_formula_bit_for_bit(dtypes: tuple[torch.dtype, ...],
                                                         scale: float, bad: str | None) -> None:
    """LossScaler.unscale (multi-tensor, per device and dtype) against the formula written
    here one gradient at a time: g * float32(1 / scale), rounded to g's dtype, and the flag set
    iff any unscaled value is not finite; new tensors; a None gradient stays None."""
    from fxpipe.runtime.replica.loss_scale import LossScaler, ScalerConfig

    g = torch.Generator().manual_seed(0)
    grads: dict[str, torch.Tensor | None] = {
        f"p{i}": (torch.randn(7 + i, 3, generator=g) * 10.0 ** (i % 3)).to(dtypes[i % len(dtypes)])
        for i in range(9)}
    grads["frozen"] = None
    big = torch.finfo(grads["p4"].dtype).max  # finite; overflows when unscaled at scale < 1
    if bad is not None:
        grads["p4"][1, 2] = {"inf": float("inf"), "nan": float("nan"), "overflow": big}[bad]
    out, found = LossScaler(ScalerConfig(init_scale=scale)).unscale(grads)
    inv = torch.tensor(1.0 / scale, dtype=torch.float32)
    expected_bad = False
    for name, grad in grads.items():
        if grad is None:
            assert out[name] is None
            continue
        want = grad * inv  # a 0-d float32 tensor does not promote: g's dtype
        got = out[name]
        assert got is not None and got.dtype == grad.dtype and got.data_ptr() != grad.data_ptr()
        assert torch.equal(got.view(torch.int16 if got.element_size() == 2 else torch.int32),
                           want.view(torch.int16 if want.element_size() == 2 else torch.int32))
        expected_bad |= not bool(torch.isfinite(want).all())
    assert found.dtype == torch.float32 and float(found) == float(expected_bad)
    if bad in ("inf", "nan") or (bad == "overflow" and scale < 1):  # the planted value
        assert expected_bad
    if bad is None and scale > 1:  # small values, made smaller
        assert not expected_bad
