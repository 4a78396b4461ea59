"""Third-party models: compile time of the 14 tiny architectures of the test matrix on one core,
and a Hugging Face Llama with a 7B-parameter config planned on the meta device for 8 A100s.

Run from the repository root (one core, as the test matrix's "under 5 s" is stated):

    taskset -c 0 .venv/bin/python -m bench.hf_models

Writes its page benchmarks/hf-models.md. Each compile is timed whole (trace, cost, plan, split),
once with measured costs and once estimated for V100s, after one untimed warm-up compile per
architecture (first imports, torch.export's caches); the Llama plan is timed cold, phase by phase.
"""
from __future__ import annotations

import argparse
import copy
import statistics
import time
from pathlib import Path

import torch

from bench._report import publish

ROOT = Path(__file__).resolve().parents[1]

LLAMA_7B = ("hf:LlamaForCausalLM:hidden_size=4096,intermediate_size=11008,num_hidden_layers=32,"
            "num_attention_heads=32,num_key_value_heads=32,vocab_size=32000,"
            "max_position_embeddings=4096")


def compile_times(repeats: int) -> list[tuple[str, str, float, float, int]]:
    """(arch, tracer, measured s, estimated s, graph nodes) per architecture, 2 stages."""
    import fxpipe
    from tests.api.third_party import CASES  # the test matrix's models, defined once

    rows = []
    for arch in sorted(CASES):
        case = CASES[arch]()
        inputs, _ = case.batch(0)
        times: dict[str, list[float]] = {"measured": [], "estimated": []}
        nodes, tracer = 0, ""
        for i in range(repeats + 1):
            for kind, device in (("measured", None), ("estimated", "V100")):
                model = copy.deepcopy(case.model)
                t0 = time.perf_counter()
                c = fxpipe.compile(model, fxpipe.Cluster(workers=2, device=device),
                                   example_inputs=inputs, loss_fn=case.loss_fn, stages=2)
                if i:  # the first round warms up
                    times[kind].append(time.perf_counter() - t0)
                nodes, tracer = len(c.traced.gm.graph.nodes), c.tracer
        rows.append((arch, tracer, statistics.median(times["measured"]),
                     statistics.median(times["estimated"]), nodes))
        print(f"{arch}: {rows[-1]}", flush=True)
    return rows


def plan_llama_7b(svg: Path) -> tuple[dict[str, float], str, int, float]:
    """Phase times, the plan table, graph nodes and parameters (billions)."""
    import fxpipe
    from fxpipe import models
    from fxpipe.api import cost_graph, stage_assignment
    from fxpipe.codegen import split_graph
    from fxpipe.tracing import trace

    phases: dict[str, float] = {}
    t = time.perf_counter()
    spec = models.resolve(LLAMA_7B, meta=True, batch_size=1, seq_len=2048)
    phases["build on meta"] = time.perf_counter() - t
    cluster = fxpipe.Cluster(workers=8, device="A100", memory="80GB", bandwidth="10Gbps")
    t = time.perf_counter()
    traced = trace(spec.model, spec.example_inputs)
    phases["trace (torch.export)"] = time.perf_counter() - t
    t = time.perf_counter()
    profile = cost_graph(traced, cluster)
    phases["estimate costs"] = time.perf_counter() - t
    t = time.perf_counter()
    plan = fxpipe.partition(profile, cluster)
    phases["partition"] = time.perf_counter() - t
    t = time.perf_counter()
    split_graph(traced.gm, stage_assignment(plan))
    phases["split"] = time.perf_counter() - t
    # the whole public path, as a user runs it (summary with module spans, drawing)
    t = time.perf_counter()
    spec = models.resolve(LLAMA_7B, meta=True, batch_size=1, seq_len=2048)
    compiled = fxpipe.compile(spec.model, cluster, example_inputs=spec.example_inputs)
    compiled.visualize(svg)
    phases["fxpipe.compile + visualize, end to end"] = time.perf_counter() - t
    params = sum(p.numel() for p in spec.model.parameters()) / 1e9
    return phases, compiled.summary(), len(traced.gm.graph.nodes), params


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--svg", default=str(ROOT / "docs" / "llama-7b-plan.svg"))
    p.add_argument("--out", default=None, help="write the markdown here, not to "
                   "benchmarks/hf-models.md")
    args = p.parse_args()
    torch.set_num_threads(1)
    rows = compile_times(args.repeats)
    phases, table, nodes, params = plan_llama_7b(Path(args.svg))
    md = ["## Third-party models: compile time, and Llama-7B planned on the meta device", "",
          "`taskset -c 0 .venv/bin/python -m bench.hf_models` (one core, one thread; median of "
          f"{args.repeats} compiles after a warm-up; 2 stages; the models of "
          "`tests/api/third_party.py`)", "",
          "| model | tracer | graph nodes | measured costs | estimated (V100) |",
          "|---|---|---:|---:|---:|"]
    md += [f"| {a} | {t} | {n} | {m:.2f} s | {e:.2f} s |" for a, t, m, e, n in rows]
    md += ["", f"Slowest: {max(max(r[2], r[3]) for r in rows):.2f} s.", "",
           f"Llama with a 7B config ({params:.2f} B parameters, {nodes} graph nodes) on the meta "
           "device, batch 1 x 2048 tokens, planned for 8 A100 (80 GB) at 10 Gbps with estimated "
           "costs:", "", "| phase | seconds |", "|---|---:|"]
    md += [f"| {k} | {v:.1f} |" for k, v in phases.items()]
    md += ["", "```", table, "```", "",
           f"The drawing (one box per module): [{Path(args.svg).name}]"
           f"({Path(args.svg).relative_to(ROOT) if Path(args.svg).is_relative_to(ROOT) else args.svg})"]
    publish("hf-models", "\n".join(md), args.out)


if __name__ == "__main__":
    main()
