"""Plans for models no machine here can hold: Llama-70B and Mixtral-8x7B on the meta device.

Run from the repository root:  .venv/bin/python -m bench.big_model_plans
Writes its page benchmarks/big-model-plans.md (``--out FILE`` writes the markdown there instead).

The README's pattern for a model larger than memory: build the Hugging Face architecture from its
config on the meta device (no weights), in bfloat16, and ``fxpipe.compile`` it for a cluster of
H100s (80 GB each) with estimated costs, AdamW (fxpipe keeps float32 masters for bf16 weights:
18 bytes per parameter, ``runtime/replica/state_size.py``), sequences of 4096 tokens, one sequence
per minibatch, planned for ``1f1b-flush`` (the schedule ``auto`` trains almost everywhere) with
``recompute="auto"``. Each model is also planned under PipeDream's rule (a stashed weight version
per minibatch in flight), which is what every plan was priced with before plans followed their
schedule. Tracing and costing 80 Llama layers takes a few minutes on one core.
"""
from __future__ import annotations

import argparse
import time

import torch

from bench._report import publish

SECTION = "big-model-plans"
SEQ, MEMORY = 4096, "80GB"


def _adamw(params):
    return torch.optim.AdamW(params, lr=3e-4, weight_decay=0.1)


def models() -> list[tuple[str, object, int]]:
    """(name, config, workers): the configurations of the published checkpoints."""
    import transformers

    llama = transformers.LlamaConfig(
        hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
        num_key_value_heads=8, vocab_size=128256, max_position_embeddings=SEQ)
    mixtral = transformers.MixtralConfig(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=32000, num_local_experts=8, num_experts_per_tok=2,
        max_position_embeddings=SEQ)
    for cfg in (llama, mixtral):
        cfg.use_cache = False
    return [("Llama-70B", llama, 64), ("Mixtral-8x7B", mixtral, 16)]


def plan_one(name: str, cfg: object, workers: int) -> str:
    import transformers

    import fxpipe
    from fxpipe.api import choose_plan
    from fxpipe.errors import InfeasiblePlanError
    from fxpipe.runtime.replica.state_size import state_factor
    from fxpipe.units import format_bytes

    cls = {"LlamaConfig": transformers.LlamaForCausalLM,
           "MixtralConfig": transformers.MixtralForCausalLM}[type(cfg).__name__]
    with torch.device("meta"):
        model = cls(cfg).to(torch.bfloat16)
    ids = torch.zeros(1, SEQ, dtype=torch.long, device="meta")
    count = sum(p.numel() for p in model.parameters())
    cluster = fxpipe.Cluster(workers=workers, device="H100", memory=MEMORY)
    t0 = time.perf_counter()
    try:
        compiled = fxpipe.compile(model, cluster, example_inputs={"input_ids": ids,
                                                                  "labels": ids},
                                  optimizer=_adamw, schedule="1f1b-flush", recompute="auto")
    except InfeasiblePlanError as err:  # the cap held against the walked peak refuses it
        return "\n".join([
            f"### {name} on {workers} x H100 ({MEMORY} each)", "",
            f"{count / 1e9:.2f}B parameters in bfloat16 ({format_bytes(2 * count)}); refused "
            f"after {time.perf_counter() - t0:.0f} s:", "", "```", err.message, "```", ""]) + "\n"
    took = time.perf_counter() - t0
    plan = compiled.plan
    factor = state_factor(list(model.parameters()), _adamw)
    lines = [f"### {name} on {workers} x H100 ({MEMORY} each)", "",
             f"{count / 1e9:.2f}B parameters in bfloat16 ({format_bytes(2 * count)}); state "
             f"{2 + factor:g} x the parameter bytes ({(2 + factor) * 2:g} bytes per parameter); "
             f"compiled in {took:.0f} s (traced with {compiled.tracer}).", "",
             "```", compiled.summary(), "```", ""]
    biggest = max(sp.memory_bytes for sp in plan.stages)
    lines.append(f"Largest stage: {format_bytes(biggest)} of {MEMORY}; "
                 f"{sum(plan.recompute)} of {len(plan.stages)} stages recompute.")
    lines.append(made_again_line(compiled.profile, plan))
    lines += sharded_section(compiled, cluster, model)
    for rc in ("never", "auto"):
        try:
            pd = choose_plan(compiled.profile, cluster, schedule="pipedream", recompute=rc,
                             optimizer_state_factor=factor)
            got = (f"a plan of {len(pd.stages)} stages, largest "
                   f"{format_bytes(max(sp.memory_bytes for sp in pd.stages))}")
        except InfeasiblePlanError as err:
            got = err.message
        lines.append(f"- Under PipeDream's rule (recompute={rc!r}): {got}.")
    return "\n".join(lines) + "\n"


