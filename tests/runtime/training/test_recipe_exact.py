"""The default trains exactly the user's recipe when fxpipe cuts minibatches (issue 23).

Every oracle is plain PyTorch written here: the same initial weights (a deepcopy), the same
loader minibatches, the same optimizer, one step per minibatch, no fxpipe code. fxpipe runs
the default ``compiled.trainer(...)`` (``schedule="auto"``; its pilot off, so on 2 stages it
trains 1f1b-flush with each minibatch cut into 2 microbatches) and the named flushing kinds with
``split=`` (the same cut), on the reference executor. Each row of the issue's table: a sum loss,
a mean over an uneven cut and a DataLoader's short last batch, a token mean with ``-100``
padding of uneven length (Hugging Face Llama), a time-major ``nn.LSTM``, tensors whose length
equals the batch by coincidence, a loss over the whole minibatch (refused), BatchNorm.
"""
from __future__ import annotations

import copy
import logging
from typing import Any, Callable

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxpipe
from recipe_job import TimeMajor  # nn.LSTM in its default layout (T, B, F)
from fxpipe.runtime.errors import RuntimeConfigError
from fxpipe.runtime.training.loss_split import LossSplitError

LR = 0.05
SCHEDULES = [("auto", {}), ("1f1b-flush", {"split": 2}), ("gpipe", {"split": 2}),
             ("zb-h1", {"split": 3})]


def sgd(ps: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(ps, lr=LR, momentum=0.9)


def plain(model: nn.Module, loader: list, loss: Callable[..., torch.Tensor],
          opt: Callable[..., torch.optim.Optimizer] = sgd) -> tuple[dict, list[float]]:
    """The oracle: one optimizer step per minibatch on the whole minibatch."""
    o = opt(model.parameters())
    losses = []
    for x, y in loader:
        o.zero_grad()
        value = loss(model(**x) if isinstance(x, dict) else model(x), y)
        value.backward()
        o.step()
        losses.append(float(value.detach()))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, losses


def fxpipe_fit(model: nn.Module, example: Any, loader: list, loss: Any, schedule: str,
               extra: dict, opt: Callable[..., torch.optim.Optimizer] = sgd,
               stages: int = 2) -> tuple[dict, float, Any]:
    compiled = fxpipe.compile(model, fxpipe.Cluster(workers=stages), example_inputs=example,
                              loss_fn=loss, stages=stages, straight=True, repeats=1)
    kw = dict(extra)
    if schedule != "auto":
        kw["schedule"] = schedule
    else:
        kw["auto_options"] = {"pilot": 0}
    tr = compiled.trainer(optimizer=opt, executor="reference", progress=False, **kw)
    hist = tr.fit(loader)
    return tr.state_dict(), hist[-1]["loss"], tr


def close(got: dict, want: dict, tol: float = 2e-5) -> None:
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, rtol=tol, atol=tol, msg=lambda m: f"{k}: {m}")


def mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                         nn.Linear(16, 3))


def classification(n: int, batch: int, seed: int = 1) -> list:
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(n, 4, generator=g), torch.randint(0, 3, (n,), generator=g)
    return [(x[i:i + batch], y[i:i + batch]) for i in range(0, n, batch)]


@pytest.mark.parametrize("schedule,extra", SCHEDULES)
@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_sum_and_uneven_mean_equal_plain_pytorch(schedule: str, extra: dict,
                                                 reduction: str) -> None:
    """5-sample minibatches cut 3 + 2 (or 2 + 2 + 1), and a short last one of 3 samples (a
    DataLoader without drop_last): the update is the whole minibatch's gradient, the logged
    loss its loss."""
    loader = classification(33, 5)
    loss = nn.CrossEntropyLoss(reduction=reduction)
    want, losses = plain(mlp(), loader, loss)
    got, logged, _ = fxpipe_fit(mlp(), (loader[0][0],), loader, loss, schedule, extra)
    close(got, want)
    assert logged == pytest.approx(sum(losses) / len(losses), rel=1e-5)


