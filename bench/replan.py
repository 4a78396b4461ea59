"""Re-planning in place from a deliberately wrong profile (issue 13, item 1), local gloo ranks.

    .venv/bin/python -m bench.replan [--procs 2] [--repeats 3]
    sudo .venv/bin/python -m bench.replan --hosts 2 --mbit 100 --layers 12 [--repeats 5]

With ``--hosts`` the ranks run on emulated hosts (tools/cluster: one network namespace and one
core per host, links shaped to ``--mbit`` by tc; needs root), one torchrun agent per host, and
the profile is planned for that bandwidth; the section is "replan-cluster", with per-rank
timeline pictures before and after the re-plan (docs/figures/replan-timeline-*.png) and the
planner's prediction before and after the re-plan's rescaling against the measured time
(issue 13, item 3).

Costs of an MLP are measured once on this machine (the RIGHT profile; its plan is the right
plan). The WRONG profile multiplies the right plan's stage 0 costs by 4; its plan cuts
elsewhere. Three runs per repeat, one after the other, each ``--procs`` torchrun ranks (gloo,
one thread each), 1f1b-flush:

* ``right``: the right plan;
* ``wrong``: the wrong plan, kept (the cost of believing the wrong profile);
* ``replan``: the wrong plan with ``replan="auto"``: after the first segment every rank
  measures its stage from its timeline, the ranks agree on a re-solved plan and switch to it
  in place (``fxpipe.runtime.training.trainer_switch``). One decision (``replan_max=1``): the
  experiment measures the FIRST re-plan (the trainer's default re-plans again after a switch).

Every run records timelines (so the three pay the same) and the seconds per minibatch of every
segment; throughput excludes the first segment of each plan (warm-up). Results go to
benchmarks/replan.md (benchmarks/replan-cluster.md with ``--hosts``). The three runs of a
repeat go in rotating order (repeat k starts with run k mod 3).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from fxpipe.runtime.execution.ports import free_port

ROOT = Path(__file__).resolve().parents[1]

D, B = 512, 32  # width, batch (samples per minibatch)
L = 6  # hidden layers (--layers; set before any Net is built)
MINIBATCHES, SEGMENT, MICRO = 256, 8, 4


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList([nn.Linear(D, D) for _ in range(L)])
        self.head = nn.Linear(D, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.head(x)


def data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(B, D, generator=g), torch.randint(0, 10, (B,), generator=g))
            for _ in range(MINIBATCHES)]


def plans(procs: int, work: Path, bandwidth: str | None = None) -> dict[str, Any]:
    """Measure the right profile here; derive the wrong one; save both with their plans."""
    import fxpipe
    from fxpipe.passes.partition import partition
    from fxpipe.runtime.pricing.replan import stage_starts

    torch.set_num_threads(1)
    cluster = (fxpipe.Cluster(workers=procs, bandwidth=bandwidth) if bandwidth
               else fxpipe.Cluster(workers=procs))
    c = fxpipe.compile(Net(), cluster, example_inputs=(torch.randn(B, D),),
                       loss_fn=F.cross_entropy, repeats=5)
    right, plan = c.profile, c.plan
    x4 = set(plan.stages[0].nodes)
    bad = replace(right, nodes=tuple(
        replace(nd, forward_s=4 * nd.forward_s, backward_s=4 * nd.backward_s,
                update_s=4 * nd.update_s) if nd.name in x4 else nd for nd in right.nodes))
    bad_plan = replace(partition(bad, cluster), model_fingerprint=plan.model_fingerprint)
    info = {"right": {"profile": right.to_dict(), "plan": plan.to_dict()},
            "wrong": {"profile": bad.to_dict(), "plan": bad_plan.to_dict()},
            "starts": {"right": stage_starts(right, plan), "wrong": stage_starts(bad, bad_plan)},
            "replicas": {"right": plan.replicas, "wrong": bad_plan.replicas}}
    (work / "plans.json").write_text(json.dumps(info))
    return info


def predicted_s(plan: Any, profile: Any) -> dict[str, float]:
    """What the planner predicts per minibatch for ``plan`` on ``profile``: its bottleneck
    (``Plan.time_per_minibatch``: pipedream's steady state) and the event simulation of one
    segment of the schedule the runs use (1f1b-flush, ``MICRO`` minibatches per update, fill
    and drain of every update included: what a segment's measured time contains)."""
    from fxpipe.runtime.pricing.plansim import simulate_plan

    sim = simulate_plan(plan, profile, schedule="1f1b-flush", minibatches=SEGMENT,
                        microbatches=MICRO)
    return {"planner": plan.time_per_minibatch, "sim": sim.makespan / SEGMENT}


def worker(work: Path, run: str, after: int = 1) -> int:
    """One rank of one run (launched by torchrun)."""
    import fxpipe
    from fxpipe.costmodel import Profile
    from fxpipe.passes import Plan

    torch.set_num_threads(1)
    info = json.loads((work / "plans.json").read_text())
    which = "right" if run == "right" else "wrong"
    plan, profile = (Plan.from_dict(info[which]["plan"]),
                     Profile.from_dict(info[which]["profile"]))
    c = fxpipe.compile(Net(), fxpipe.Cluster(workers=int(os.environ["WORLD_SIZE"])),
                       example_inputs=(torch.randn(B, D),), loss_fn=F.cross_entropy, plan=plan,
                       repeats=1)
    c.profile = profile  # what this run believes
    t = c.trainer(optimizer=lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=0.9),
                  schedule="1f1b-flush", microbatches=MICRO, segment=SEGMENT, progress=False,
                  timeout_s=120, replan="auto", replan_after=after, replan_max=1,
                  replan_threshold=0.05 if run == "replan" else 1e9)
    segments: list[dict[str, Any]] = []  # this rank's timeline of every segment, for pictures
    hook = t.replanner.after_segment

    def record(trainer: Any, *args: Any) -> Any:
        events, _ = trainer.timelines[-1]
        t0 = trainer.timeline_origin
        segments.append({"plan": sum(r.adopted for r in trainer.replanner.records),
                         "stage": [list(k) for k in trainer.local], "n": args[-2],
                         "dt": args[-1],  # the segment's wall time as fit measures it
                         "events": [[e.category, e.name, t0 + e.start, t0 + e.end]
                                    for e in events]})
        return hook(trainer, *args)
    t.replanner.after_segment = record
    history = t.fit(data(), epochs=1)
    rank = int(os.environ["RANK"])
    (work / f"{run}-rank{rank}.json").write_text(json.dumps(segments))
    if rank == 0:
        recs = []
        for r in t.replanner.records:
            running = r.proposal.proposed if r.adopted else r.proposal.current
            recs.append({
                "adopted": r.adopted, "gain": r.proposal.gain, "factors": r.proposal.factors,
                "from": list(r.proposal.current.replicas),
                "to": list(r.proposal.proposed.replicas),
                "to_stages": [len(s.nodes) for s in r.proposal.proposed.stages],
                "from_stages": [len(s.nodes) for s in r.proposal.current.stages],
                "predicted_before_s": r.proposal.current.time_per_minibatch,
                "predicted_after_s": r.proposal.proposed.time_per_minibatch,
                # item 3: the running plan's prediction on the profile it was started from,
                # and the plan running after the decision on the rescaled profile
                "predict_original": predicted_s(plan, profile),
                "predict_rescaled": predicted_s(running, r.proposal.profile),
                # in sample: the plan that was measured, on the profile rescaled to it
                "predict_measured": predicted_s(r.proposal.current, r.proposal.profile)})
        spans = [[g["plan"], (max(e[3] for e in g["events"]) - min(e[2] for e in g["events"]))
                  / g["n"]] for g in segments]  # rank 0's first to last event, per minibatch
        (work / f"{run}.json").write_text(json.dumps({
            "segments": t.replanner.segment_times, "records": recs, "spans": spans,
            "loss": history[-1]["loss"]}))
    t.close()
    return 0



def worker_args(work: Path, run: str, after: int) -> list[str]:
    return ["-m", "bench.replan", "--worker", run, "--work", str(work), "--layers", str(L),
            "--after", str(after)]


def launch(work: Path, run: str, procs: int, after: int = 1, cluster: Any = None,
           port: int = 29500) -> dict[str, Any]:
    """One run: ``procs`` local ranks, or one rank per emulated host of ``cluster``."""
    if cluster is not None:
        from tools.cluster import read_output, torchrun_across, wait_all

        log_dir = work / f"logs-{run}-{port}"
        procs_ = torchrun_across(cluster, worker_args(work, run, after), port=port,
                                 env={"PYTHONPATH": str(ROOT)}, log_dir=log_dir)
        codes = wait_all(procs_, timeout=900)
        if any(codes):
            raise SystemExit(f"{run} failed ({codes}):\n"
                             + "\n".join(read_output(q)[-3000:] for q in procs_))
        return json.loads((work / f"{run}.json").read_text())
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={procs}",
           "--master-addr=127.0.0.1", f"--master-port={free_port()}",
           *worker_args(work, run, after)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    if res.returncode:
        raise SystemExit(f"{run} failed:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}")
    return json.loads((work / f"{run}.json").read_text())


def throughput(segments: list[list[float]], plan: int, average: Any = statistics.mean
               ) -> float:
    """Samples per second over the segments of plan generation ``plan``, its first one left
    out (warm-up)."""
    times = [s for g, s in segments if g == plan][1:]
    return B / average(times)


def measured_s(segments: list[list[float]], plan: int, skip: int) -> float:
    """Seconds per minibatch over the segments of plan generation ``plan`` but its first
    ``skip`` (the ones the re-plan measured, or the warm-up of a new plan)."""
    times = [s for g, s in segments if g == plan][skip:]
    return statistics.mean(times)


def repeats(work: Path, procs: int, n: int, after: int, cluster: Any = None
            ) -> list[dict[str, Any]]:
    runs = ("right", "wrong", "replan")
    rows = []
    for k in range(n):
        order = runs[k % 3:] + runs[:k % 3]  # rotating: each run goes first, second, last
        got = {}
        for j, run in enumerate(order):
            got[run] = launch(work, run, procs, after, cluster, port=29500 + 10 * k + j)
            if k == n - 1:  # keep the last repeat's timelines for the pictures
                for f in work.glob(f"{run}-rank*.json"):
                    f.replace(f.with_name("last-" + f.name))
        rec = got["replan"]["records"][0]
        row = {"order": list(order), "right": throughput(got["right"]["segments"], 0),
               "wrong": throughput(got["wrong"]["segments"], 0),
               "before": B / got["replan"]["segments"][0][1],
               "after": (throughput(got["replan"]["segments"], 1) if rec["adopted"] else None),
               "median": {"right": throughput(got["right"]["segments"], 0, statistics.median),
                          "wrong": throughput(got["wrong"]["segments"], 0, statistics.median),
                          "after": (throughput(got["replan"]["segments"], 1, statistics.median)
                                    if rec["adopted"] else None)},
               "rec": rec, "loss": {r: got[r]["loss"] for r in got},
               "predict": {}}
        for run in runs:  # item 3: predicted vs measured s per minibatch, before and after
            r0 = got[run]["records"][0]
            segs = got[run]["segments"]
            gen = 1 if r0["adopted"] else 0
            row["predict"][run] = {
                "original": r0["predict_original"], "rescaled": r0["predict_rescaled"],
                "measured_before": measured_s(segs, 0, 1 if len(
                    [s for g, s in segs if g == 0]) > 1 else 0),
                "measured_after": measured_s(segs, gen, 1 if gen else after),
                "span_after": measured_s(got[run]["spans"], gen, 1 if gen else after),
                "measured": r0["predict_measured"],
                "measured_in_sample": statistics.mean(
                    [t for g, t in segs if g == 0][(1 if after > 1 else 0):after])}
        rows.append(row)
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    global L
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--procs", type=int, default=2)
    p.add_argument("--hosts", type=int, default=0, help="emulated hosts (needs root)")
    p.add_argument("--mbit", type=float, default=100.0, help="link rate with --hosts")
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--after", type=int, default=1, help="segments measured before re-planning")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--work", default=None)
    p.add_argument("--out", default=None, help="write the markdown here, not benchmarks/replan.md")
    a = p.parse_args(argv)
    L = a.layers
    if a.worker:
        return worker(Path(a.work), a.worker, a.after)
    work = Path(a.work or tempfile.mkdtemp(prefix="fxp-replan-"))
    work.mkdir(parents=True, exist_ok=True)
    if a.hosts:
        return cluster_main(a, work)
    info = plans(a.procs, work)
    t0, load0 = time.monotonic(), os.getloadavg()[0]
    rows = repeats(work, a.procs, a.repeats, a.after)
    from bench._report import publish

    wall, load1 = time.monotonic() - t0, os.getloadavg()[0]
    lines = ["## Re-planning in place from a wrong profile (issue 13)", "",
             f"Command: `.venv/bin/python -m bench.replan --procs {a.procs} --repeats "
             f"{a.repeats}` ({a.procs} local gloo ranks, 1 thread each, on {os.cpu_count()} cores: "
             f"`uptime` load {load0:.1f} at the start, {load1:.1f} at the end; {wall:.0f} s). MLP {L}x Linear({D},{D}) "
             f"+ head, batch {B}, 1f1b-flush, {MICRO} microbatches per update, segments of "
             f"{SEGMENT} minibatches, {MINIBATCHES} minibatches.", "",
             f"Right plan (profile measured here): node starts {info['starts']['right']}; wrong "
             f"plan (the right plan's stage 0 costs x4): node starts "
             f"{info['starts']['wrong']}. `replan` starts from the wrong plan and re-plans after "
             "its first segment from its ranks' timelines. Throughput in samples/s over each "
             "plan's segments but its first (warm-up); `before` is the replan run's one segment "
             "under the wrong plan (warm-up included).", "", *results_table(rows)]
    publish("replan", "\n".join(lines), a.out)
    return 0