def sharded_section(compiled, cluster, model) -> list[str]:
    """The same profile planned by the planner alone (``choose="planner"``: its analytic optimum
    for 1f1b-flush, fitted to the cap by the walked peaks), without and with ``shard="auto"``
    (each replicated stage may split its optimizer state over its replicas, ZeRO-1): how
    sharding changes the plan. Not chosen by simulation: for Llama-70B that takes over an hour
    on this machine with sharding allowed (every candidate priced both ways)."""
    from fxpipe.api import choose_fitted_plan
    from fxpipe.errors import InfeasiblePlanError
    from fxpipe.runtime.replica.state_size import state_parts, temporaries_for
    from fxpipe.units import format_bytes, format_seconds

    factor, split = state_parts(list(model.parameters()), _adamw)
    temporaries = temporaries_for(model.parameters(), _adamw, "H100")

    def gist(p) -> str:
        biggest = max(sp.peak_bytes or sp.memory_bytes for sp in p.stages)
        return (f"{len(p.stages)} stages on {p.workers_used} workers, replicas "
                f"{'-'.join(map(str, p.replicas))}, {sum(p.recompute)} recomputing, largest peak "
                f"{format_bytes(biggest)}, {format_seconds(p.time_per_minibatch)} per minibatch "
                "(the planner's bottleneck)")

    plans, out = {}, []
    for shard in ("never", "auto"):
        t0 = time.perf_counter()
        try:
            plans[shard] = choose_fitted_plan(
                compiled.profile, cluster, schedule="1f1b-flush", recompute="auto",
                optimizer_state_factor=factor, sharded_state=split, shard=shard,
                temporaries=temporaries, choose="planner")
            got = gist(plans[shard])
        except InfeasiblePlanError as err:
            got = err.message
        out.append(f"- `shard={shard!r}` (planned in {time.perf_counter() - t0:.0f} s): {got}.")
    head = ["", f"#### Sharding the optimizer state (`shard=\"auto\"`)", "",
            "The same profile planned by the planner alone (its analytic optimum for "
            "1f1b-flush, fitted to the cap by the walked peaks; not chosen by simulation), "
            f"without and with sharding allowed. Of the {factor:g} bytes of state per parameter "
            f"byte beyond weights and gradients, {split:g} are AdamW's moments, which a sharded "
            "replica keeps 1/r of (the float32 masters stay whole).", ""]
    sh = plans.get("auto")
    tail = []
    if sh is not None and sh.shard is not None:
        tail = ["", "The sharded plan:", "", "```", sh.summary(), "```"]
    elif sh is not None:
        tail = ["", "The planner keeps the optimizer state whole: no sharded plan is faster."]
    return head + out + tail + [""]


def made_again_line(profile, plan) -> str:
    """What the stages make again from the model's inputs instead of receiving it (the
    attention mask and rotary tables: fxpipe.passes.made_here), and what that costs them."""
    from fxpipe.passes.made_here import made_here_in
    from fxpipe.passes.overhead_pricing import made_again_s
    from fxpipe.units import format_bytes, format_seconds

    made = made_here_in(profile)
    index = {n.name: i for i, n in enumerate(profile.nodes)}
    bounds = [index[sp.nodes[0]] for sp in plan.stages] + [len(profile.nodes)]
    again = made_again_s(profile, bounds)
    read_later = {i for sp in plan.stages[1:] for name in sp.nodes
                  for i in profile.nodes[index[name]].inputs
                  if i in made and index[i] < index[sp.nodes[0]]}
    worst = max(range(len(again)), key=again.__getitem__)
    spared = sum(profile.nodes[index[v]].activation_bytes for v in read_later)
    share = again[worst] / plan.stages[worst].compute_s if plan.stages[worst].compute_s else 0.0
    return (f"- Made again on each stage that reads them (`fxpipe.passes.made_here`): "
            f"{len(made)} values from the inputs alone; later stages read {len(read_later)} of "
            f"them ({format_bytes(spared)} per minibatch, which each would otherwise receive), "
            f"at most "
            f"{format_seconds(again[worst])} of forward per minibatch on a stage "
            f"({100 * share:.2f}% of stage {worst}'s compute).")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None, help="write the markdown here instead of the page")
    ap.add_argument("--only", default=None, help="one model by name (e.g. Llama-70B)")
    args = ap.parse_args()
    parts = ["## Plans for models larger than memory (meta device)", "",
             "`.venv/bin/python -m bench.big_model_plans` (estimated costs for H100, no weights: "
             "the models are built on the meta device)", ""]
    for name, cfg, workers in models():
        if args.only in (None, name):
            parts.append(plan_one(name, cfg, workers))
    publish(SECTION, "\n".join(parts), args.out)


if __name__ == "__main__":
    main()
