"""Markdown tables of the emulated-cluster experiment from OUT/summary.json (see run.py).

    .venv/bin/python -m bench.experiment.report /tmp/fxpipe-cluster-experiment/summary.json
"""
from __future__ import annotations

import json
import sys

from .run import measured_s_per_minibatch, time_to


def _f(v, fmt: str = ".1f", none: str = "not reached") -> str:
    return none if v is None else format(v, fmt)


def _prediction(res: dict, plans: dict, key: str, batch: int) -> tuple[float | None, float | None]:
    mode = res["mode"]
    if mode == "ddp":
        p = plans["plans"].get(f"dp@{key}", {})
        return p.get("planner_s_per_minibatch"), p.get("sim_s_per_minibatch_epoch")
    p = plans["plans"][f"{'fxpipe' if mode == 'fxpipe' else 'straight'}@{key}"]
    if mode == "mp":
        return p["mp_planner_s_per_minibatch"], p["mp_sim_s_per_minibatch_epoch"]
    return p["planner_s_per_minibatch"], p["sim_s_per_minibatch_epoch"]


def table(results: list[dict], plans: dict, key: str, targets: list[float], batch: int) -> str:
    ddp = next((r for r in results if r["mode"] == "ddp"), None)
    head = ("| mode | replicas | " + " | ".join(f"time to {t:.0%} (s)" for t in targets) +
            " | speedup vs DDP | final acc | samples/s | wire bytes/sample (train) | vs DDP | "
            "planner ms/minibatch | sim ms/minibatch | measured ms/minibatch | planner err | "
            "sim err | loadavg (1 min) |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in results:
        tt = [time_to(r, t) for t in targets]
        sp = None
        if ddp is not None and tt[-1] is not None and time_to(ddp, targets[-1]) is not None:
            sp = time_to(ddp, targets[-1]) / tt[-1]
        bps = r["train_bytes_per_sample"]
        red = (1 - bps / ddp["train_bytes_per_sample"]) if ddp and bps is not None else None
        pred, sim = _prediction(r, plans, key, batch)
        meas = measured_s_per_minibatch(r, batch)
        la = [e["loadavg"][0] for e in r["epochs"]]
        lines.append(
            f"| {r['mode']} | {r['replicas']} | " + " | ".join(_f(t) for t in tt) +
            f" | {_f(sp, '.2f', '-')}x | {r['final_accuracy']:.3f} | {r['samples_per_s']:.0f} | "
            f"{bps:,.0f} | {'-' if r['mode'] == 'ddp' else _f(-red * 100 if red is not None else None, '+.1f', '-') + '%'} | "
            f"{_f(pred and pred * 1e3, '.1f', '-')} | {_f(sim and sim * 1e3, '.1f', '-')} | "
            f"{meas * 1e3:.1f} | {_f(pred and (pred / meas - 1) * 100, '+.0f', '-')}% | "
            f"{_f(sim and (sim / meas - 1) * 100, '+.0f', '-')}% | "
            f"{min(la):.2f}-{max(la):.2f} |")
    return "\n".join(lines)


def report(summary: dict) -> str:
    a = summary["args"]
    targets = sorted({0.90, a["target"]})
    out = ["### Emulated 2-host cluster: time to accuracy, throughput, bytes on the wire",
           "",
           "Command: `.venv/bin/python -m bench.experiment.run` (as root; "
           f"driver took {summary.get('driver_s', 0) / 60:.1f} min; load average "
           f"{summary['loadavg_start'][0]} at start, {summary.get('loadavg_end', ['?'])[0]} at end: "
           "other jobs shared the 2 cores). Details and figures: "
           "[docs/cluster-experiment.md](docs/cluster-experiment.md).",
           "",
           f"Model `bigtail` ({summary['plans']['param_bytes'] / 1e6:.2f} MB of fp32 parameters), "
           f"minibatch {a['batch']} (DDP: global batch {a['batch']}), SGD lr {a['lr']} momentum {a['momentum']}, "
           f"{a['epochs']} epochs (DDP stops once it reaches {a['target']:.0%}). Times are training "
           "time (evaluation excluded); bytes are interface tx counters of both hosts during "
           "training; ms/minibatch per "
           f"{a['batch']} samples, measured = median epoch time / minibatches (epoch 1 excluded; "
           "fill and drain included), sim = simulate_plan makespan / minibatches of one epoch.",
           ""]
    for key, results in summary["main"].items():
        out += [f"**{key} Mbit/s** (fxpipe plan {summary['plans']['plans'][f'fxpipe@{key}']['replicas']})",
                "", table(results, summary["plans"], key, targets, a["batch"]), ""]
    if summary.get("harm"):
        hkey = f"{a['harm_mbit']:g}"
        hp = summary["harm_plans"]
        out += [f"**Do-no-harm: model `small` ({hp['param_bytes'] / 1e3:.0f} KB of parameters) at "
                f"{hkey} Mbit/s**: the planner picks {hp['plans'][f'fxpipe@{hkey}']['replicas']} "
                f"(data parallelism; predicted {hp['plans'][f'fxpipe@{hkey}']['planner_s_per_minibatch'] * 1e3:.2f} "
                f"ms/minibatch vs straight pipeline {hp['plans'][f'straight@{hkey}']['planner_s_per_minibatch'] * 1e3:.2f} ms)",
                "", table(summary["harm"], hp, hkey, targets, a["batch"]), ""]
        f, d = summary["harm"]
        out += [f"fxpipe / DDP samples/s: {f['samples_per_s'] / d['samples_per_s']:.3f} "
                f"(after epoch 1: {_f(f['samples_per_s_after_first'] and f['samples_per_s_after_first'] / d['samples_per_s_after_first'], '.3f', '-')})", ""]
    return "\n".join(out)


if __name__ == "__main__":
    print(report(json.loads(open(sys.argv[1]).read())))
