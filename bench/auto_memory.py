"""What ``schedule="auto"`` (the default) costs in memory next to naming the schedule, per rank.

Run from the repository root:  .venv/bin/python -m bench.auto_memory
Writes its page benchmarks/auto-memory.md (``--out FILE`` writes the markdown there instead).

The same training run twice under torchrun (2 ranks, gloo, 1 thread each): a 2-stage MLP of
50.4M parameters (12 x ``Linear(2048, 2048)`` + ``Linear(2048, 16)``, SGD with momentum 0.9, the
README's optimizer), trained for one epoch of 20,000 minibatches of 2 samples from a lazy loader
(a ``ShardedDataset`` whose inputs and targets are callables: every minibatch is made from its
index when asked for, nothing is materialised); once with ``compiled.trainer(...)``'s default
``schedule="auto"`` (its decision included: the pilot on copies, or the check that skips it),
once with ``schedule="1f1b-flush"`` named; then, ended at the decision, the two pilots measured
with no limit on their cost: on copies (the default) and on the job's own pipeline
(``where="pipeline"``). Every rank reports the peak of its resident set during ``fit``
(``VmHWM`` of ``/proc/self/status``, reset by ``/proc/self/clear_refs`` just before ``fit``, so
the compile before it does not count) and the whole process's (``ru_maxrss``).

Why this model: its step is cheap for 50M parameters (a matrix-vector product per layer), so a
20,000-minibatch run takes minutes per rank on 2 shared cores; every parameter is trained, so its
gradients and optimizer state are in both runs, as in a real one.
"""
from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench._report import publish
from fxpipe.runtime.execution.ports import free_port  # torch-free

SECTION = "auto-memory"
ROOT = Path(__file__).resolve().parents[1]
WIDTH, LAYERS, CLASSES, BATCH = 2048, 12, 16, 2
PIPELINE = {"max_cost": None, "where": "pipeline"}
"""auto_options of the job that measures the pilot on the job's own pipeline (issue 25): the
candidates in turn, each rank training only its stage, the winner continuing from its pilot."""
PILOT = {"max_memory": None, "max_cost": None, "where": "copies"}
"""auto_options of the job that measures the pilot on copies (the default): no
limit relative to training's memory or time (the check against the rank's available memory
stays)."""
BEFORE = (
    "Before this change (commit 9ca0b56: the same script, its jobs run on that commit's code in "
    "a git worktree): the default's decision peaked at 1,611 MiB on rank 0 and 1,592 MiB on "
    "rank 1 without running a pilot (its probe, pipedream on a deep copy of the whole model "
    "after the 200 pilot minibatches were read, timed the pilot out: higher than the named run's "
    "whole peak on both ranks), and at 1,886 MiB and 2,697 MiB with the pilot run "
    "(`max_cost=None`; every candidate deep-copied the whole model, the 200 minibatches held "
    "throughout).")


# ----------------------------------------------------------------------------- the worker
def _inputs(idx):
    """Minibatch inputs made from their sample indices (the same on every rank and pass)."""
    import torch

    g = torch.Generator().manual_seed(int(idx[0]))
    return torch.randn(len(idx), WIDTH, generator=g)


def _targets(idx):
    import torch

    g = torch.Generator().manual_seed(int(idx[0]) + 7)
    return torch.randint(0, CLASSES, (len(idx),), generator=g)


def _optimizer(params):
    import torch

    return torch.optim.SGD(params, lr=0.01, momentum=0.9)