def llama() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=50,
                                   max_position_embeddings=64)
    return transformers.LlamaForCausalLM(cfg)


def padded_lm_batches(n: int, batch: int, seq: int, seed: int = 3) -> list:
    """Token batches with labels and -100 padding of uneven length (right-padded), as a
    Hugging Face collator makes them."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, 50, (batch, seq), generator=g)
        lengths = torch.randint(2, seq + 1, (batch,), generator=g)
        mask = torch.arange(seq)[None] < lengths[:, None]
        labels = ids.masked_fill(~mask, -100)
        out.append(({"input_ids": ids, "attention_mask": mask.long(), "labels": labels}, None))
    return out


def hf_loss(out: Any, target: Any) -> torch.Tensor:
    return out.loss if hasattr(out, "loss") else out["loss"]


@pytest.mark.slow
@pytest.mark.parametrize("schedule,extra", SCHEDULES[:2])
def test_token_mean_with_padding_equals_plain_on_llama(schedule: str, extra: dict) -> None:
    """Hugging Face's causal-LM loss is a mean over valid (shifted) labels: microbatches are
    weighted by their valid labels, so the update is the whole minibatch's (2 stages; the
    graph comes from torch.export, with its batch dimension left free)."""
    loader = padded_lm_batches(4, 4, 8)
    want, losses = plain(llama(), loader, hf_loss, lambda ps: torch.optim.SGD(ps, lr=0.5))
    got, logged, tr = fxpipe_fit(llama(), loader[0][0], loader, None, schedule, extra,
                                 lambda ps: torch.optim.SGD(ps, lr=0.5))
    assert tr.loss_rule.kind == "token" and tr.loss_rule.shift == 1
    close(got, want, 5e-5)
    assert logged == pytest.approx(sum(losses) / len(losses), rel=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("steps", [6, 4])  # T != B, and T == B (a dim-0 guess crashed)
def test_time_major_lstm_is_cut_along_the_batch(steps: int) -> None:
    g = torch.Generator().manual_seed(5)
    loader = [(torch.randn(steps, 4, 3, generator=g), torch.randint(0, 2, (4,), generator=g))
              for _ in range(5)]
    loss = nn.CrossEntropyLoss()
    want, _ = plain(TimeMajor(), loader, loss)
    got, _, tr = fxpipe_fit(TimeMajor(), (loader[0][0],), loader, loss, "auto", {},
                            stages=2)
    assert tr.cut_spec.inputs == {"[0][0]": 1} and tr.cut_spec.target == {"": 0}
    close(got, want)


class Weighted(nn.Module):
    """Takes per-class weights (C,) beside x: with C == batch they look batch-sized."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x))) * w


@pytest.mark.slow
def test_a_tensor_of_batch_length_by_coincidence_goes_whole() -> None:
    g = torch.Generator().manual_seed(2)
    w = torch.tensor([1.0, 2.0, 0.5, 1.5])  # 4 classes, minibatches of 4
    loader = [((torch.randn(4, 4, generator=g), w), torch.randint(0, 4, (4,), generator=g))
              for _ in range(5)]
    loss = nn.CrossEntropyLoss()
    model = Weighted()
    o = sgd(model.parameters())
    for (x, ww), y in loader:  # the oracle, by hand (two inputs)
        o.zero_grad()
        loss(model(x, ww), y).backward()
        o.step()
    compiled = fxpipe.compile(Weighted(), fxpipe.Cluster(workers=2), example_inputs=loader[0][0],
                              loss_fn=loss, stages=2, straight=True, repeats=1)
    tr = compiled.trainer(optimizer=sgd, executor="reference", progress=False,
                          auto_options={"pilot": 0})
    tr.fit(loader)
    assert tr.cut_spec.inputs == {"[0][0]": 0, "[0][1]": None}
    close(tr.state_dict(), model.state_dict())


