"""Export-traced graphs follow train() / eval() (tracing/modes.py), checked against the models
themselves: a tiny Hugging Face BERT with dropout (hidden and attention) and a BatchNorm model."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from fxpipe.tracing.trace import trace

transformers = pytest.importorskip("transformers")


def tiny_bert() -> nn.Module:
    cfg = transformers.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2,
                                  num_attention_heads=2, intermediate_size=32,
                                  max_position_embeddings=16, num_labels=3,
                                  hidden_dropout_prob=0.2, attention_probs_dropout_prob=0.2)
    torch.manual_seed(0)
    return transformers.BertForSequenceClassification(cfg)


def logits(out: object) -> torch.Tensor:
    return out.logits if hasattr(out, "logits") else out[0]  # type: ignore[union-attr,index]


def seeded(fn, seed: int = 5) -> torch.Tensor:
    torch.manual_seed(seed)
    with torch.no_grad():
        return logits(fn())


@pytest.mark.parametrize("traced_in", ["train", "eval"])
def test_bert_dropout_follows_the_mode(traced_in: str) -> None:
    model = tiny_bert()
    model.train(traced_in == "train")
    ids = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(1))
    gm = trace(model, (ids,), method="export").gm
    assert gm.training is model.training  # the graph starts in the model's own mode
    gm.eval()
    model.eval()
    torch.testing.assert_close(seeded(lambda: gm(ids)), seeded(lambda: model(ids)))
    assert torch.equal(seeded(lambda: gm(ids), 1), seeded(lambda: gm(ids), 2))  # no dropout
    gm.train()
    model.train()
    a, b = seeded(lambda: gm(ids), 1), seeded(lambda: gm(ids), 2)
    assert not torch.allclose(a, b)  # dropout on, whichever mode it was traced in
    # the same random numbers in the same order as the model itself draws them
    torch.testing.assert_close(seeded(lambda: gm(ids), 3), seeded(lambda: model(ids), 3))


class Norm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.bn, self.drop, self.b = (nn.Linear(4, 6), nn.BatchNorm1d(6),
                                              nn.Dropout(0.5), nn.Linear(6, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.drop(self.bn(self.a(x)).relu()))


def test_export_traced_batch_norm_updates_statistics_in_train_mode_only() -> None:
    model = Norm()
    twin = Norm()  # the same weights, never traced: the oracle
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(2))
    gm = trace(model, (x,), method="export").gm
    assert any(n.op == "call_module" and n.target == "bn" for n in gm.graph.nodes)
    gm.eval()
    twin.eval()
    before = model.bn.running_mean.clone()
    with torch.no_grad():
        torch.testing.assert_close(gm(x), twin(x))
    assert torch.equal(model.bn.running_mean, before)  # eval: statistics untouched
    assert int(model.bn.num_batches_tracked) == 0
    gm.train()
    twin.train()
    torch.manual_seed(4)
    with torch.no_grad():
        got = gm(x)
    torch.manual_seed(4)
    with torch.no_grad():
        want = twin(x)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(model.bn.running_mean, twin.bn.running_mean)
    torch.testing.assert_close(model.bn.running_var, twin.bn.running_var)
    assert int(model.bn.num_batches_tracked) == int(twin.bn.num_batches_tracked) == 1


def test_stages_of_an_export_traced_model_follow_modes_too() -> None:
    """What the runtime uses: the split stages' GraphModules."""
    from fxpipe.codegen.split import placed_nodes, split_graph

    model = Norm()
    x = torch.randn(8, 4)
    gm = trace(model, (x,), method="export").gm
    nodes = placed_nodes(gm)
    stages = split_graph(gm, {n.name: int(i > len(nodes) // 2) for i, n in enumerate(nodes)})
    for st in stages:
        st.gm.eval()
    with torch.no_grad():
        h = stages[0].gm(x)
        out1 = stages[1].gm(*h)
        out2 = stages[1].gm(*stages[0].gm(x))
    assert torch.equal(out1[0], out2[0])
    assert int(model.bn.num_batches_tracked) == 0


def test_stages_with_mode_modules_export_as_code(tmp_path) -> None:
    """export_stages writes the attention-dropout module fxpipe inserted as code too."""
    from fxpipe.codegen import export_stages, load_exported, run_stages
    from fxpipe.codegen.split import placed_nodes, split_graph

    model = tiny_bert()
    ids = torch.randint(0, 50, (2, 8))
    gm = trace(model, (ids,), method="export").gm
    nodes = placed_nodes(gm)
    stages = split_graph(gm, {n.name: int(i > len(nodes) // 2) for i, n in enumerate(nodes)})
    export_stages(stages, tmp_path / "e")
    text = "".join(p.read_text() for p in (tmp_path / "e").glob("stage_*.py"))
    assert "ScaledDotProductAttention(dropout_p=0.2" in text
    _, loaded = load_exported(tmp_path / "e")
    for st in (*stages, *loaded):
        st.gm.eval()
    with torch.no_grad():
        torch.testing.assert_close(logits(run_stages(loaded, (ids,), None)),
                                   logits(run_stages(stages, (ids,), None)))