def _status_kib(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


class _Decided(Exception):
    """Raised from ``auto_options["report"]`` to end a decision-only run once auto chose."""


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    import fxpipe
    from fxpipe.runtime.training.data import ShardedDataset

    torch.set_num_threads(1)
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(LAYERS):
        layers += [nn.Linear(WIDTH, WIDTH), nn.Tanh()]
    model = nn.Sequential(*layers, nn.Linear(WIDTH, CLASSES))
    cluster = fxpipe.Cluster.from_env(bandwidth="10Gbps", device="CPU")  # estimated: one split
    compiled = fxpipe.compile(model, cluster,
                              example_inputs=(_inputs(torch.arange(BATCH)),),
                              loss_fn=F.cross_entropy, stages=2, straight=True, repeats=2)
    loader = ShardedDataset(_inputs, _targets, batch_size=BATCH, num_samples=BATCH * args.n,
                            shuffle=False)
    kw: dict = {} if args.schedule == "auto" else {"schedule": args.schedule}
    decided: list[float] = []

    def report(decision) -> None:  # the decision is made: the peak so far is the decision's
        decided[:] = [time.perf_counter(), _status_kib("VmHWM")]
        if args.decision_only:
            raise _Decided

    if args.schedule == "auto":
        kw["auto_options"] = {**json.loads(args.auto_options), "report": report}
    trainer = compiled.trainer(optimizer=_optimizer, progress=False, **kw)
    before = _status_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS: the peak of fit alone
    t0 = time.perf_counter()
    try:
        history = trainer.fit(loader, epochs=1)
    except _Decided:
        history = [{"loss": float("nan")}]
    wall = time.perf_counter() - t0
    decision = trainer.auto_decision
    end, peak = _status_kib("VmRSS"), _status_kib("VmHWM")
    ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    out = {"rank": int(os.environ["RANK"]), "rss_before_kib": before,
           "fit_peak_kib": peak, "decision_peak_kib": decided[1] if decided else None,
           "end_kib": end, "trimmed_kib": _status_kib("VmRSS"),
           "process_peak_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
           "wall_s": wall, "decision_s": decided[0] - t0 if decided else None,
           "loss": history[-1]["loss"], "schedule": trainer.schedule_name,
           "decision": decision.summary() if decision is not None else None,
           "parameters": sum(p.numel() for p in model.parameters()),
           "stage_parameters": [sum(p.numel() for p in st.gm.parameters())
                                for st in compiled.stage_specs]}
    Path(args.result).with_suffix(f".rank{out['rank']}.json").write_text(json.dumps(out))
    trainer.close()


# ----------------------------------------------------------------------------- the parent

def job(schedule: str, n: int, auto_options: dict | None = None,
        decision_only: bool = False) -> dict:
    """One torchrun job of 2 ranks; every rank's report. ``decision_only``: ``fit`` ends when
    auto has decided (raised from its ``report`` hook), to measure the decision alone."""
    with tempfile.TemporaryDirectory() as tmp:
        result = str(Path(tmp) / "r")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
               "--master-addr=127.0.0.1", f"--master-port={free_port()}", "-m", "bench.auto_memory",
               "--bench-worker", "--epoch-minibatches", str(n), "--train-schedule", schedule,
               "--auto-options", json.dumps(auto_options or {}), "--result-file", result]
        if decision_only:
            cmd.append("--decision-only")
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=4 * 3600)
        if proc.returncode != 0:
            raise SystemExit(f"job failed ({' '.join(cmd)}):\n{proc.stdout[-3000:]}"
                             f"{proc.stderr[-3000:]}")
        ranks = [json.loads(p.read_text()) for p in sorted(Path(tmp).glob("r.rank*.json"))]
        return {"schedule": schedule, "n": n, "ranks": ranks, "job_s": time.perf_counter() - t0,
                "auto_options": auto_options or {}, "decision_only": decision_only}


def _mib(kib: int) -> str:
    return f"{kib / 1024:,.0f} MiB"


