"""Any model a user brings: 16 third-party architectures at 2, 3 and 4 stages.

For each: compile with measured and with estimated costs; the stages' outputs and every
gradient equal the model's; export + load gives the same outputs; state dicts round-trip
strictly both ways and through the trainer; four training steps (two updates) through the
keyword/labels path equal the same steps of plain PyTorch.
"""
from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils import _pytree as pytree

pytest.importorskip("transformers")
from transformers.utils import logging as hf_logging  # noqa: E402

import fxpipe  # noqa: E402
from fxpipe.codegen import run_stages  # noqa: E402

from third_party import CASES, Case  # noqa: E402

pytestmark = [pytest.mark.slow]

hf_logging.set_verbosity_error()
LR, MICRO, STEPS = 0.1, 2, 4


def _without_kv_cache(model: torch.nn.Module) -> torch.nn.Module:
    """The reference as fxpipe traces it: no KV cache in the output (training has no use for
    one; fxpipe turns it off in every config, as here)."""
    for m in model.modules():
        if getattr(getattr(m, "config", None), "use_cache", False):
            m.config.use_cache = False
    return model


def _call(model: Any, inputs: Any) -> Any:
    return model(**inputs) if isinstance(inputs, dict) else model(*inputs)


def _loss(case: Case, out: Any, target: Any) -> torch.Tensor:
    return out["loss"] if case.loss_fn is None else case.loss_fn(out, target)


def _assert_same_output(got: Any, want: Any) -> None:
    g, w = pytree.tree_leaves(got), pytree.tree_leaves(want)
    assert len(g) == len(w) and type(got) is type(want)
    for a, b in zip(g, w):
        if isinstance(b, torch.Tensor):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        else:
            assert a == b


def _compile(case: Case, stages: int, device: str | None) -> Any:
    inputs, _ = case.batch(0)
    return fxpipe.compile(case.model, fxpipe.Cluster(workers=stages, device=device),
                          example_inputs=inputs, loss_fn=case.loss_fn, stages=stages,
                          straight=True, repeats=1)


@pytest.mark.parametrize("stages", [2, 3, 4])
@pytest.mark.parametrize("arch", sorted(CASES))
def test_third_party_model(arch: str, stages: int, tmp_path: Path) -> None:
    case = CASES[arch]()
    ref = _without_kv_cache(copy.deepcopy(case.model))
    estimated = _compile(case, stages, "V100")
    compiled = _compile(case, stages, None)
    for c in (estimated, compiled):
        assert len(c.plan.stages) == stages and c.plan.replicas == [1] * stages
    inputs, target = case.batch(1)

    # outputs and every gradient, in this process
    out, want = _call(compiled, inputs), _call(ref, inputs)
    _assert_same_output(out, want)
    _loss(case, out, target).backward()
    _loss(case, want, target).backward()
    ref_params = dict(ref.named_parameters())
    for name, p in case.model.named_parameters():
        r = ref_params[name]
        assert (p.grad is None) == (r.grad is None), name
        if r.grad is not None:
            torch.testing.assert_close(p.grad, r.grad, rtol=1e-5, atol=1e-6, msg=name)
    case.model.zero_grad(set_to_none=True)

    # export to readable code, load in a "fresh" set of stages
    compiled.export(tmp_path / "stages")
    _, loaded = fxpipe.load(tmp_path / "stages")
    args, kwargs = (((), inputs) if isinstance(inputs, dict) else (inputs, {}))
    with torch.no_grad():
        _assert_same_output(run_stages(loaded, args, kwargs), _call(ref, inputs))

    # strict state dicts, both ways, with the model's own keys
    assert list(compiled.state_dict()) == list(ref.state_dict())
    compiled.load_state_dict(ref.state_dict())
    fresh = copy.deepcopy(ref)
    fresh.load_state_dict(compiled.state_dict())  # strict

    # training: two updates of two microbatches each, against plain PyTorch
    batches = [case.batch(10 + k) for k in range(STEPS)]
    trainer = compiled.trainer(optimizer=lambda ps: torch.optim.SGD(ps, lr=LR, momentum=0.9),
                               schedule="1f1b-flush", microbatches=MICRO, executor="reference",
                               progress=False)
    history = trainer.fit(batches, epochs=1)
    opt = torch.optim.SGD(ref.parameters(), lr=LR, momentum=0.9)
    losses = []
    for k in range(0, STEPS, MICRO):
        opt.zero_grad()
        for x, y in batches[k:k + MICRO]:
            loss = _loss(case, _call(ref, x), y)
            losses.append(loss.item())
            (loss / MICRO).backward()
        opt.step()
    assert history[0]["loss"] == pytest.approx(sum(losses) / STEPS, rel=1e-5)
    trained = trainer.state_dict()
    assert list(trained) == list(ref.state_dict())
    for key, value in ref.state_dict().items():
        torch.testing.assert_close(trained[key], value, rtol=1e-4, atol=1e-6, msg=key)
    fresh.load_state_dict(trained)  # strict: tied aliases and buffers included
