"""Markdown tables of the emulated-cluster experiment from OUT/summary.json (see run.py).

    .venv/bin/python -m bench.experiment.report /tmp/fxpipe-cluster-experiment/summary.json
"""
from __future__ import annotations

import json
import statistics
import sys

from .common import measured_s_per_minibatch, time_to


def _f(v, fmt: str = ".1f", none: str = "not reached") -> str:
    return none if v is None else format(v, fmt)


def _prediction(res: dict, plans: dict, key: str, batch: int,
                ddp: str) -> tuple[float | None, float | None]:
    mode = res["mode"]
    if mode == "ddp":  # ddp: minibatches split over the hosts; dp: whole ones (round robin)
        p = plans["plans"].get(f"{ddp}@{key}", {})
        return p.get("planner_s_per_minibatch"), p.get("sim_s_per_minibatch_epoch")
    p = plans["plans"][f"{'fxpipe' if mode in ('fxpipe', 'auto') else 'straight'}@{key}"]
    if mode == "flush" or (mode == "auto" and res.get("schedule") != "pipedream"):
        return None, None  # the planner and the simulator time pipedream's schedule only
        return None, None
    if mode == "mp":
        return p["mp_planner_s_per_minibatch"], p["mp_sim_s_per_minibatch_epoch"]
    return p["planner_s_per_minibatch"], p["sim_s_per_minibatch_epoch"]


def _compute(res: dict, plans: dict, key: str, batch: int) -> str:
    """Per rank: the profiled compute of one minibatch on its stage (forward + backward +
    update of ONE replica, what the plan assumes, without the replicas' sync) against what the
    runtime's timeline measured on that rank (forward + backward + optimizer spans of the
    segments after the first), both per ``batch`` samples."""
    from fxpipe.passes import Plan

    busy = res.get("busy_s_per_sample") or []
    if res["mode"] == "ddp" or not busy or not all(busy):
        return "-"
    mode = "fxpipe" if res["mode"] in ("fxpipe", "auto") else "straight"
    entry = plans["plans"].get(f"{mode}@{key}", {})
    plan = Plan.load(entry["path"]) if entry.get("path") else None
    stage_of = [s for s, r in enumerate(res["replicas"]) for _ in range(r)]  # rank order
    cells = []
    for rank, b in enumerate(busy):
        meas = sum(b.get(c, 0.0) for c in ("forward", "backward", "optimizer")) * batch
        st = plan.stages[stage_of[rank]] if plan and plan.replicas == res["replicas"] else None
        prof = "?" if st is None else f"{st.compute_s * st.replicas * 1e3:.1f}"
        cells.append(f"{prof} / {meas * 1e3:.1f}")
    return ", ".join(cells)


