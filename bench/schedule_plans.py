"""Plans priced for the schedule that runs: the planner's promise against the simulation.

Run from the repository root:  .venv/bin/python -m bench.schedule_plans
Writes its page benchmarks/schedule-plans.md (``--out FILE`` writes the markdown there instead).

For the zoo's GPT and VGG-mini (V100 costs, estimated) and PipeDream's VGG-16, GNMT and
ResNet-50 profiles, at 8 and 16 workers on 10 Gbps, and for ``1f1b-flush`` and ``zb-h2`` at
their default microbatches (one per worker): the planner's analytic optimum (priced as
PipeDream's schedule, no flush) with its promised time and speedup, that plan simulated under
the schedule, and the plan ``fxpipe.compile(..., schedule=kind)`` makes by default (the
candidates simulated under the schedule, data parallelism among them): its stated time and
speedup, and an independent simulation of it twice as long. Pure arithmetic: no processes.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

from bench._report import publish
from fxpipe.models import pipedream

SECTION = "schedule-plans"
ROOT = Path(__file__).resolve().parents[1]
PROFILES = pipedream.PROFILES
SOURCES = ("gpt", "vgg16", "pipedream:vgg16", "pipedream:gnmt", "pipedream:resnet50")
KINDS = ("1f1b-flush", "zb-h2")


def profile_of(source: str):
    import fxpipe
    from fxpipe import models
    from fxpipe.costmodel import Cluster, Profile

    if source.startswith("pipedream:"):
        return Profile.from_pipedream(PROFILES / source.split(":")[1] / "graph.txt"), None
    spec = models.get(source, size="mini")
    return fxpipe.compile(spec.model, Cluster(workers=1, device="V100"),
                          example_inputs=spec.example_inputs, loss_fn=spec.loss_fn).profile, "V100"


def row(source: str, prof, device: str | None, workers: int, kind: str) -> str:
    from fxpipe.api import choose_plan
    from fxpipe.costmodel import Cluster
    from fxpipe.runtime.pricing.plansim import minibatches_for, simulate_plan
    from fxpipe.units import format_seconds

    cluster = Cluster(workers=workers, bandwidth="10Gbps", device=device)
    t0 = time.perf_counter()
    planner = choose_plan(prof, cluster, schedule=kind, choose="planner")
    sim_planner = simulate_plan(planner, prof, schedule=kind,
                                minibatches=minibatches_for(planner.replicas)).steady_state_period
    made = choose_plan(prof, cluster, schedule=kind)
    took = time.perf_counter() - t0
    again = simulate_plan(made, prof, schedule=kind, minibatches=2 * minibatches_for(
        made.replicas)).steady_state_period
    off = made.time_per_minibatch / again - 1
    return (f"| {source} | {workers} | {kind} | {'-'.join(map(str, planner.replicas))} | "
            f"{format_seconds(planner.time_per_minibatch)} "
            f"({planner.speedup_over_data_parallel:.2f}x) | {format_seconds(sim_planner)} "
            f"({made.data_parallel_time / sim_planner:.2f}x) | "
            f"{'-'.join(map(str, made.replicas))} | {format_seconds(made.time_per_minibatch)} "
            f"({made.speedup_over_data_parallel:.2f}x) | {100 * off:+.1f}% | {took:.0f} s |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None, help="write the markdown here instead of the page")
    args = ap.parse_args()
    lines = ["## Plans priced for the schedule that runs", "",
             "`.venv/bin/python -m bench.schedule_plans` (10 Gbps; zoo models with V100 costs "
             "estimated, PipeDream's profiles as published; default microbatches = workers)", "",
             "Speedups are over BSP data parallelism simulated under the same schedule. "
             "*planner*: the analytic optimum, priced as PipeDream's schedule (no flush); "
             "*simulated*: that plan under the schedule; *made for it*: "
             "`fxpipe.compile(..., schedule=kind)`'s default plan (candidates simulated under "
             "the schedule); *check*: its stated time against a simulation twice as long; "
             "*took*: planning and simulating this row.", "",
             "| profile | workers | schedule | planner's plan | planner says | simulated | "
             "made for it | it says | check | took |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for source in SOURCES:
        prof, device = profile_of(source)
        for workers in (8, 16):
            for kind in KINDS:
                lines.append(row(source, prof, device, workers, kind))
                print(lines[-1], flush=True)
    publish(SECTION, "\n".join(lines), args.out)


if __name__ == "__main__":
    main()