def results_table(rows: list[dict[str, Any]]) -> list[str]:
    lines = ["| repeat | order | right | wrong (kept) | replan: after | after / right | "
             "wrong / right | re-plan: stages (nodes) | predicted gain | measured gain "
             "(after / wrong) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for k, r in enumerate(rows):
        rec, after, right, wrong = r["rec"], r["after"], r["right"], r["wrong"]
        lines.append(
            f"| {k} | {', '.join(r['order'])} | {right:.0f} | {wrong:.0f} | "
            f"{'-' if after is None else f'{after:.0f}'} | "
            f"{'-' if after is None else f'{after / right:.2f}'} | "
            f"{wrong / right:.2f} | {rec['from_stages']} -> "
            f"{rec['to_stages'] if rec['adopted'] else 'kept'} | {rec['gain']:+.1%} | "
            f"{'-' if after is None else f'{after / wrong - 1:+.1%}'} |")
    ok = [r["after"] / r["right"] for r in rows if r["after"] is not None]
    ww = [r["wrong"] / r["right"] for r in rows]
    if ok:
        lines += ["", f"**after / right** over {len(ok)} adopted repeat(s): mean "
                  f"{statistics.mean(ok):.2f}, min {min(ok):.2f}, max {max(ok):.2f}; "
                  f"re-plan adopted in {len(ok)} of {len(rows)} repeats."]
    else:
        gains = [r["rec"]["gain"] for r in rows]
        lines += ["", f"**The re-plan was adopted in none of the {len(rows)} repeats**: predicted "
                  f"gains {min(gains):+.1%} to {max(gains):+.1%}, below the 5% threshold."]
    lines.append(f"wrong / right over {len(rows)} repeats: mean {statistics.mean(ww):.2f}, "
                 f"min {min(ww):.2f}, max {max(ww):.2f}.")
    if "median" in rows[0]:  # the same ratios from each run's median segment (load spikes)
        om = [r["median"]["after"] / r["median"]["right"] for r in rows
              if r["median"]["after"] is not None]
        wm = [r["median"]["wrong"] / r["median"]["right"] for r in rows]
        after = (f"after / right mean {statistics.mean(om):.2f} [{min(om):.2f}-{max(om):.2f}], "
                 if om else "")
        lines.append(f"From each run's median segment instead of its mean: {after}wrong / right "
                     f"mean {statistics.mean(wm):.2f} [{min(wm):.2f}-{max(wm):.2f}].")
    for run in ("right", "wrong"):  # the noise floor: one plan, run after run
        xs = [r[run] for r in rows]
        lines.append(f"`{run}` alone across repeats: {min(xs):.0f}-{max(xs):.0f} samples/s "
                     f"(max/min {max(xs) / min(xs):.2f}).")
    lines += ["", "The gains are only claims where they exceed that spread."]
    return lines


def prediction_table(rows: list[dict[str, Any]]) -> list[str]:
    """Item 3: predicted / measured - 1 per run, before (original profile, the plan started
    with) and after the re-plan's rescaling (rescaled profile, the plan running after it)."""
    def cell(xs: list[float]) -> str:
        return (f"{statistics.mean(xs):+.0%} [{min(xs):+.0%}, {max(xs):+.0%}]"
                if xs else "-")
    def ms(xs: list[float]) -> str:
        return f"{1e3 * statistics.mean(xs):.1f} [{1e3 * min(xs):.1f}-{1e3 * max(xs):.1f}]"
    lines = ["| run | measured ms/minibatch before | planner before | simulated before | "
             "measured ms/minibatch after | planner after (rescaled) | simulated after "
             "(rescaled) | pipeline span ms/minibatch after | simulated after / span - 1 |",
             "|---|---|---|---|---|---|---|---|---|"]
    for run in ("right", "wrong", "replan"):
        ps = [r["predict"][run] for r in rows]
        mb = [p["measured_before"] for p in ps]
        ma = [p["measured_after"] for p in ps]
        sa = [p["span_after"] for p in ps]
        lines.append(
            f"| {run} | {ms(mb)} | "
            f"{cell([p['original']['planner'] / p['measured_before'] - 1 for p in ps])} | "
            f"{cell([p['original']['sim'] / p['measured_before'] - 1 for p in ps])} | "
            f"{ms(ma)} | "
            f"{cell([p['rescaled']['planner'] / p['measured_after'] - 1 for p in ps])} | "
            f"**{cell([p['rescaled']['sim'] / p['measured_after'] - 1 for p in ps])}** | "
            f"{ms(sa)} | {cell([p['rescaled']['sim'] / p['span_after'] - 1 for p in ps])} |")
    lines += ["", "In sample (the plan that was measured, on the profile rescaled to that "
              "measurement, against the same segments' measured time): the cost model's own "
              "error once the compute is right, without the run's later drift:", "",
              "| run | measured ms/minibatch (measured segments) | planner | simulated |",
              "|---|---|---|---|"]
    for run in ("right", "wrong", "replan"):
        ps = [r["predict"][run] for r in rows]
        mi = [p["measured_in_sample"] for p in ps]
        lines.append(
            f"| {run} | {ms(mi)} | "
            f"{cell([p['measured']['planner'] / p['measured_in_sample'] - 1 for p in ps])} | "
            f"{cell([p['measured']['sim'] / p['measured_in_sample'] - 1 for p in ps])} |")
    return lines


def cluster_main(a: argparse.Namespace, work: Path) -> int:
    """The emulated-cluster experiment (issue 13's first "done means" bullet and item 3)."""
    from bench._report import publish
    from tools.cluster import EmulatedCluster
    from bench.replan_figures import plot_timelines

    load0 = os.getloadavg()
    info = plans(a.hosts, work, bandwidth=f"{a.mbit:g}Mbit")
    t0 = time.monotonic()
    with EmulatedCluster(a.hosts, bandwidth=f"{a.mbit:g}Mbit", latency=0,
                         prefix="fxprp") as c:
        rows = repeats(work, a.hosts, a.repeats, a.after, c)
    wall, load1 = time.monotonic() - t0, os.getloadavg()
    suffix = "" if a.after == 2 else f"-after{a.after}"
    figs = plot_timelines(work, ROOT / "docs" / "figures",
                          f"replan-timeline-{a.mbit:g}mbit{suffix}", B)
    cmd = (f"sudo .venv/bin/python -m bench.replan --hosts {a.hosts} --mbit {a.mbit:g} "
           f"--layers {L} --after {a.after} --repeats {a.repeats}")
    lines = [f"## Re-planning in place on an emulated cluster: {a.hosts} hosts, "
             f"{a.mbit:g} Mbit/s (issue 13)", "",
             f"Command: `{cmd}` ({a.hosts} emulated hosts: one network namespace, one core and "
             f"one rank each, links shaped to {a.mbit:g} Mbit/s by tc, no latency (the kernel "
             f"has no netem); gloo over the shaped links; {wall:.0f} s; `uptime` load "
             f"{load0[0]:.1f} at the start, {load1[0]:.1f} at the end, on 2 cores shared with "
             f"other jobs). MLP {L}x Linear({D},{D}) + head, batch {B}, SGD momentum, "
             f"1f1b-flush, {MICRO} minibatches per update, segments of {SEGMENT} minibatches, "
             f"{MINIBATCHES} minibatches per run.", "",
             f"Right plan (profile measured here, planned for {a.hosts} workers at "
             f"{a.mbit:g} Mbit/s): node starts {info['starts']['right']}, replicas "
             f"{info['replicas']['right']}; wrong plan (the right plan's stage 0 costs x4): "
             f"node starts {info['starts']['wrong']}, replicas {info['replicas']['wrong']}. "
             f"`replan` starts from the wrong plan with `replan=\"auto\"` and re-plans after "
             f"its first {a.after} segment(s) from its ranks' timelines; `right` and `wrong` "
             "run with `replan=\"auto\"` and an unreachable threshold (they measure and decide "
             "too, and keep their plan). Throughput in samples/s over each plan's segments but "
             "its first (warm-up). Discussion and picture: "
             "[docs/cluster-experiment.md](docs/cluster-experiment.md#re-planning-from-a-wrong-"
             "profile-issue-13).", "", *results_table(rows), "",
             "### Prediction against measurement, before and after the re-plan (item 3)", "",
             "Predicted / measured - 1: mean [min, max] over the repeats. *Before*: the plan "
             "the run started with, on the profile it started from, against its measured "
             "seconds per minibatch (the wrong plan's profile for `wrong` and `replan`; for "
             "`replan` its segments before the switch but the first; with `--after 1` its one "
             "segment, warm-up included). *After*: the plan "
             "running after the decision (the new plan for `replan`, the kept plan for the "
             "others) on the profile rescaled from the measurement, against its segments after "
             "the decision (but the new plan's first). *Planner*: `Plan.time_per_minibatch`, "
             "the bottleneck (pipedream's steady state, no fill/drain); *simulated*: "
             "`simulate_plan(schedule=\"1f1b-flush\")` of one segment (fill and drain of every "
             "update included).", "", *prediction_table(rows), "",
             "Per-rank timelines of the last repeat (one row per rank; forward, backward, "
             "optimizer step, waits; white = idle; after the re-plan and for the `right` and "
             "`wrong` runs the segment of median length):", ""]
    lines += [f"![{name}](docs/figures/{path.name})" for name, path in figs]
    # one section per measurement window (--after 1 measures the warm-up segment)
    publish("replan-cluster" + suffix, "\n".join(lines), a.out)
    (work / "rows.json").write_text(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