def table(results: list[dict], plans: dict, key: str, targets: list[float], batch: int,
          ddp_plan: str = "ddp") -> str:
    ddp = next((r for r in results if r["mode"] == "ddp"), None)
    head = ("| mode | replicas | " + " | ".join(f"time to {t:.0%} (s)" for t in targets) +
            " | speedup vs DDP | final acc | samples/s | wire bytes/sample (train) | vs DDP | "
            "planner ms/minibatch | sim ms/minibatch | measured ms/minibatch | planner err | "
            "sim err | compute per rank, ms: profiled / measured | loadavg (1 min) |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in results:
        tt = [time_to(r, t) for t in targets]
        sp = None
        if ddp is not None and tt[-1] is not None and time_to(ddp, targets[-1]) is not None:
            sp = time_to(ddp, targets[-1]) / tt[-1]
        bps = r["train_bytes_per_sample"]
        red = (1 - bps / ddp["train_bytes_per_sample"]) if ddp and bps is not None else None
        pred, sim = _prediction(r, plans, key, batch, ddp_plan)
        meas = measured_s_per_minibatch(r, batch)
        la = [e["loadavg"][0] for e in r["epochs"]]
        lines.append(
            f"| {r['mode']} | {r['replicas']} | " + " | ".join(_f(t) for t in tt) +
            f" | {_f(sp, '.2f', '-')}x | {r['final_accuracy']:.3f} | {r['samples_per_s']:.0f} | "
            f"{bps:,.0f} | {'-' if r['mode'] == 'ddp' else _f(-red * 100 if red is not None else None, '+.1f', '-') + '%'} | "
            f"{_f(pred and pred * 1e3, '.1f', '-')} | {_f(sim and sim * 1e3, '.1f', '-')} | "
            f"{meas * 1e3:.1f} | {_f(pred and (pred / meas - 1) * 100, '+.0f', '-')}% | "
            f"{_f(sim and (sim / meas - 1) * 100, '+.0f', '-')}% | "
            f"{_compute(r, plans, key, batch)} | {min(la):.2f}-{max(la):.2f} |")
    return "\n".join(lines)


def seeds_table(results: list[dict], target: float) -> tuple[str, dict]:
    """Per mode over seeds: time to ``target`` (each seed, mean ± sd), final accuracy, samples/s;
    and whether auto is within the seed spread of the better of pipedream (fxpipe) and flush."""
    modes: dict[str, list[dict]] = {}
    for r in results:
        modes.setdefault(r["mode"], []).append(r)

    def ms(xs: list[float]) -> tuple[float, float]:
        return statistics.fmean(xs), statistics.stdev(xs) if len(xs) > 1 else 0.0

    stats: dict[str, tuple[float, float] | None] = {}
    lines = [f"| mode | schedule (per seed) | time to {target:.0%} per seed (s) | mean ± sd (s) | "
             "final acc mean ± sd | samples/s mean ± sd |", "|---|---|---|---|---|---|"]
    for mode, rs in modes.items():
        tt = [time_to(r, target) for r in rs]
        got = [t for t in tt if t is not None]
        stats[mode] = ms(got) if len(got) == len(tt) else None
        acc = ms([r["final_accuracy"] for r in rs])
        sps = ms([r["samples_per_s"] for r in rs])
        scheds = ", ".join(str(r.get("schedule", "-")) for r in rs)
        lines.append(f"| {mode} | {scheds} | {', '.join(_f(t) for t in tt)} | "
                     f"{'-' if stats[mode] is None else f'{stats[mode][0]:.2f} ± {stats[mode][1]:.2f}'}"
                     f" | {acc[0]:.3f} ± {acc[1]:.3f} | {sps[0]:.0f} ± {sps[1]:.0f} |")
    verdict = {}
    two = [(stats[m], m) for m in ("fxpipe", "flush") if stats.get(m) is not None]
    if "auto" in stats and two:
        best, best_mode = min(two)
        verdict = {"auto": stats["auto"], "best": best, "best_mode": best_mode,
                   "within": stats["auto"] is not None and stats["auto"][0] <= best[0] + best[1],
                   "same_as": same_updates(modes)}
    return "\n".join(lines), verdict


def same_updates(modes: dict[str, list[dict]]) -> str | None:
    """The mode (fxpipe or flush) whose test accuracy after every epoch auto matched exactly in
    every seed, i.e. whose updates it made; None if neither."""
    def accs(r: dict) -> list[float]:
        return [e["test_accuracy"] for e in r["epochs"]]

    auto = {r.get("seed", 0): accs(r) for r in modes.get("auto", [])}
    for mode in ("fxpipe", "flush"):
        other = {r.get("seed", 0): accs(r) for r in modes.get(mode, [])}
        if auto and all(other.get(s) == a for s, a in auto.items()):
            return mode
    return None


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
        pl = summary["plans"]["plans"]
        opt = pl.get(f"optimum@{key}")
        why = "" if opt is None else (
            f"; the planner's analytic optimum is {opt['replicas']} at "
            f"{opt['planner_s_per_minibatch'] * 1e3:.1f} ms/minibatch, simulated "
            f"{opt['sim_steady_s_per_minibatch'] * 1e3:.1f} ms")
        first = [r for r in results if r.get("seed", 0) == 0]
        seeds = sorted({r.get("seed", 0) for r in results})
        text, verdict = seeds_table(results, a["target"])
        out += [f"**{key} Mbit/s** (fxpipe plan {pl[f'fxpipe@{key}']['replicas']}, chosen by "
                f"simulation, {pl[f'fxpipe@{key}']['sim_steady_s_per_minibatch'] * 1e3:.1f} "
                f"ms/minibatch simulated{why}); over seeds {seeds}:",
                "", text, ""]
        if verdict:
            out += [f"auto: {verdict['auto'][0]:.2f} ± {verdict['auto'][1]:.2f} s to "
                    f"{a['target']:.0%} against {verdict['best'][0]:.2f} ± {verdict['best'][1]:.2f}"
                    f" s for the better of fxpipe (pipedream) and flush: "
                    f"{'within' if verdict['within'] else 'NOT within'} the seed spread."
                    + ("" if verdict["same_as"] is None else
                       f" auto made exactly {verdict['same_as']}'s updates (the same test "
                       "accuracy after every epoch, every seed)"
                       + (": the times differ by the machine's speed alone."
                          if verdict["same_as"] == verdict["best_mode"] else ".")), ""]
        out += ["Seed 0 in detail:", "", table(first, summary["plans"], key, targets, a["batch"]),
                ""]
    if summary.get("harm"):
        hkey = f"{a['harm_mbit']:g}"
        hp = summary["harm_plans"]
        out += [f"**Do-no-harm: model `small` ({hp['param_bytes'] / 1e3:.0f} KB of parameters) at "
                f"{hkey} Mbit/s**: the planner picks {hp['plans'][f'fxpipe@{hkey}']['replicas']} "
                f"(data parallelism; predicted {hp['plans'][f'fxpipe@{hkey}']['planner_s_per_minibatch'] * 1e3:.2f} "
                f"ms/minibatch vs straight pipeline {hp['plans'][f'straight@{hkey}']['planner_s_per_minibatch'] * 1e3:.2f} ms)",
                "", table(summary["harm"], hp, hkey, targets, a["batch"], ddp_plan="dp"), ""]
        pairs = summary.get("harm_runs") or [summary["harm"]]
        ratios = [f["samples_per_s"] / d["samples_per_s"] for f, d in pairs]
        after = [f["samples_per_s_after_first"] / d["samples_per_s_after_first"]
                 for f, d in pairs if f["samples_per_s_after_first"] and d["samples_per_s_after_first"]]
        out += [f"fxpipe / DDP samples/s over {len(pairs)} alternating repeats (fxpipe, ddp, "
                f"fxpipe, ...; the table shows the first): median {statistics.median(ratios):.3f} "
                f"(each: {', '.join(f'{x:.3f}' for x in ratios)}); after epoch 1: median "
                f"{_f(statistics.median(after) if after else None, '.3f', '-')} "
                f"(each: {', '.join(f'{x:.3f}' for x in after)})", ""]
    return "\n".join(out)


if __name__ == "__main__":
    print(report(json.loads(open(sys.argv[1]).read())))