@pytest.mark.slow
def test_position_ids_of_one_row_go_whole_on_llama() -> None:
    loader = padded_lm_batches(3, 4, 8)
    for x, _ in loader:
        x["position_ids"] = torch.arange(8)[None]
    opt = lambda ps: torch.optim.SGD(ps, lr=0.5)  # noqa: E731
    want, _ = plain(llama(), loader, hf_loss, opt)
    got, _, tr = fxpipe_fit(llama(), loader[0][0], loader, None, "auto", {}, opt)
    assert tr.cut_spec.inputs["[1]['position_ids']"] is None
    close(got, want, 5e-5)


def in_batch_negatives(out: torch.Tensor, target: Any) -> torch.Tensor:
    """Contrastive: every sample against every other of the minibatch."""
    logits = out @ out.t()
    return F.cross_entropy(logits, torch.arange(len(out)))


@pytest.mark.slow
@pytest.mark.parametrize("schedule,extra", SCHEDULES[:2])
def test_a_loss_over_the_whole_minibatch_is_refused_before_training(schedule: str,
                                                                    extra: dict) -> None:
    loader = classification(20, 4)
    model = mlp()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(LossSplitError, match="not a combination") as err:
        fxpipe_fit(model, (loader[0][0],), loader, in_batch_negatives, schedule, extra)
    assert "microbatches=" in err.value.hint and "per sample" in err.value.hint
    close(model.state_dict(), before, 0)  # nothing trained
    # one microbatch per update trains it (a named schedule with microbatches=1)
    got, _, _ = fxpipe_fit(mlp(), (loader[0][0],), loader, in_batch_negatives, "1f1b-flush",
                           {"microbatches": 1})
    want, _ = plain(mlp(), loader, in_batch_negatives)
    close(got, want)


class Norm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.bn, self.b = nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.bn(self.a(x))))


@pytest.mark.slow
def test_batchnorm_under_a_cut_is_warned_once_and_one_sample_refused(
        caplog: pytest.LogCaptureFixture) -> None:
    loader = classification(24, 6)
    loss = nn.CrossEntropyLoss()
    with caplog.at_level(logging.WARNING, logger="fxpipe"):
        fxpipe_fit(Norm(), (loader[0][0],), loader, loss, "auto", {})
    warned = [r for r in caplog.records if "BatchNorm" in r.getMessage()]
    assert len(warned) == 1 and "bn" in warned[0].getMessage() and "3 samples" in \
        warned[0].getMessage()
    tiny = classification(8, 2)  # 2 samples cut in 2: BatchNorm would see one
    with pytest.raises(RuntimeConfigError, match="BatchNorm .*1 sample"):
        fxpipe_fit(Norm(), (tiny[0][0],), tiny, loss, "auto", {})


@pytest.mark.slow
def test_fit_and_summary_say_what_trains() -> None:
    loader = classification(10, 5)
    compiled = fxpipe.compile(mlp(), fxpipe.Cluster(workers=2), example_inputs=(loader[0][0],),
                              loss_fn=nn.CrossEntropyLoss(reduction="sum"), stages=2,
                              straight=True, repeats=1)
    tr = compiled.trainer(optimizer=sgd, executor="reference", progress=False,
                          auto_options={"pilot": 0})
    tr.fit(loader)
    text = compiled.summary()
    assert "schedule: 1f1b-flush" in text
    assert "into 2 microbatches (5 samples -> [3, 2])" in text
    assert "dim 0 of input 0, dim 0 of the target" in text
    assert "(the loss is a sum: microbatch losses added)" in text


def test_split_is_checked() -> None:
    loader = classification(10, 5)
    compiled = fxpipe.compile(mlp(), fxpipe.Cluster(workers=2), example_inputs=(loader[0][0],),
                              loss_fn=nn.CrossEntropyLoss(), stages=2, straight=True, repeats=1)
    for bad in ({"schedule": "pipedream", "split": 2}, {"schedule": "1f1b-flush", "split": 0},
                {"schedule": "1f1b-flush", "split": 2, "microbatches": 2}):
        with pytest.raises(RuntimeConfigError, match="split="):
            compiled.trainer(optimizer=sgd, executor="reference", progress=False, **bad)
