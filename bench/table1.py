"""PipeDream's Table 1, predicted by fxpipe's plan simulator for clusters we do not have.

    .venv/bin/python -m bench.table1            # writes benchmarks/table1.md
    .venv/bin/python -m bench.table1 --no-write # print only

For each model (PipeDream's published GPU profiles, plus the zoo's full-size GPT estimated for a
V100 on the meta device) and each cluster (4, 8, 16, 64 workers, one per machine, at 10 and
25 Gbps), the planner picks a plan and ``fxpipe.runtime.pricing.plansim.simulate_plan`` times it and
BSP data parallelism on all workers, both with PipeDream's parameter-server sync model. Speedups
are steady-state throughput ratios (the paper's are time to target accuracy on real clusters).
"""
from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

from bench._report import write_section
from fxpipe.costmodel import Cluster, Profile
from fxpipe.passes import partition
from fxpipe.runtime.pricing.plan_choice import choose_by_simulation
from fxpipe.runtime.pricing.plansim import data_parallel_plan, minibatches_for, simulate_plan
from fxpipe.models import pipedream

ROOT = Path(__file__).resolve().parents[1]

log = logging.getLogger("fxpipe.bench.table1")
PROFILES = pipedream.PROFILES
MODELS = {"VGG16": "vgg16", "AlexNet": "alexnet", "ResNet-50": "resnet50",
          "Inception-v3": "inception_v3", "GNMT": "gnmt", "GPT-2 (124M)": None}
WORKERS = (4, 8, 16, 64)
BANDWIDTHS = ("10Gbps", "25Gbps")
SYNC = "parameter-server"
MEMORY = None  # unconstrained: 16 GB at the profiles' batch sizes would rule out BSP itself


def gpt_profile() -> Profile:
    """The zoo's full GPT (GPT-2 small, batch 8 x 1024 tokens) costed for a V100. The model and
    its inputs live on the meta device, so tracing and estimating take seconds, not a real
    forward pass on this CPU."""
    import torch

    import fxpipe
    import fxpipe.models

    with torch.device("meta"):
        spec = fxpipe.models.get("gpt", size="full", batch_size=8)
    inputs = tuple(x.to("meta") if isinstance(x, torch.Tensor) else x for x in spec.example_inputs)
    return fxpipe.compile(spec.model, fxpipe.Cluster(workers=8, device="V100"),
                          example_inputs=inputs).profile


def replicas_text(replicas: list[int]) -> str:
    if len(replicas) == 1:
        return f"{replicas[0]} (DP)"
    if all(r == 1 for r in replicas):
        return f"straight ({len(replicas)})"
    return "-".join(map(str, replicas))


def row(name: str, profile: Profile, workers: int, bandwidth: str) -> list[str]:
    cluster = Cluster(workers=workers, bandwidth=bandwidth, memory=MEMORY)
    plan = partition(profile, cluster, sync=SYNC)
    chosen = choose_by_simulation(profile, cluster, sync=SYNC).plan
    sim = simulate_plan(plan, profile, minibatches=minibatches_for(plan.replicas))
    csim = simulate_plan(chosen, profile, minibatches=minibatches_for(chosen.replicas))
    bsp = simulate_plan(data_parallel_plan(profile, cluster, sync=SYNC), profile,
                        minibatches=minibatches_for([workers]))
    one = profile.total_compute_s  # one worker: forward + backward, nothing to communicate
    reduction = 1.0 - csim.bytes_per_minibatch / bsp.bytes_per_minibatch
    return [name, str(workers), bandwidth.replace("Gbps", ""),
            f"{one / bsp.steady_state_period:.2f}x",
            replicas_text(plan.replicas), f"{plan.speedup_over_data_parallel:.2f}x",
            f"{bsp.steady_state_period / sim.steady_state_period:.2f}x",
            f"{sim.relative_error:+.0%}",
            replicas_text(chosen.replicas), f"{one / csim.steady_state_period:.2f}x",
            f"{bsp.steady_state_period / csim.steady_state_period:.2f}x", f"{reduction:.0%}"]


HEAD = ["model", "workers", "Gbps", "BSP speedup", "planner's plan", "over BSP (planner)",
        "over BSP (sim)", "sim vs planner", "fxpipe plan (chosen by simulation)",
        "fxpipe speedup", "over BSP (sim)", "comm. reduction"]


