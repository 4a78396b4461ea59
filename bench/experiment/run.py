"""The emulated-cluster experiment, end to end (issue 4, sections 1-3).

    .venv/bin/python -m bench.experiment.run            # 20, 50, 200 Mbit/s x 6 modes x 3 seeds
                                                        # + do-no-harm
    .venv/bin/python -m bench.experiment.run --smoke    # 1 epoch, one bandwidth: plumbing check

Needs root (network namespaces). For each bandwidth it brings up a 2-host EmulatedCluster (one
core per host, HTB-shaped links), launches bench/experiment/worker.py with torchrun multi-node
rendezvous on both hosts for each mode (fxpipe, straight, mp, flush, ddp, auto) and seed,
collects the per-rank JSON
logs and the hosts' interface counters, and tears the cluster down. Then the do-no-harm case
(a small model at 1 Gbit/s where the planner picks data parallelism): fxpipe vs ddp. Plans are
made first, on ONE core (bench/experiment/plan.py), and loaded by every rank.

Writes OUT/summary.json (default OUT=/tmp/fxpipe-cluster-experiment) and, unless --smoke or
--no-report, docs/figures/cluster-*.png and benchmarks/cluster-experiment.md.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from tools.cluster import EmulatedCluster, read_output, torchrun_across, wait_all

from .common import loadavg

ROOT = Path(__file__).resolve().parents[2]
FIGURES = ROOT / "docs" / "figures"
PY = sys.executable
log = logging.getLogger("bench.experiment")
MAIN_MODES = ("fxpipe", "straight", "mp", "flush", "ddp", "auto")


def make_plans(out: Path, model: str, batch: int, mbits: list[float]) -> dict:
    """Profile on one core (the last CPU we may use) and plan; returns plans-<model>-b<B>.json."""
    cpu = sorted(os.sched_getaffinity(0))[-1]
    cmd = ["taskset", "-c", str(cpu), PY, "-m", "bench.experiment.plan", str(out), "--model",
           model, "--batch", str(batch), "--mbit", *[f"{m:g}" for m in mbits]]
    subprocess.run(cmd, check=True, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return json.loads((out / f"plans-{model}-b{batch}.json").read_text())


def run_mode(mode: str, mbit: float, run_dir: Path, worker_args: list[str], timeout: float,
             hosts: int = 2) -> dict:
    """One mode at one bandwidth on a fresh cluster of ``hosts`` (2, or fewer when fxpipe's plan
    uses fewer workers than the cluster has); returns the merged result."""
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    la0 = loadavg()
    t0 = time.perf_counter()
    with EmulatedCluster(hosts=hosts, bandwidth=f"{mbit:g}Mbit", latency=0,
                         prefix="fxpexp") as c:
        before = [c.link_bytes(h) for h in range(c.hosts)]
        procs = torchrun_across(c, ["-m", "bench.experiment.worker", "--mode", mode,
                                    "--out", str(run_dir), *worker_args],
                                env={"PYTHONPATH": str(ROOT)}, log_dir=run_dir)
        codes = wait_all(procs, timeout=timeout)
        after = [c.link_bytes(h) for h in range(c.hosts)]
        if any(codes):
            for p in procs:
                print(read_output(p)[-3000:], file=sys.stderr)
            raise RuntimeError(f"{mode} at {mbit:g} Mbit/s failed: exit codes {codes}")
    ranks = [json.loads((run_dir / f"rank{r}.json").read_text()) for r in range(hosts)]
    res = merge(ranks)
    res.update(mode=mode, mbit=mbit, launcher_s=time.perf_counter() - t0,
               link_tx_bytes=[a["tx_bytes"] - b["tx_bytes"] for a, b in zip(after, before)],
               loadavg_before=la0, loadavg_after=loadavg())
    log.info("%s @ %g Mbit/s: %s", mode, mbit, {k: res[k] for k in ("final_accuracy",
             "samples_per_s", "train_bytes_per_sample")})
    return res


def merge(ranks: list[dict]) -> dict:
    """Per-epoch curve (rank 0's clock; accuracy is the same on every rank) plus wire bytes summed
    over ranks, training phases only (evaluation traffic is excluded; it is reported apart)."""
    r0 = ranks[0]
    epochs, train_bytes, eval_bytes = [], 0, 0
    for k, e in enumerate(r0["epochs"]):
        tb = eb = 0
        for r in ranks:
            ep = r["epochs"][k]
            prev = r["epochs"][k - 1]["net_eval_end"] if k else r["net_start"]
            tb += ep["net_train_end"]["tx_bytes"] - prev["tx_bytes"]
            eb += ep["net_eval_end"]["tx_bytes"] - ep["net_train_end"]["tx_bytes"]
        train_bytes += tb
        eval_bytes += eb
        epochs.append({**{k2: e[k2] for k2 in ("epoch", "train_time_s", "wall_s", "loss",
                                                "test_accuracy", "samples", "segment_time_s",
                                                "loadavg")},
                       "train_bytes_cum": train_bytes})
    samples = sum(e["samples"] for e in epochs)
    seg = sum(e["segment_time_s"] for e in epochs)
    return {"replicas": r0.get("replicas"), "epochs": epochs, "schedule": r0.get("schedule"),
            "auto": r0.get("auto"),
            "busy_s_per_sample": [r.get("busy_s_per_sample") for r in ranks],
            "final_accuracy": epochs[-1]["test_accuracy"] if epochs else None,
            "samples": samples, "samples_per_s": samples / seg if seg else None,
            "samples_per_s_after_first": (sum(e["samples"] for e in epochs[1:]) /
                                          sum(e["segment_time_s"] for e in epochs[1:])
                                          if len(epochs) > 1 else None),
            "train_bytes": train_bytes, "eval_bytes": eval_bytes,
            "train_bytes_per_sample": train_bytes / samples if samples else None,
            "loadavg_ranks": [[r["loadavg_start"], r["loadavg_end"]] for r in ranks]}


def plot(results: list[dict], mbit: float, target: float, path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for res in results:
        xs = [0.0] + [e["train_time_s"] for e in res["epochs"]]
        ys = [0.1] + [e["test_accuracy"] for e in res["epochs"]]
        ax.plot(xs, ys, marker="o", label=f"{res['mode']} {res['replicas']}")
    ax.axhline(target, color="grey", ls="--", lw=0.8)
    ax.set_xscale("symlog", linthresh=1.0)
    ax.set_xlabel("training time (s, evaluation excluded; symlog)")
    ax.set_ylabel("test accuracy")
    ax.set_title(title)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def harm_case(args: argparse.Namespace, out: Path, summary: dict) -> None:
    """Do-no-harm: the small model at --harm-mbit, where the planner picks data parallelism."""
    hb = args.batch
    hplans = make_plans(out / "plans", "small", hb, [args.harm_mbit])
    summary["harm_plans"] = hplans
    hkey = f"{args.harm_mbit:g}"
    hp = hplans["plans"][f"fxpipe@{hkey}"]
    # a one-stage plan with r replicas updates once per round of r minibatches of hb
    per_update = hb * hp["replicas"][0] if len(hp["replicas"]) == 1 else hb
    hc = ["--model", "small", "--batch", str(hb), "--global-batch", str(per_update),
          "--epochs", str(args.harm_epochs), "--lr", str(args.harm_lr),
          "--momentum", str(args.momentum)]
    runs = []
    for i in range(args.harm_repeats):  # alternating, so drifting machine load hits both alike
        runs.append([run_mode("fxpipe", args.harm_mbit, out / f"harm-{hkey}mbit" / f"fxpipe{i}",
                              [*hc, "--plan", hp["path"]], args.timeout),
                     run_mode("ddp", args.harm_mbit, out / f"harm-{hkey}mbit" / f"ddp{i}", hc,
                              args.timeout)])
    harm = runs[0]
    summary["harm"], summary["harm_runs"] = harm, runs
    if not args.no_report:  # the published figures: only with the published tables
        plot(harm, args.harm_mbit, args.target, FIGURES / f"cluster-do-no-harm-{hkey}mbit.png",
             f"do-no-harm: small model, 2 hosts x 1 core, {hkey} Mbit/s")
    (out / "summary.json").write_text(json.dumps(summary, indent=1))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--mbit", type=float, nargs="+", default=[20, 50, 200])
    p.add_argument("--modes", nargs="+", default=list(MAIN_MODES))
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.02)
    p.add_argument("--momentum", type=float, default=0.5,
                   help="0.9 makes PipeDream's stale-weight updates diverge on this model")
    p.add_argument("--target", type=float, default=0.90)
    p.add_argument("--harm-mbit", type=float, default=1000)
    p.add_argument("--harm-epochs", type=int, default=10)
    p.add_argument("--harm-repeats", type=int, default=3, help="alternating fxpipe/ddp pairs")
    p.add_argument("--harm-lr", type=float, default=0.05)
    p.add_argument("--no-harm-case", action="store_true")
    p.add_argument("--out", default="/tmp/fxpipe-cluster-experiment")
    p.add_argument("--smoke", action="store_true", help="1 epoch at the first bandwidth")
    p.add_argument("--no-report", action="store_true",
                   help="don't write benchmarks/cluster-experiment.md or docs/figures")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--seeds", type=int, default=3,
                   help="seeds per mode (model init and minibatch order 0..N-1)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if args.smoke:
        args.mbit, args.epochs, args.harm_epochs, args.no_report = args.mbit[:1], 1, 1, True
        args.harm_repeats = 1
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    summary: dict = {"args": vars(args), "loadavg_start": loadavg(), "main": {}, "harm": None}
    plans = make_plans(out / "plans", "bigtail", args.batch, args.mbit)
    summary["plans"] = plans
    common = ["--model", "bigtail", "--batch", str(args.batch), "--global-batch", str(args.batch),
              "--epochs", str(args.epochs), "--lr", str(args.lr), "--momentum", str(args.momentum)]
    for i, mbit in enumerate(args.mbit):
        if i == 1 and not args.no_harm_case:
            harm_case(args, out, summary)
        key = f"{mbit:g}"
        results = []
        for seed in range(args.seeds):  # all modes per seed: drifting load hits them alike
            for mode in args.modes:
                plan_mode = "fxpipe" if mode in ("fxpipe", "auto") else "straight"
                entry = plans["plans"][f"{plan_mode}@{key}"]
                wa = [*common, "--plan", entry["path"], "--seed", str(seed)]
                if mode == "ddp":
                    wa += ["--stop-at", str(args.target)]
                hosts = sum(entry["replicas"]) if mode != "ddp" else 2
                res = run_mode(mode, mbit, out / f"{key}mbit" / f"{mode}-s{seed}", wa,
                               args.timeout, hosts)
                res["seed"] = seed
                results.append(res)
            summary["main"][key] = results
            (out / "summary.json").write_text(json.dumps(summary, indent=1))
        if not args.no_report:
            plot([r for r in results if r["seed"] == 0], mbit, args.target,
                 FIGURES / f"cluster-acc-vs-time-{key}mbit.png",
                 f"digits, VGG-style big-tail CNN, 2 hosts x 1 core, {key} Mbit/s (seed 0)")
    if not args.no_harm_case and (len(args.mbit) == 1 or summary["harm"] is None):
        harm_case(args, out, summary)
    summary["driver_s"] = time.perf_counter() - started
    summary["loadavg_end"] = loadavg()
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    from .report import report
    text = report(summary)
    (out / "report.md").write_text(text)
    print(text)
    if not args.no_report:
        from bench._report import write_section
        write_section("cluster-experiment", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
