"""Planning speed: ``partition`` on PipeDream's real profiles and a 10,000-node synthetic graph,
the literal PipeDream DP beside it, and measured profiling of a 94-node CNN (the part of
``fxpipe.compile`` that runs the model).

Run from the repository root:  .venv/bin/python -m bench.plan_speed
Writes its page benchmarks/plan_speed.md (a markdown table with the exact command at the top).
"""
from __future__ import annotations

import argparse
import logging
import random
import sys
import time
from pathlib import Path

from fxpipe.costmodel.hardware import Cluster
from fxpipe.costmodel.profile import Profile, ProfileNode
from fxpipe.passes import partition
from fxpipe.passes.reference_dp import pipedream_dp
from fxpipe.models import pipedream

ROOT = Path(__file__).resolve().parents[1]
PROFILES = pipedream.PROFILES
log = logging.getLogger("plan_speed")


def synthetic(n: int = 10_000, seed: int = 0) -> Profile:
    """A deep residual-network-like chain: blocks of conv/bn/relu with a skip every 3 nodes,
    activations shrinking with depth, parameters growing, and a large FC head."""
    rng = random.Random(seed)
    nodes: list[ProfileNode] = []
    for i in range(n):
        depth = i / n
        inputs = (f"v{i - 1}",) if i else ()
        if i >= 3 and i % 3 == 0:
            inputs = (f"v{i - 1}", f"v{i - 3}")  # residual add
        head = i >= n - 2
        nodes.append(ProfileNode(
            name=f"v{i}", op="call_module", target="fc" if head else "conv",
            forward_s=rng.uniform(0.5e-4, 1.5e-4) * (0.3 if head else 1.0),
            backward_s=rng.uniform(1e-4, 3e-4),
            activation_bytes=(1e6 if head else 4e7 * (1 - depth) + 1e6) * rng.uniform(0.8, 1.2),
            parameter_bytes=(2e8 if head else (1e3 + 5e5 * depth) * (i % 3 == 1)),
            inputs=inputs))
    return Profile(nodes=tuple(nodes), batch_size=128, source="synthetic-10k")


def timed(profile: Profile, workers: int, sync: str) -> tuple[list[int], float, float]:
    t = time.perf_counter()
    plan = partition(profile, Cluster(workers=workers, bandwidth="10Gbps"), sync=sync)
    return plan.replicas, plan.time_per_minibatch, time.perf_counter() - t


def profiling_seconds(repeats: int = 3) -> tuple[int, list[float]]:
    """Seconds of ``profile_graph`` (default warm-up and repeats) on a CNN of 94 compute nodes
    (conv + 30 x conv/bn/relu + pool, flatten, linear; batch 4 x 3 x 16 x 16), ``repeats``
    times: (nodes, seconds per run). The tests check what it measures, this how long it takes."""
    import torch
    import torch.nn as nn

    from fxpipe.costmodel import profile_graph
    from fxpipe.tracing import trace

    def block(c: int) -> nn.Module:
        return nn.Sequential(nn.Conv2d(c, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU())

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), *[block(8) for _ in range(30)],
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10))
    x = torch.randn(4, 3, 16, 16)
    secs = []
    for _ in range(repeats):
        gm = trace(model, (x,)).gm
        t = time.perf_counter()
        profile_graph(gm, (x,))
        secs.append(time.perf_counter() - t)
    return sum(1 for n in gm.graph.nodes if n.op not in ("placeholder", "output")), secs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=None, help="write here instead of benchmarks/plan_speed.md")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    rows = []
    models = sorted(p.parent.name for p in PROFILES.glob("*/graph.txt")) if PROFILES.exists() else []
    if not models:
        log.warning("no PipeDream profiles at %s; only the synthetic graph is timed", PROFILES)
    for model in models:
        prof = Profile.from_pipedream(PROFILES / model / "graph.txt")
        for workers in (4, 8, 16):
            for sync in ("allreduce", "parameter-server"):
                reps, t, secs = timed(prof, workers, sync)
                rows.append((model, len(prof), workers, sync, reps, t, secs))
                log.info("%s %d %s %s %.4g %.3fs", model, workers, sync, reps, t, secs)
    syn = synthetic()
    for sync in ("allreduce", "parameter-server"):
        timed(syn, 64, sync)  # warm-up (imports, allocations) not counted
        reps, t, secs = timed(syn, 64, sync)
        rows.append(("synthetic-10k", len(syn), 64, sync, reps, t, secs))
        log.info("synthetic %s %s %.4g %.3fs", sync, reps, t, secs)
    dp_rows = []
    for model in [m for m in ("alexnet", "vgg16", "resnet50") if m in models]:
        prof = Profile.from_pipedream(PROFILES / model / "graph.txt")
        for workers in (8, 16):
            cluster = Cluster(workers=workers, bandwidth="10Gbps")
            t0 = time.perf_counter()
            ours = partition(prof, cluster, sync="parameter-server").time_per_minibatch
            t1 = time.perf_counter()
            theirs = pipedream_dp(prof, cluster, sync="parameter-server")
            t2 = time.perf_counter()
            dp_rows.append((model, len(prof), workers, ours, theirs, t1 - t0, t2 - t1))
            log.info("dp %s %d ours %.6g theirs %.6g", model, workers, ours, theirs)
    lines = ["## Planning speed", "", "Command: `.venv/bin/python -m bench.plan_speed` (from the "
             "repository root; 10 Gbps single-level cluster, no memory limit)", "",
             "| profile | nodes | workers | sync | plan replicas | predicted time/minibatch | "
             "planning seconds |", "|---|---:|---:|---|---|---:|---:|"]
    for model, n, w, sync, reps, t, secs in rows:
        shown = str(reps) if len(reps) <= 12 else f"{reps[:6]}... ({len(reps)} stages)"
        lines.append(f"| {model} | {n} | {w} | {sync} | {shown} | {t * 1e3:.2f} ms | {secs:.3f} |")
    lines += ["", "Against PipeDream's recurrence A(j, m) = min max(A(i, m-r), T(i..j, r), cut(i, r)), "
              "implemented literally in `fxpipe.passes.reference_dp` (O(N^2 M^2); same cost model, "
              "parameter-server sync), timed in the same run:", "",
              "| profile | nodes | workers | fxpipe optimum | PipeDream DP optimum | fxpipe seconds | "
              "DP seconds | ratio |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for model, n, w, ours, theirs, t_ours, t_dp in dp_rows:
        lines.append(f"| {model} | {n} | {w} | {ours * 1e3:.4f} ms | {theirs * 1e3:.4f} ms | "
                     f"{t_ours:.4f} | {t_dp:.2f} | {t_dp / t_ours:.0f}x |")
    nodes, secs = profiling_seconds()
    lines += ["", f"Measured profiling (`fxpipe.costmodel.profile_graph`, warm-up 2, repeats 5: "
              f"forward, backward and optimizer step of every node) of a CNN of {nodes} compute "
              f"nodes (batch 4 x 3 x 16 x 16), 3 runs: "
              + ", ".join(f"{s:.2f} s" for s in secs) + "."]
    from bench._report import publish

    publish("plan_speed", "\n".join(lines), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