def choice_note(rows: list[list[str]]) -> str:
    """What choosing by simulation changed, computed from the rows (columns of HEAD)."""
    ratio = lambda cell: float(cell.rstrip("x"))  # noqa: E731
    changed = [r for r in rows if r[4] != r[8]]
    worst = min(rows, key=lambda r: ratio(r[6]))
    return (f"Choosing by simulation changed the plan in {len(changed)} of {len(rows)} rows; "
            f"simulated against BSP, the planner's plans range from {ratio(worst[6]):.2f}x "
            f"({worst[0]}, {worst[1]} workers, {worst[2]} Gbps: {worst[4]}, while the chosen "
            f"plan there is {worst[8]} at {ratio(worst[10]):.2f}x) to "
            f"{max(ratio(r[6]) for r in rows):.2f}x; the chosen plans from "
            f"{min(ratio(r[10]) for r in rows):.2f}x to {max(ratio(r[10]) for r in rows):.2f}x "
            "(never below BSP: data parallelism is a candidate). bench/simcheck "
            "(`simulator-validation`) checks the simulator against measured runtime timelines.")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-write", action="store_true", help="print, do not touch "
                    "benchmarks/table1.md")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    t0 = time.perf_counter()
    rows = []
    for name, folder in MODELS.items():
        profile = gpt_profile() if folder is None else Profile.from_pipedream(PROFILES / folder / "graph.txt")
        for w in WORKERS:
            for bw in BANDWIDTHS:
                rows.append(row(name, profile, w, bw))
                print(" | ".join(rows[-1]), flush=True)
    took = time.perf_counter() - t0
    lines = ["| " + " | ".join(HEAD) + " |", "|" + "---|" * len(HEAD)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    md = "\n".join([
        "## Table 1, predicted: fxpipe plans vs BSP on clusters we do not have",
        "",
        "Command: `.venv/bin/python -m bench.table1` "
        f"(took {took:.0f} s on this machine; pure simulation, no GPU).",
        "",
        "Profiles: PipeDream's published GPU profiles (shipped in `fxpipe/models/pipedream_profiles/`, MIT; `pipedream:<name>`) and "
        "the zoo's full-size GPT (GPT-2 small, batch 8 x 1024 tokens) estimated for a V100 on the "
        "meta device. Clusters: one worker per machine, every link at the given bandwidth, memory "
        "unconstrained (16 GB at the profiles' batch sizes would rule out BSP itself). Sync model "
        "for both fxpipe and BSP: `parameter-server` (PipeDream's optimizer: `(C + 4 (r-1)/r "
        "P/B) / r`). Speedups are steady-state throughput from "
        "`fxpipe.runtime.pricing.plansim.simulate_plan` (pipedream 1F1B schedule, links as full-duplex "
        "resources, sends overlapping compute); 1 worker = the profile's forward + backward "
        "time. `planner's plan`: the analytic optimum (`fxpipe.passes.partition`), with its own "
        "prediction and its simulation (`sim vs planner`: simulated time per minibatch against "
        "the planner's). `fxpipe plan`: `fxpipe.compile(..., choose=\"simulation\")` / `fxpipe "
        "plan --choose simulation`, the fastest simulated of the planner's candidates (its best "
        "plan per stage count and the chain of merges of its optimum down to data parallelism; "
        "`fxpipe.runtime.pricing.plan_choice`). Communication reduction (of that plan): bytes on the wire "
        "per sample (activations + gradients across cuts, plus weight sync of replicated "
        "stages) against BSP's weight sync.",
        "",
        *lines,
        "",
        "Against the paper (PipeDream, SOSP'19; time to accuracy, measured on 4-GPU servers): "
        "VGG16 on 8 V100s over 10 Gbps is 7-1 there and here; the paper reports ~5x over BSP with "
        "~95% less traffic, the simulator 2.75x with 84% less (flat 10 Gbps between all workers, "
        "PipeDream's parameter-server cost for BSP's sync, throughput only). AlexNet and GNMT "
        "show the paper's pattern (large wins at 10 Gbps, shrinking at 25 Gbps).",
        "",
        "Simulated vs planned: exact (0%) for data parallelism and the `r-1` plans whose "
        "bottleneck is compute; negative where a cut is the bottleneck (full-duplex links carry "
        "activations and gradients at once, the planner charges `2X/B` to one link); positive, "
        "up to several x, for plans with many unevenly replicated stages: the default 1F1B "
        "windows (NOAM = ceil(workers / r_0)) cannot hide communication round trips, and the "
        "replicas of a stage wait for each other at every per-round update. Negative "
        "communication reductions (ResNet-50, Inception-v3) mean the pipeline sends more "
        "activation bytes than BSP sends weights.",
        "",
        choice_note(rows),
    ])
    if not args.no_write:
        write_section("table1", md)
    print(f"done in {took:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
