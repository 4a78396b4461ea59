"""Hugging Face models from the shell (hf:Class[:key=value]), on the meta device, the tracer
choice, and the module-level drawing of large graphs."""
from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

import fxpipe  # noqa: E402
from fxpipe import models  # noqa: E402
from fxpipe.cli import main  # noqa: E402
from fxpipe.codegen.visualize import group_ops, plan_graph  # noqa: E402
from fxpipe.errors import ConfigError, TracingError  # noqa: E402
from fxpipe.models import hf  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
LLAMA = ("hf:LlamaForCausalLM:hidden_size=32,intermediate_size=64,num_hidden_layers=4,"
         "num_attention_heads=4,num_key_value_heads=2,vocab_size=64,max_position_embeddings=64")


def test_hf_spec_parses_overrides_of_every_type() -> None:
    assert hf.parse("hf:LlamaForCausalLM:hidden_size=64,rms_norm_eps=1e-5,tie_word_embeddings="
                    "true,rope_scaling=none,hidden_act=silu") == (
        "LlamaForCausalLM", {"hidden_size": 64, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
                             "rope_scaling": None, "hidden_act": "silu"})
    assert hf.parse("hf:BertModel") == ("BertModel", {})


@pytest.mark.parametrize("spec,match", [
    ("hf:NoSuchModelForCausalLM", "transformers has no model class 'NoSuchModelForCausalLM'"),
    ("hf:LlamaForCausalLM:hidden_size", "bad config override 'hidden_size'"),
    ("hf:LlamaForCausalLM:hidden_size=64,2x=1", "bad config override '2x=1'"),
])
def test_hf_spec_errors_name_the_offending_text(spec: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        models.resolve(spec)


@pytest.mark.parametrize("spec,inputs,labels", [
    (LLAMA, {"input_ids": (3, 16), "labels": (3, 16)}, "copy"),
    ("hf:BertForSequenceClassification:hidden_size=32,num_hidden_layers=1,num_attention_heads=2,"
     "intermediate_size=64,vocab_size=64,num_labels=5", {"input_ids": (3, 16), "labels": (3,)},
     "classes"),
    ("hf:T5ForConditionalGeneration:d_model=32,d_kv=8,d_ff=64,num_layers=1,num_heads=2,"
     "vocab_size=64", {"input_ids": (3, 16), "labels": (3, 8)}, "tokens"),
    ("hf:ViTForImageClassification:image_size=16,patch_size=4,hidden_size=32,num_hidden_layers=1,"
     "num_attention_heads=2,intermediate_size=64,num_labels=3",
     {"pixel_values": (3, 3, 16, 16), "labels": (3,)}, "classes"),
])
def test_hf_spec_makes_the_batches_its_head_trains_on(spec: str, inputs: dict, labels: str) -> None:
    s = models.resolve(spec, batch_size=3, seq_len=16)
    assert s.loss_fn is None and s.size == "custom"
    batch, target = s.make_batch(3, seed=1)
    assert target is None
    assert {k: tuple(v.shape) for k, v in batch.items()} == inputs
    if labels == "copy":
        assert torch.equal(batch["labels"], batch["input_ids"])
    if labels == "classes":
        assert int(batch["labels"].max()) < s.model.config.num_labels
    out = s.model(**batch)
    assert out.loss is not None and out.loss.dim() == 0  # the head computes its own loss


@pytest.mark.slow
def test_plan_hf_model_on_the_meta_device_from_the_shell(tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]
                                                         ) -> None:
    svg = tmp_path / "llama.svg"
    rc = main(["plan", LLAMA, "--meta", "--device", "A100", "--workers", "4", "--stages", "4",
               "--seq-len", "32", "--batch-size", "2", "--svg", str(svg)])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "with export" in out
    rows = [line.split() for line in out.splitlines() if line[:5].strip().isdigit()]
    assert [r[0] for r in rows] == ["0", "1", "2", "3"]
    assert rows[0][1].startswith("model.embed_tokens") and rows[-1][1].endswith("lm_head")
    assert svg.read_text().lstrip().startswith(("<?xml", "<svg"))


