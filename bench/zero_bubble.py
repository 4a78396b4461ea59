"""Synchronous without the bubble, simulated: every schedule's throughput at the same samples
per update, on 8-stage straight pipelines we do not have.

    .venv/bin/python -m bench.zero_bubble            # writes the "zero-bubble" section
    .venv/bin/python -m bench.zero_bubble --no-write # print only

``pipedream`` updates after every minibatch of N samples; a synchronous schedule with m
microbatches per update runs microbatches of N/m samples, so both make one update per N samples
(the same statistical semantics per update, up to PipeDream's staleness). GPT-2 (124M, 1024-token
sequences, V100) is re-estimated at every microbatch size (its roofline prices small microbatches
honestly); PipeDream's profiles exist at one batch size only, so their times and activation bytes
are scaled linearly by 1/m (optimistic for small microbatches). Each plan is the planner's
8-stage straight plan for that profile on 8 workers at 10 Gbps; ``fxpipe.runtime.pricing.plansim``
simulates it (links as queued resources, 1F1B start-up, flushes) for 8 updates. The placed
kinds (``interleaved-1f1b`` with 2 stages per worker, ``zb-v``) run the planner's 16-stage
straight plan (a virtual cluster of 16 workers with half the memory each) on the 8 workers,
priced by ``fxpipe.runtime.pricing.placed_sim`` (no link queueing there: a lower bound where cuts
would share a port); "n/a" where the profile has too few cut points for 16 stages.
"""
from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

from bench._report import write_section
from fxpipe.costmodel import Cluster, Profile
from fxpipe.passes import partition
from fxpipe.errors import InfeasiblePlanError
from fxpipe.runtime.pricing.placed_sim import virtual_cluster
from fxpipe.runtime.pricing.plansim import simulate_plan
from fxpipe.models import pipedream

ROOT = Path(__file__).resolve().parents[1]

SYNC_KINDS = ("gpipe", "1f1b-flush", "zb-h1", "zb-h2", "interleaved-1f1b", "zb-v")
PLACED = ("interleaved-1f1b", "zb-v")  # 2 stages per worker (fxpipe.runtime.schedules.placement)
PROFILE_DIRS = (pipedream.PROFILES,)  # vendored (MIT, see its LICENSE)
STAGES, WORKERS, BANDWIDTH = 8, 8, "10Gbps"
UNLIMITED = "1TB"  # memory is not the question here (as in table1.py); the zb-h2 rows hold more


def gpt(batch: int) -> Profile:
    """GPT-2 small at ``batch`` sequences of 1024 tokens, estimated for a V100 on the meta
    device (seconds, no real forward)."""
    import torch

    import fxpipe
    import fxpipe.models

    with torch.device("meta"):
        spec = fxpipe.models.get("gpt", size="full", batch_size=batch)
    return fxpipe.compile(spec.model, fxpipe.Cluster(workers=WORKERS, device="V100",
                                                     memory=UNLIMITED),
                          example_inputs=spec.example_inputs).profile


def scaled(profile: Profile, m: int) -> Profile:
    """``profile`` at 1/m of its batch: times and activation bytes divided by m (the update,
    once per step whatever the batch, is not)."""
    nodes = tuple(replace(n, forward_s=n.forward_s / m, backward_s=n.backward_s / m,
                          activation_bytes=n.activation_bytes / m) for n in profile.nodes)
    batch = profile.batch_size // m if profile.batch_size else None
    return replace(profile, nodes=nodes, batch_size=batch)


def per_update(profile: Profile, kind: str, m: int, cluster: Cluster) -> float | None:
    """Simulated seconds per update (steady state) of ``kind`` on the 8-stage straight plan
    (placed kinds: the 16-stage one, 2 stages per worker; None if the model has too few cuts)."""
    if kind in PLACED:
        try:
            plan = partition(profile, virtual_cluster(cluster, 2), stages=2 * STAGES,
                             straight=True)
        except InfeasiblePlanError:
            return None
        sim = simulate_plan(plan, profile, schedule=kind, minibatches=8 * m, microbatches=m)
        return sim.steady_state_period * m
    plan = partition(profile, cluster, stages=STAGES, straight=True)
    if kind == "pipedream":
        sim = simulate_plan(plan, profile, schedule=kind, minibatches=8 * STAGES)
        return sim.steady_state_period
    sim = simulate_plan(plan, profile, schedule=kind, minibatches=8 * m, microbatches=m)
    return sim.steady_state_period * m


def table(name: str, at: dict[int, Profile], cluster: Cluster, ms: tuple[int, ...]) -> list[str]:
    """One markdown block: per m, each kind's throughput relative to pipedream."""
    base = per_update(at[1], "pipedream", 1, cluster)
    rows = [f"**{name}** (pipedream: {base * 1e3:.3g} ms per update)", "",
            "| microbatches per update | " + " | ".join(SYNC_KINDS) + " | best / pipedream |",
            "|---:|" + "---:|" * (len(SYNC_KINDS) + 1)]
    for m in ms:
        t = {k: per_update(at[m], k, m, cluster) for k in SYNC_KINDS}
        rel = {k: base / v for k, v in t.items() if v is not None}
        best = max(rel, key=rel.__getitem__)
        rows.append(f"| {m} | " + " | ".join(f"{rel[k]:.2f}" if k in rel else "n/a"
                                             for k in SYNC_KINDS)
                    + f" | {rel[best]:.2f} ({best}) |")
    return rows + [""]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args()
    cluster = Cluster(workers=WORKERS, bandwidth=BANDWIDTH)
    v100 = Cluster(workers=WORKERS, bandwidth=BANDWIDTH, device="V100", memory=UNLIMITED)
    md = ["## Synchronous without the bubble: simulated throughput at the same samples per update",
          "", "`.venv/bin/python -m bench.zero_bubble` — throughput of each synchronous schedule "
          "relative to `pipedream` (1.00 = as fast), 8 stages on 8 workers, 10 Gbps; see the "
          "script's docstring for the method. `interleaved-1f1b` and `zb-v` run the planner's "
          "16-stage straight plan, 2 stages per worker (round robin / the V): that plan balances "
          "STAGES, not workers, so where a few indivisible nodes dominate (GPT-2 here: stages 0, "
          "1, 2 and 15 carry nearly all the work) the V puts two heavy stages (0 and 15) on one "
          "worker; a placement-aware partition is not done yet.", ""]
    ms = (8, 16, 32)
    md += table("GPT-2 124M, 32 x 1024 tokens per update, V100", {m: gpt(32 // m)
                                                                   for m in (1, *ms)}, v100, ms)
    folder = next((d for d in PROFILE_DIRS if d.is_dir()), None)
    for model in ("vgg16", "resnet50", "gnmt"):
        if folder is None:
            break
        prof = Profile.from_pipedream(folder / model / "graph.txt")
        md += table(f"PipeDream profile {model} (batch {prof.batch_size}, linear scaling)",
                    {m: scaled(prof, m) for m in (1, *ms)}, cluster, ms)
    text = "\n".join(md)
    print(text)
    if not args.no_write:
        write_section("zero-bubble", text)


if __name__ == "__main__":
    main()
