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
schedule, and compiled again with ``shard="auto"`` (ZeRO-1 where it makes the plan fit or
faster). Tracing and costing 80 Llama layers takes under a minute; choosing its plan by
simulation on 64 workers, minutes.
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
    def compile_with(shard: str):  # what `fxpipe plan ... --shard SHARD` plans
        return fxpipe.compile(model, cluster, example_inputs={"input_ids": ids, "labels": ids},
                              optimizer=_adamw, schedule="1f1b-flush", recompute="auto",
                              shard=shard)

    t0 = time.perf_counter()
    try:
        compiled = compile_with("never")
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
    biggest = max(sp.peak_bytes or sp.memory_bytes for sp in plan.stages)
    lines.append(f"Largest walked peak: {format_bytes(biggest)} of {MEMORY}; "
                 f"{sum(plan.recompute)} of {len(plan.stages)} stages recompute.")
    lines.append(made_again_line(compiled.profile, plan))
    lines += sharded_section(name, compile_with, plan)
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


def sharded_section(name: str, compile_with, unsharded) -> list[str]:
    """The model compiled again with ``shard="auto"`` (each replicated stage may split its
    optimizer state over its replicas, ZeRO-1; what ``fxpipe plan --shard auto`` plans), and
    how its plan differs from the unsharded one: stages, workers, recomputation, the largest
    walked peak, the time per minibatch."""
    from fxpipe.errors import InfeasiblePlanError
    from fxpipe.units import format_bytes, format_seconds

    def gist(p) -> str:
        biggest = max(sp.peak_bytes or sp.memory_bytes for sp in p.stages)
        return (f"{len(p.stages)} stages on {p.workers_used} workers, "
                f"{sum(r > 1 for r in p.replicas)} replicated, {sum(p.recompute)} recomputing, "
                f"largest peak {format_bytes(biggest)}, {format_seconds(p.time_per_minibatch)} "
                f"per minibatch ({p.time_source})")

    head = ["", f"#### {name} with sharding allowed (`shard=\"auto\"`)", ""]
    t0 = time.perf_counter()
    try:
        compiled = compile_with("auto")
    except InfeasiblePlanError as err:
        return head + [f"Refused after {time.perf_counter() - t0:.0f} s:", "", "```",
                       err.message, "```", ""]
    took = time.perf_counter() - t0
    plan = compiled.plan
    lines = head + [f"- `shard='never'`: {gist(unsharded)}.",
                    f"- `shard='auto'` (compiled in {took:.0f} s): {gist(plan)}."]
    if plan.shard is not None:
        return lines + ["", "```", compiled.summary(), "```", ""]
    if all(r == 1 for r in plan.replicas):
        return lines + ["", "No stage of the plan has replicas, so there is nothing to shard "
                        "over: every worker holds a stage of its own.", ""]
    t0 = time.perf_counter()  # what sharding every replicated stage would have given
    try:
        forced = compile_with("optimizer")
        got = gist(forced.plan)
    except InfeasiblePlanError as err:
        forced, got = None, err.message
    lines += [f"- `shard='optimizer'` (every replicated stage sharded; compiled in "
              f"{time.perf_counter() - t0:.0f} s): {got}.", "",
              "The plan with sharding allowed keeps the optimizer state whole: no sharded "
              "candidate is faster (a sharded group pays 1.5 times the sync for the memory it "
              "frees)."]
    if forced is not None and forced.plan.shard is not None:
        lines += ["", without_recompute(forced), "", "The plan with every replicated stage "
                  "sharded:", "", "```", forced.summary(), "```"]
    return lines + [""]


def without_recompute(compiled) -> str:
    """Why a sharded plan still recomputes: each recomputing replicated stage's memory by the
    rule without recomputation (its activations of every minibatch in flight), next to the
    memory sharding freed on it."""
    from fxpipe.passes.partition import plan_for
    from fxpipe.runtime.pricing.memory import memory_rule
    from fxpipe.runtime.replica.state_size import state_parts
    from fxpipe.units import format_bytes

    plan, profile = compiled.plan, compiled.profile
    index = {n: i for i, n in enumerate(profile.names)}
    starts = [index[sp.nodes[0]] for sp in plan.stages]
    factor, split = state_parts(list(compiled.model.parameters()), _adamw)
    cluster = type(compiled.cluster).from_dict(dict(plan.cluster))
    kw = dict(optimizer_state_factor=factor, sharded_state=split,
              memory_rule=memory_rule("1f1b-flush"))
    bare = [plan_for(profile, cluster, starts, list(plan.replicas), shard=shard,
                     recompute=[False] * len(starts), **kw) for shard in ("optimizer", "never")]
    rows = [s for s, sp in enumerate(plan.stages) if sp.recompute and sp.replicas > 1]
    if not rows:
        return "No replicated stage of the sharded plan recomputes."
    need = max(bare[0].stages[s].memory_bytes for s in rows)
    freed = max(bare[1].stages[s].memory_bytes - bare[0].stages[s].memory_bytes for s in rows)
    cap = plan.cluster.get("memory") or float("inf")
    said = (f"Sharding frees up to {format_bytes(freed)} per worker on a replicated stage; "
            f"without recomputation the largest of its {len(rows)} recomputing replicated "
            f"stages would hold {format_bytes(need)} by the rule (its activations of every "
            f"minibatch in flight)")
    if need > cap:
        return (said + f", over the {format_bytes(cap)} cap: the sharded plan cannot "
                "recompute less, and pays 1.5 times the sync.")
    return said + f", within the {format_bytes(cap)} cap."


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