@pytest.mark.slow
def test_a_meta_model_plans_but_cannot_run_train_or_export(tmp_path: Path) -> None:
    spec = models.resolve(LLAMA, meta=True, batch_size=2, seq_len=8)
    assert all(p.device.type == "meta" for p in spec.model.parameters())
    with pytest.raises(ConfigError, match="meta device.*cannot be measured"):
        fxpipe.compile(spec.model, fxpipe.Cluster(workers=2), example_inputs=spec.example_inputs)
    compiled = fxpipe.compile(spec.model, fxpipe.Cluster(workers=2, device="A100"),
                              example_inputs=spec.example_inputs, stages=2)
    assert compiled.plan.replicas == [1, 1] and compiled.tracer == "export"
    for what, call in (("run the stages", lambda: compiled(**spec.example_inputs)),
                       ("export", lambda: compiled.export(tmp_path / "x")),
                       ("train", lambda: compiled.trainer(optimizer=torch.optim.SGD))):
        with pytest.raises(ConfigError, match=f"cannot {what}.*meta device"):
            call()
    assert not (tmp_path / "x").exists()


@pytest.mark.slow
def test_tracer_choice_is_the_users_and_reported() -> None:
    spec = models.get("gpt")
    auto = fxpipe.compile(spec.model, 2, example_inputs=spec.example_inputs, repeats=1)
    forced = fxpipe.compile(spec.model, 2, example_inputs=spec.example_inputs, repeats=1,
                            tracer="export")
    assert (auto.tracer, forced.tracer) == ("symbolic_trace", "export")
    assert "traced_with=export" in repr(forced)
    x = spec.example_inputs[0]
    torch.testing.assert_close(forced(x), spec.model(x))
    hf_spec = models.resolve(LLAMA, batch_size=2, seq_len=8)
    with pytest.raises(TracingError, match="symbolic_trace"):
        fxpipe.compile(hf_spec.model, 2, example_inputs=hf_spec.example_inputs,
                       tracer="symbolic_trace")
    with pytest.raises(ConfigError, match="unknown tracer='fx'"):
        fxpipe.compile(spec.model, 2, example_inputs=spec.example_inputs, tracer="fx")


@pytest.mark.slow
def test_a_model_computing_its_own_loss_is_marked_for_the_memory_walk() -> None:
    """An HF model given labels trains on its own loss: the profile says so, and the walk then
    prices no loss outside the graph on the last stage (runtime/pricing/memory_walk.py); a
    model trained with a loss_fn is not marked."""
    from fxpipe.runtime.pricing.memory_walk import LOSS_IN_MODEL, stage_bytes

    hf_spec = models.resolve("hf:GPT2LMHeadModel:n_layer=2,n_embd=32,n_head=2,vocab_size=512,"
                             "n_positions=16", batch_size=2, seq_len=8)
    own = fxpipe.compile(hf_spec.model, 2, example_inputs=hf_spec.example_inputs, repeats=1,
                         stages=2, straight=True)
    assert own.profile.meta.get(LOSS_IN_MODEL) is True
    spec = models.get("gpt")
    outside = fxpipe.compile(spec.model, 2, example_inputs=spec.example_inputs, repeats=1,
                             loss_fn=spec.loss_fn)
    assert LOSS_IN_MODEL not in outside.profile.meta
    last = stage_bytes(own.plan, own.profile, "1f1b-flush", [2, 1])[-1]
    plain = dataclasses.replace(own.profile, meta={})  # as if a loss outside kept a copy
    assert stage_bytes(own.plan, plain, "1f1b-flush", [2, 1])[-1].backward > last.backward


@pytest.mark.slow
def test_large_graphs_are_drawn_one_box_per_module() -> None:
    spec = models.resolve(LLAMA, batch_size=2, seq_len=8)
    compiled = fxpipe.compile(spec.model, fxpipe.Cluster(workers=2, device="V100"),
                              example_inputs=spec.example_inputs, stages=2)
    ops = sum(1 for st in compiled.stage_specs for n in st.gm.graph.nodes
              if n.op.startswith("call_"))
    boxes = group_ops(compiled.stage_specs, max_detail=10, max_boxes=20)
    assert len(boxes) == ops and len(set(boxes.values())) <= 20
    assert len(set(boxes.values())) >= 6  # embed, 4 layers, norm/head: not one blob
    # one box per layer: "model.layers.2" holds only that layer's operations
    layer2 = {b for b in boxes.values() if "model.layers.2" in b}
    assert layer2 and all(b.split("__")[1].startswith("model.layers.2") for b in layer2)
    assert group_ops(compiled.stage_specs, max_detail=ops) == {
        n.name: n.name for st in compiled.stage_specs for n in st.gm.graph.nodes
        if n.op.startswith("call_")}  # small graphs keep every operation
    source = plan_graph(compiled.stage_specs).source
    assert "ops" in source and "model.layers.0" in source


