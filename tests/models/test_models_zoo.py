"""The model zoo: every mini model builds deterministically, traces, and trains through fx."""
from __future__ import annotations

import pytest
import torch

from fxpipe.errors import ConfigError
from fxpipe.models import ModelSpec, get, names
from fxpipe.tracing import trace

ALL = names(include_test_models=True)


def test_names() -> None:
    assert names() == ["alexnet", "gpt", "inception", "resnet50", "s2vt", "vgg16"]
    assert "reuse" in ALL


@pytest.mark.parametrize("name", ALL)
def test_mini_traces_and_matches(name: str) -> None:
    spec = get(name)
    assert isinstance(spec, ModelSpec) and spec.size == "mini"
    model, inputs = spec.model, spec.example_inputs
    assert isinstance(inputs, tuple) and inputs[0].shape[0] == spec.batch_size
    before = {k: v.clone() for k, v in model.state_dict().items()}
    traced = trace(model, inputs)
    assert traced.method == "symbolic_trace"
    for k, v in model.state_dict().items():  # BatchNorm stats untouched by tracing
        assert torch.equal(v, before[k]), k
    mine = dict(model.named_parameters())
    theirs = dict(traced.gm.named_parameters())
    assert list(theirs) == list(mine)
    assert all(theirs[k] is mine[k] for k in mine)
    for n in traced.gm.graph.nodes:
        if n.op != "output":
            assert {"shape", "dtype", "bytes", "is_tensor", "sendable"} <= set(n.meta["fxpipe"])
    torch.manual_seed(1)
    ref = model(*inputs)
    torch.manual_seed(1)
    out = traced.gm(*inputs)
    torch.testing.assert_close(out, ref)
    batch, target = spec.make_batch(3, seed=5)
    loss = spec.loss_fn(traced.gm(*batch), target)
    assert loss.ndim == 0 and torch.isfinite(loss)
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())


def test_deterministic_and_rng_untouched() -> None:
    torch.manual_seed(123)
    expected = torch.rand(1)
    torch.manual_seed(123)
    a, b = get("resnet50"), get("resnet50")
    assert torch.equal(torch.rand(1), expected)  # get() does not consume the caller's RNG
    for (ka, pa), (kb, pb) in zip(a.model.state_dict().items(), b.model.state_dict().items()):
        assert ka == kb and torch.equal(pa, pb)
    assert torch.equal(a.example_inputs[0], b.example_inputs[0])
    x1, y1 = a.make_batch(2, seed=3)
    x2, y2 = b.make_batch(2, seed=3)
    assert torch.equal(x1[0], x2[0]) and torch.equal(y1, y2)


def test_gpt_tied_and_reuse_shared() -> None:
    gpt = get("gpt").model
    assert gpt.lm_head.weight is gpt.wte.weight
    traced = trace(gpt, get("gpt").example_inputs)
    assert traced.gm.get_submodule("lm_head").weight is gpt.wte.weight
    reuse = get("reuse")
    gm = trace(reuse.model, reuse.example_inputs).gm
    calls = [n.target for n in gm.graph.nodes if n.op == "call_module"]
    assert calls.count("shared") == 2


def test_s2vt_lstm_getitems() -> None:
    spec = get("s2vt", batch_size=2)
    gm = trace(spec.model, spec.example_inputs).gm
    enc = next(n for n in gm.graph.nodes if n.target == "encoder")
    assert not enc.meta["fxpipe"]["sendable"]  # (out, (h, c)): never cut while live
    assert all(u.target.__name__ == "getitem" for u in enc.users)
    assert spec.model(*spec.example_inputs).shape == (2, 6, 50)


def test_batch_size_and_errors() -> None:
    assert get("vgg16", batch_size=7).example_inputs[0].shape == (7, 3, 32, 32)
    with pytest.raises(ConfigError, match="vgg16"):
        get("vgg17")
    with pytest.raises(ConfigError, match="mini"):
        get("vgg16", size="huge")
    with pytest.raises(ConfigError):
        get("vgg16", batch_size=0)


def test_full_sizes_match_the_papers() -> None:
    """Build on the meta device: checks the architecture without allocating 138M floats."""
    from fxpipe.models import _REGISTRY
    expected = {"vgg16": 138.36e6, "alexnet": 61.10e6, "resnet50": 25.56e6,
                "inception": 23.83e6, "gpt": 124.44e6}
    for name, count in expected.items():
        with torch.device("meta"):
            model = _REGISTRY[name]["full"][0]()
        got = sum(p.numel() for p in model.parameters())
        assert abs(got - count) / count < 0.01, (name, got)
