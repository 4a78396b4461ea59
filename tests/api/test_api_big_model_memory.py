"""The README's pattern for a model larger than memory, checked by hand on a small config: a
bfloat16 Llama built on the meta device, compiled with AdamW for ``1f1b-flush`` with
``recompute="auto"`` under a cap; every stage's memory is the arithmetic of its schedule's rule
(benchmarks/big-model-plans.md runs the same on Llama-70B and Mixtral-8x7B)."""
from __future__ import annotations

import math
import re

import pytest
import torch

import fxpipe
from fxpipe.errors import InfeasiblePlanError
from fxpipe.passes import partition

pytestmark = [pytest.mark.slow]

transformers = pytest.importorskip("transformers")


def adamw(ps):
    return torch.optim.AdamW(ps, lr=1e-3)


def tiny_llama() -> torch.nn.Module:
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                   max_position_embeddings=512)
    cfg.use_cache = False
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)


def test_meta_llama_plan_is_the_rule_by_hand() -> None:
    model = tiny_llama()
    # parameters by hand: embeddings 256 x 64; per layer q, o 64 x 64, k, v 64 x 32 (2 of 4 heads
    # of 16), gate, up, down 64 x 128, two norms of 64; final norm 64; lm_head 256 x 64
    layer = 2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128 + 2 * 64
    count = 256 * 64 + 4 * layer + 64 + 256 * 64
    assert count == 180_800 == sum(p.numel() for p in model.parameters())
    ids = torch.zeros(1, 512, dtype=torch.long, device="meta")
    kw = dict(example_inputs={"input_ids": ids, "labels": ids}, optimizer=adamw,
              schedule="1f1b-flush", microbatches=2, recompute="auto", stages=4, straight=True)
    probe = fxpipe.compile(model, fxpipe.Cluster(workers=4, device="H100"), **kw)
    assert probe.plan.recompute == [False] * 4  # no cap: recomputation only costs time

    def least(recompute: str) -> float:  # the smallest cap with a plan, from the refusal
        with pytest.raises(InfeasiblePlanError) as ei:
            partition(probe.profile, fxpipe.Cluster(workers=4, device="H100", memory=1.0),
                      stages=4, straight=True, recompute=recompute, optimizer_state_factor=7.0,
                      memory_rule=probe.plan.memory_rule)
        return float(re.search(r"\((\d+) bytes\)", ei.value.message).group(1))

    assert least("auto") < least("never")
    # compile holds the cap against each stage's peak walked through the schedule (the rule's
    # memory plus buffers, working sets and AdamW's temporaries, runtime/pricing/peak_fit.py): a cap between
    # the recomputing plan's peak and the plain one's, so only recomputation fits
    always = fxpipe.compile(model, fxpipe.Cluster(workers=4, device="H100"),
                            **{**kw, "recompute": "always"})
    peak_never = max(sp.peak_bytes for sp in probe.plan.stages)
    peak_always = max(sp.peak_bytes for sp in always.plan.stages)
    assert peak_always < peak_never
    assert all(sp.peak_bytes > sp.memory_bytes for sp in probe.plan.stages)
    cap = (peak_always + peak_never) / 2
    compiled = fxpipe.compile(model, fxpipe.Cluster(workers=4, device="H100", memory=cap), **kw)
    plan = compiled.plan
    assert any(plan.recompute)
    assert plan.memory_rule.label() == "1f1b-flush (m=2)"
    assert sum(sp.parameter_bytes for sp in plan.stages) == 2 * count  # bf16
    for s, sp in enumerate(plan.stages):
        # bf16 weight 2 + fp32 gradient 4 + fp32 master 4 + AdamW's two fp32 moments 8 = 18
        assert sp.state_bytes == 18 * sp.parameter_bytes / 2
        held = min(4 - s, 2)  # 1F1B with a flush every 2 microbatches: min(window, m) sets
        assert sp.in_flight == 4 - s
        if sp.recompute:  # its inputs per set held, one full set while it recomputes
            want = sp.state_bytes + held * sp.kept_input_bytes + sp.activation_bytes
        else:
            want = sp.state_bytes + held * sp.activation_bytes
        assert math.isclose(sp.memory_bytes, want, rel_tol=1e-12), s
        assert sp.memory_bytes <= sp.peak_bytes <= cap