@pytest.mark.multiprocess
def test_train_hf_model_from_the_shell() -> None:
    """A Hugging Face model trained through a 2-stage pipeline from the shell. ``--stages 2``:
    planned for 1f1b-flush (the schedule named), this tiny model simulates faster as data
    parallelism, which the planner would otherwise pick."""
    res = subprocess.run(
        [sys.executable, "-m", "fxpipe.cli", "train",
         "hf:GPT2LMHeadModel:n_layer=2,n_embd=32,n_head=2,vocab_size=64,n_positions=32",
         "--data", "synthetic", "--nproc", "2", "--batch-size", "4", "--seq-len", "16",
         "--num-batches", "8", "--schedule", "1f1b-flush", "--stages", "2", "--no-progress"],
        capture_output=True, text=True, timeout=240, cwd=ROOT,
        env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert "plan: replicas [1, 1], schedule 1f1b-flush" in res.stdout
    assert "epoch 1: loss 4." in res.stdout  # ln(64) = 4.16: a fresh 64-token LM


@pytest.mark.slow
def test_an_exported_graph_takes_any_batch_and_refuses_other_lengths_with_a_hint() -> None:
    """torch.export leaves the batch dimension free (tracing.batchdims found it), so a pipeline
    can cut minibatches; another sequence length is refused, saying what fxpipe fixed."""
    spec = models.resolve(LLAMA, batch_size=2, seq_len=8)
    compiled = fxpipe.compile(spec.model, 2, example_inputs=spec.example_inputs, repeats=1)
    assert compiled.tracer == "export"
    for n in (1, 3):
        ids = torch.randint(0, 64, (n, 8))
        torch.testing.assert_close(compiled(input_ids=ids, labels=ids)["loss"],
                                   spec.model(input_ids=ids, labels=ids).loss)
    ids = torch.randint(0, 64, (2, 9))
    with pytest.raises(fxpipe.InputMismatchError,
                       match=r"'input_ids' has shape \(2, 9\).*traced with torch.export for "
                             r"shape \('\*', 8\): fxpipe exported it with dimension\(s\) \[0\] "
                             r"free"):
        compiled(input_ids=ids, labels=ids)


@pytest.mark.multiprocess
def test_train_hf_model_from_the_shell_without_a_schedule_equals_plain(tmp_path: Path) -> None:
    """`fxpipe train hf:... --nproc 2` names no schedule: auto trains 1f1b-flush with each
    minibatch cut in 2, and the weights equal plain PyTorch SGD on the same batches."""
    from fxpipe.runtime.training.data import synthetic_loader

    arch = "hf:LlamaForCausalLM:hidden_size=32,intermediate_size=64,num_hidden_layers=2," \
           "num_attention_heads=4,num_key_value_heads=2,vocab_size=64"
    res = subprocess.run(
        [sys.executable, "-m", "fxpipe.cli", "train", arch, "--data", "synthetic", "--nproc", "2",
         "--batch-size", "5", "--seq-len", "8", "--num-batches", "6", "--eval-batches", "1",
         "--stages", "2", "--straight", "--lr", "0.2", "--no-progress",
         "--save", str(tmp_path / "w.pt")],
        capture_output=True, text=True, timeout=240, cwd=ROOT,
        env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert "schedule: 1f1b-flush" in res.stdout and "5 samples -> [3, 2]" in res.stdout
    model = hf.build(arch)  # the same architecture and seed; trained below in plain PyTorch
    batches = synthetic_loader(hf.batch_maker(model, 8), 5, 6, 0)  # the CLI's data
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    for x, _ in batches:
        opt.zero_grad()
        model(**x).loss.backward()
        opt.step()
    got = torch.load(tmp_path / "w.pt", weights_only=True)
    for k, v in model.state_dict().items():
        torch.testing.assert_close(got[k], v, rtol=2e-5, atol=2e-5)