def page(runs: dict[str, dict]) -> str:
    import torch

    auto, named, pilot = runs["auto"], runs["1f1b-flush"], runs["pilot"]
    r0 = auto["ranks"][0]
    load = ", ".join(f"{v:.1f}" for v in os.getloadavg())
    stages = ", ".join(f"{p / 1e6:.1f}M" for p in r0["stage_parameters"])
    peak = {r["rank"]: r["fit_peak_kib"] for r in named["ranks"]}
    lines = [
        "## Memory of the default schedule (auto) against a named one",
        "",
        f"Command: `.venv/bin/python -m bench.auto_memory` (from the repository root; "
        f"{os.cpu_count()} CPU cores shared with other jobs (load average {load} at the end), "
        f"torch {torch.__version__}, Python {platform.python_version()}, 2 torchrun ranks, "
        f"1 thread each, gloo; the {len(runs)} jobs took "
        f"{sum(r['job_s'] for r in runs.values()):.0f} s in all)",
        "",
        f"A 2-stage MLP of {r0['parameters'] / 1e6:.1f}M parameters (12 x `Linear(2048, 2048)` "
        f"+ `Linear(2048, 16)`, stages of {stages}, every parameter trained by SGD with "
        f"momentum 0.9) trains one epoch of {auto['n']:,} minibatches of {BATCH} samples from a "
        "lazy `ShardedDataset` (callables make each minibatch from its index when it is read; "
        "nothing is materialised), once with `compiled.trainer(...)`'s default "
        "`schedule=\"auto\"` (the decision included) and once with `schedule=\"1f1b-flush\"` "
        "named. Per rank: resident memory before `fit`; its peak (`VmHWM`, reset just before "
        "`fit`, so the compile does not count) until auto had decided (its `report` hook) and "
        "over the whole of `fit`; what is resident at the end of `fit`, and after "
        "`malloc_trim(0)` (glibc hands freed heap memory back: what stays is what is in use); "
        "and the whole process's peak (`ru_maxrss`, the compile included):",
        "",
        "| rank | run | before fit | peak until decided | peak during fit | at the end | "
        "after malloc_trim | process peak | fit wall time |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, run in (("auto", auto), ("1f1b-flush", named)):
        for r in run["ranks"]:
            label = f"default (auto -> {r['schedule']})" if name == "auto" else "named 1f1b-flush"
            until = _mib(r["decision_peak_kib"]) if r["decision_peak_kib"] else "-"
            lines.append(f"| {r['rank']} | {label} | {_mib(r['rss_before_kib'])} | {until} | "
                         f"{_mib(r['fit_peak_kib'])} | {_mib(r['end_kib'])} | "
                         f"{_mib(r['trimmed_kib'])} | {_mib(r['process_peak_kib'])} | "
                         f"{r['wall_s']:.0f} s |")
    lines += [
        "",
        "Peak during `fit`, default / named: " + ", ".join(
            f"rank {r['rank']} {r['fit_peak_kib'] / peak[r['rank']]:.2f}x" for r in auto["ranks"])
        + " (goal: within 1.2x); the default's peak until it had decided / the named run's "
        "whole peak: " + ", ".join(
            f"rank {r['rank']} {r['decision_peak_kib'] / peak[r['rank']]:.2f}x"
            for r in auto["ranks"] if r["decision_peak_kib"]) + ".",
        "",
        "Where a rank's peak during `fit` is above its peak until decided, the difference came "
        "later, while training the schedule auto chose, not from the decision; the last two "
        "memory columns tell memory in use at the end from freed memory glibc kept.",
        "",
        "What the default decided (rank 0's `Decision.summary()`, also in the log):",
        "",
        "```",
        r0["decision"] or "",
        "```",
        "",
        "The pilot on copies (`where=\"copies\"`, the default), measured: the "
        "same job with `auto_options={\"max_memory\": None, \"max_cost\": None, "
        "\"where\": \"copies\"}` (no limit relative to training's memory or time; the check "
        "against the rank's available memory stays), `fit` ended as soon as auto had decided "
        "(raised from its `report` hook; the decision is the whole of this measurement). Each "
        "rank trains its share of the candidates on copies of the whole model, one candidate at "
        "a time, its minibatches read a training segment at a time:",
        "",
        "| rank | peak during the decision | / named 1f1b-flush's whole run | decision time |",
        "|---:|---:|---:|---:|"]
    for r in pilot["ranks"]:
        lines.append(f"| {r['rank']} | {_mib(r['fit_peak_kib'])} | "
                     f"{r['fit_peak_kib'] / peak[r['rank']]:.2f}x | {r['decision_s']:.0f} s |")
    lines += [
        "",
        "```",
        pilot["ranks"][0]["decision"] or "",
        "```"]
    if "pipeline" in runs:
        lines += [
            "",
            "The pilot on the job's own pipeline (`auto_options={\"max_cost\": None, "
            "\"where\": \"pipeline\"}`, issue 25), measured the same way (`fit` ended at the "
            "decision): the candidates train in turn, each rank only its own stage, every "
            "candidate from the same initial weights; each rank keeps flush's and the best "
            "asynchronous candidate's end state on disk, and the winner goes on from its pilot:",
            "",
            "| rank | peak during the decision | / named 1f1b-flush's whole run | decision time |",
            "|---:|---:|---:|---:|"]
        for r in runs["pipeline"]["ranks"]:
            lines.append(f"| {r['rank']} | {_mib(r['fit_peak_kib'])} | "
                         f"{r['fit_peak_kib'] / peak[r['rank']]:.2f}x | "
                         f"{r['decision_s']:.0f} s |")
        lines += ["", "```", runs["pipeline"]["ranks"][0]["decision"] or "", "```"]
    lines += [
        "",
        BEFORE,
        "",
        "Single runs, the jobs one after the other; the peaks are high-water marks, so the "
        "load of the shared cores changes the wall times, not the peaks."]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    # the worker's options (after the script in a torchrun command line; torchrun would take an
    # abbreviation of its own options for one of them)
    ap.add_argument("--bench-worker", dest="worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--epoch-minibatches", dest="n", type=int, default=20_000,
                    help="minibatches of the epoch (default 20,000)")
    ap.add_argument("--train-schedule", dest="schedule", default="auto", help=argparse.SUPPRESS)
    ap.add_argument("--result-file", dest="result", default="", help=argparse.SUPPRESS)
    ap.add_argument("--auto-options", dest="auto_options", default="{}", help=argparse.SUPPRESS)
    ap.add_argument("--decision-only", dest="decision_only", action="store_true",
                    help=argparse.SUPPRESS)
    ap.add_argument("--json", default=None, help="also write the raw reports here (after "
                    "every job)")
    ap.add_argument("--resume", action="store_true", help="with --json: keep the jobs that "
                    "file already holds for the same --epoch-minibatches, run the others")
    ap.add_argument("--out", default=None, help="write the markdown here instead of "
                    "benchmarks/auto-memory.md")
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    jobs = {"auto": ("auto", None, False), "1f1b-flush": ("1f1b-flush", None, False),
            "pilot": ("auto", PILOT, True), "pipeline": ("auto", PIPELINE, True)}
    runs: dict[str, dict] = {}
    if args.resume and args.json and Path(args.json).exists():  # jobs a cut-short run finished
        runs = {k: v for k, v in json.loads(Path(args.json).read_text()).items()
                if k in jobs and v.get("n") == args.n}
        print(f"resuming: {', '.join(runs) or 'nothing'} already measured", file=sys.stderr)
    for name, (schedule, options, decision_only) in jobs.items():
        if name in runs:
            continue
        runs[name] = job(schedule, args.n, options, decision_only=decision_only)
        if args.json:  # after every job: a run cut short keeps what it measured
            Path(args.json).write_text(json.dumps(runs, indent=1))
    publish(SECTION, page(runs), args.out)


if __name__ == "__main__":
    main()
