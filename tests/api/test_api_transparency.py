"""Transparency of fxpipe.compile: the stages composed equal the original model, outputs and
gradients matched by parameter name, for every zoo model and two Hugging Face models, at 1, 2, 4
and 8 stages."""
from __future__ import annotations

import copy

import pytest
import torch

import fxpipe
from fxpipe import models

STAGES = (1, 2, 4, 8)


def _grads_by_name(named) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in named if p.grad is not None}


def _check_transparent(model: torch.nn.Module, inputs: tuple, loss_of, stages: int) -> fxpipe.CompiledModel:
    torch.manual_seed(0)
    reference = copy.deepcopy(model)
    expected = reference(*inputs)
    loss_of(expected).backward()
    want = _grads_by_name(reference.named_parameters())

    compiled = fxpipe.compile(model, fxpipe.Cluster(workers=8), example_inputs=inputs,
                              stages=stages, repeats=1)
    assert len(compiled.stages) == stages
    got_out = compiled(*inputs)
    torch.testing.assert_close(loss_of(got_out), loss_of(expected), rtol=1e-5, atol=1e-6)
    model.zero_grad(set_to_none=True)
    loss_of(got_out).backward()
    got = _grads_by_name(compiled.named_parameters())
    # the compiled model holds every parameter of the model, under the model's own name (tied
    # ones once), and each got the same gradient
    assert sorted(n for n, _ in compiled.named_parameters()) == sorted(
        n for n, _ in model.named_parameters())
    assert set(got) == set(want)
    for name, g in got.items():
        torch.testing.assert_close(g, want[name], rtol=1e-4, atol=1e-6, msg=f"grad of {name}")
    return compiled


@pytest.mark.slow
@pytest.mark.parametrize("stages", STAGES)
@pytest.mark.parametrize("name", models.names(include_test_models=True))
def test_zoo_model_transparent(name: str, stages: int) -> None:
    spec = models.get(name, size="mini")
    spec.model.eval()  # dropout off: the comparison is deterministic
    target = spec.make_batch(spec.batch_size, seed=1)[1]
    _check_transparent(spec.model, spec.example_inputs, lambda out: spec.loss_fn(out, target), stages)


def _hf_gpt2():
    import transformers  # a dev dependency: a failed import must fail, not skip
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=32,
                                  use_cache=False)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    ids = torch.randint(0, 100, (2, 16))
    return model, (ids,), lambda out: out.logits.float().pow(2).mean()


def _hf_bert():
    import transformers  # a dev dependency: a failed import must fail, not skip
    cfg = transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2,
                                  num_attention_heads=2, intermediate_size=64,
                                  max_position_embeddings=32)
    torch.manual_seed(0)
    model = transformers.BertModel(cfg).eval()
    ids = torch.randint(0, 100, (2, 16))
    return model, (ids,), lambda out: out.last_hidden_state.pow(2).mean() + out.pooler_output.sum()


@pytest.mark.slow
@pytest.mark.parametrize("stages", STAGES)
@pytest.mark.parametrize("make", [_hf_gpt2, _hf_bert], ids=["gpt2", "bert"])
def test_hugging_face_transparent(make, stages: int) -> None:
    model, inputs, loss_of = make()
    compiled = _check_transparent(model, inputs, loss_of, stages)
    assert compiled.traced.method == "export"


@pytest.mark.slow
def test_tied_embeddings_split_across_stages_stay_tied() -> None:
    spec = models.get("gpt", size="mini")
    model = spec.model.eval()
    compiled = fxpipe.compile(model, fxpipe.Cluster(workers=4), example_inputs=spec.example_inputs,
                              stages=4, repeats=1)
    users = {i for i, gm in enumerate(compiled.stages)
             for _, p in gm.named_parameters() if p is model.lm_head.weight}
    assert len(users) == 2, "wte and lm_head (one Parameter) land in different stages"
    assert compiled.plan.shared_parameters, "the plan must say a parameter is shared across stages"
    # state_dict round trip into the original model, tied names included
    sd = compiled.state_dict()
    assert set(sd) == set(model.state_dict())
    fresh = models.get("gpt", size="mini").model
    with torch.no_grad():
        for p in fresh.parameters():
            p.add_(1.0)
    fresh.load_state_dict(sd)
    assert fresh.lm_head.weight is fresh.wte.weight
    torch.testing.assert_close(fresh(*spec.example_inputs), model(*spec.example_inputs))
    compiled.load_state_dict(fresh.state_dict())


def test_layer_reused_at_two_depths_lands_in_two_stages() -> None:
    spec = models.get("reuse", size="mini")
    model = spec.model.eval()
    compiled = fxpipe.compile(model, fxpipe.Cluster(workers=8), example_inputs=spec.example_inputs,
                              stages=8, repeats=1)  # one node per stage
    stages_using = {}
    for i, gm in enumerate(compiled.stages):
        for n, _ in gm.named_parameters():
            stages_using.setdefault(n, set()).add(i)
    assert any(len(s) > 1 for s in stages_using.values())
    assert compiled.plan.shared_parameters
