"""Turn the ablation's results into benchmarks/statistical-efficiency.md + figures.

    .venv/bin/python -m bench.ablation.report [--results bench/ablation/results.jsonl]

* **Target** per task and optimizer: what 1f1b-flush reaches, mean over seeds at S = 2, after 60%
  of the budget (accuracy rounded down, loss rounded up to 0.01), so the synchronous baseline
  reaches it with room to spare and a variant up to 1.67x slower still does within the budget.
* **Updates to target**: the first evaluation (every ``eval_every`` updates) at or past the
  target; mean +- sd over the seeds that reached it (``k/3`` says how many did). **Final**: the
  mean of the last 3 evaluations (diverged runs, whose loss became NaN, are counted apart).
* **Predicted time to target**: updates x the plan simulator's seconds per update for the
  variant, on an S-worker commodity cluster (estimated costs of the estimator's ``cpu`` device,
  10 Gbit/s, 20 us per message; pipedream variants at minibatch B, the microbatched ones at B/S
  with S microbatches per update; mitigations at pipedream's cost, their element-wise extra
  work not modelled; LocalSGD by formula, see :func:`localsgd_period`).
* **auto**: fxpipe.runtime.training.auto's own decision rule applied per seed to the first
  ``--pilot`` updates of every candidate's training losses, with the same simulated periods;
  then again on held-out seeds (``--heldout``, default 3-5 and 6-8, a table each: auto's
  candidates run with ``bench.ablation.run --first-seed 3`` / ``6``), scored against targets
  the held-out runs did not set. The pilot's own cost (:func:`pilot_ms`) is a column of its
  own, not part of auto's time: it is paid once per job, and these runs are a miniature of one.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
from collections import Counter, defaultdict
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from fxpipe.runtime.training.auto import DEFAULT_CANDIDATES

from .run import DEFAULT_OUT, SAME_AT_EVERY_DEPTH

ROOT = Path(__file__).resolve().parents[2]
ORDER = ("1f1b-flush", "gpipe", "zb-h1", "zb-h2", "2bw", "pipedream", "pipedream-nostash", "pipedream+vsync",
         "localsgd", "pipedream+lr_scale", "pipedream+predict", "pipedream+dc",
         "pipedream+momentum", "pipedream+predict+momentum")
MITIGATED = tuple(v for v in ORDER if v.startswith("pipedream+") and v != "pipedream+vsync")
AUTO_CANDIDATES = ("1f1b-flush", "gpipe", "zb-h1", "zb-h2", "2bw", "pipedream") + MITIGATED
# auto_picks replays the trainer's own default candidates (fxpipe.runtime.training.auto)
SAME_AS_FLUSH = ("gpipe", "zb-h1", "zb-h2")  # flush's updates exactly: its statistics


def load(path: str, seeds: set[int] | None = None
         ) -> dict[tuple[str, int, str, str], list[dict[str, Any]]]:
    """(task, S, variant, opt) -> records (one per seed, only ``seeds`` if given), with gpipe =
    flush's statistics and flush/2bw at S > 2 falling back to S = 2 where not run (marked
    ``fallback``)."""
    runs: dict[tuple[str, int, str, str], dict[int, dict[str, Any]]] = defaultdict(dict)
    for line in Path(path).read_text().splitlines():
        if line.strip():
            r = json.loads(line)
            if "error" not in r and (seeds is None or r["seed"] in seeds):
                runs[(r["task"], r["S"], r["variant"], r["opt"])][r["seed"]] = r
    out: dict[tuple[str, int, str, str], list[dict[str, Any]]] = {}
    tasks = {k[0] for k in runs}
    opts = {k[3] for k in runs}
    for t in tasks:
        for o in opts:
            for S in (2, 4, 8):
                for v in ORDER:
                    src = "1f1b-flush" if v in SAME_AS_FLUSH else v
                    recs = runs.get((t, S, src, o), {})
                    fallback = False
                    if src in SAME_AT_EVERY_DEPTH and S > 2:
                        base = runs.get((t, 2, src, o), {})
                        if len(recs) < len(base):
                            recs, fallback = base, True
                    if recs:
                        out[(t, S, v, o)] = [dict(r, fallback=fallback) for _, r in
                                             sorted(recs.items())]
    return out


def reached(rec: dict[str, Any], target: float, higher: bool) -> int | None:
    for u, m in rec["evals"]:
        if (m >= target) if higher else (m <= target):
            return u
    return None


def metric_at(rec: dict[str, Any], u: int) -> float:
    best = min(rec["evals"], key=lambda e: abs(e[0] - u))
    return best[1]


def final(rec: dict[str, Any]) -> float:
    """The metric at the end of the budget: mean of the last 3 evaluations (one is noisy)."""
    return statistics.fmean(m for _, m in rec["evals"][-3:])


def mean_sd(xs: list[float]) -> tuple[float, float]:
    if not xs:
        return math.nan, math.nan
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def fmt(m: float, s: float, digits: int = 3) -> str:
    if math.isnan(m):
        return "-"
    return f"{m:.{digits}g} ± {s:.{digits}g}" if s >= 0 else f"{m:.{digits}g}"


def updates_cell(st: dict[str, Any]) -> str:
    """Updates to target as the tables print it: mean ± sd (k/n seeds reached it)."""
    return f"{fmt(*st['updates'])} ({st['reached']}/{st['seeds']})"


# ----------------------------------------------------------------------------- throughput

def localsgd_period(plan: Any, average_every: int) -> float:
    """Seconds per round of LocalSGD across stage-interleaved replicas (R = S replicas of the
    S-stage plan, replica j's stage s on worker (s + j) mod S): a replica runs one minibatch at
    a time, so a round takes one replica's whole forward + backward + update (the plan's
    per-stage compute) plus each cut's activation and gradient transfer; the S replicas run in
    parallel without a bubble. Every ``average_every`` rounds the replicas average: a ring
    all-reduce of the whole model among the S workers, 2 (S - 1) / S x bytes / bandwidth plus
    2 (S - 1) message latencies. Each worker holds every stage (the whole model)."""
    from fxpipe.costmodel import Cluster
    from fxpipe.runtime.pricing.plansim import cut_bandwidth

    cluster = Cluster.from_dict(dict(plan.cluster))
    bw, lat, S = cut_bandwidth(cluster), cluster.latency, len(plan.stages)
    compute = sum(st.compute_s for st in plan.stages)
    comm = sum(2 * (st.input_bytes / bw + lat) for st in plan.stages[1:])
    params = sum(st.parameter_bytes for st in plan.stages)
    average = 2 * (S - 1) / S * params / bw + 2 * (S - 1) * lat
    return compute + comm + average / average_every


def periods(task_name: str, S: int) -> tuple[dict[str, float], dict[str, Any]]:
    """Simulated seconds per update of every variant (module doc) and what they came from."""
    import torch

    import fxpipe
    from fxpipe.passes import plan_for
    from fxpipe.runtime.pricing.plansim import minibatches_for, simulate_plan

    from .tasks import make_task
    from .train import CLUSTER, LOCALSGD_EVERY

    task = make_task(task_name)
    cluster = fxpipe.Cluster(workers=S, **CLUSTER)
    torch.manual_seed(0)
    kw = dict(loss_fn=task.loss_fn, tracer="symbolic_trace")
    big = fxpipe.compile(task.build(), cluster, example_inputs=(task.example(task.batch)[0],),
                         stages=S, straight=True, **kw)
    small = fxpipe.compile(task.build(), cluster, plan=big.plan,
                           example_inputs=(task.example(task.batch // S)[0],), **kw)
    names = small.profile.names
    micro_plan = plan_for(small.profile, cluster, [names.index(st.nodes[0])
                                                   for st in big.plan.stages], [1] * S)
    n = minibatches_for([1] * S)
    pd = simulate_plan(big.plan, big.profile, schedule="pipedream", minibatches=n)
    out = {v: pd.steady_state_period for v in ORDER if v.startswith("pipedream")}
    for kind in ("1f1b-flush", "gpipe", "zb-h1", "zb-h2", "2bw"):
        sim = simulate_plan(micro_plan, small.profile, schedule=kind, minibatches=n,
                            microbatches=S)
        out[kind] = sim.steady_state_period * S
    out["localsgd"] = localsgd_period(micro_plan, LOCALSGD_EVERY)
    # one minibatch of the whole model in one process (auto's pilot steps): every stage's compute
    info = {"plan": big.plan, "micro_plan": micro_plan,
            "whole_s": sum(st.compute_s for st in big.plan.stages)}
    return out, info


# ----------------------------------------------------------------------------- analysis

def targets(data: dict, tasks: list[str], opts: list[str]) -> dict[tuple[str, str], float]:
    """(task, opt) -> target (module doc)."""
    from .tasks import make_task

    out = {}
    for t in tasks:
        task = make_task(t)
        for o in opts:
            recs = data.get((t, 2, "1f1b-flush", o), [])
            if not recs:
                continue
            m = statistics.fmean(metric_at(r, int(0.6 * task.updates)) for r in recs)
            out[(t, o)] = (math.floor(m * 100) / 100 if task.higher_is_better
                           else math.ceil(m * 100) / 100)
    return out


def row_stats(recs: list[dict], target: float, higher: bool, period: float) -> dict[str, Any]:
    ups = [reached(r, target, higher) for r in recs]
    got = [u for u in ups if u is not None]
    m, s = mean_sd([float(u) for u in got])
    fm, fs = mean_sd([final(r) for r in recs if not r.get("diverged")])
    return {"updates": (m, s), "reached": len(got), "seeds": len(recs), "per_seed": ups,
            "final": (fm, fs), "time_ms": (m * period * 1e3, s * period * 1e3),
            "fallback": any(r.get("fallback") for r in recs),
            "diverged": sum(1 for r in recs if r.get("diverged"))}


def auto_picks(data: dict, t: str, S: int, o: str, per: dict[str, float], pilot: int
               ) -> list[str | None]:
    """fxpipe.runtime.training.auto.decide on each seed's first ``pilot`` updates (module doc)."""
    from fxpipe.runtime.training.auto import decide

    picks: list[str | None] = []
    seeds = len(data.get((t, S, "1f1b-flush", o), []))
    for i in range(seeds):
        curves = {}
        for v in DEFAULT_CANDIDATES:
            recs = data.get((t, S, v, o), [])
            if len(recs) > i:
                c = recs[i]["train_losses"][:pilot]
                curves[v] = [math.inf if x is None else x for x in c]
        if "1f1b-flush" not in curves:
            picks.append(None)
            continue
        curves = {v: c for v, c in curves.items() if len(c) == pilot}
        picks.append(decide(curves, {v: per[v] for v in curves}).schedule)
    return picks


def pilot_ms(whole_s: float, S: int, pilot: int) -> float:
    """What auto's pilot costs before training starts, in ms on the simulated cluster: the
    trained candidates (4 by default: gpipe and the zero-bubble kinds reuse flush's curve)
    split over the S ranks, each ``pilot`` whole-model steps in one process."""
    from fxpipe.runtime.training.auto import trained

    return math.ceil(len(trained(DEFAULT_CANDIDATES)) / S) * pilot * whole_s * 1e3


def auto_table(data: dict, stats: dict, tasks: list[str], opts: list[str],
               per: dict[tuple[str, int], dict[str, float]], pilot: int,
               whole: dict[tuple[str, int], float] | None = None
               ) -> tuple[list[str], list[int]]:
    """The auto table's rows (each seed's pick, its predicted time to target against the better
    of pipedream and flush over the same seeds, and, given ``whole`` (seconds of one
    whole-model step per task and depth), the pilot's own cost, which the comparison leaves
    out) and [rows within the spread, rows]."""
    lines: list[str] = []
    lines.append("| task | S | optimizer | picks (seeds) | picks reaching the target | auto ms "
                 "| better of pipedream/flush ms | within spread |"
                 + (" pilot ms (not in auto ms) |" if whole else ""))
    lines.append("|---|---:|---|---|---:|---:|---:|---|" + ("---:|" if whole else ""))
    auto_ok = [0, 0]
    for t in tasks:
        for S in (2, 4, 8):
            for o in opts:
                if (t, S, "1f1b-flush", o) not in stats or (t, S, "pipedream", o) not in data:
                    continue  # auto's rival was not run here: nothing to compare
                picks = auto_picks(data, t, S, o, per[(t, S)], pilot)
                times = []
                for i, v in enumerate(picks):
                    st = stats.get((t, S, v, o)) if v else None
                    u = st["per_seed"][i] if st and i < len(st["per_seed"]) else None
                    times.append(math.inf if u is None else u * per[(t, S)][v] * 1e3)
                am = statistics.fmean(times) if times else math.nan
                asd = statistics.stdev(times) if len(times) > 1 and all(map(math.isfinite, times)) else 0
                two = [stats[(t, S, v, o)] for v in ("pipedream", "1f1b-flush")
                       if (t, S, v, o) in stats and stats[(t, S, v, o)]["reached"] ==
                       stats[(t, S, v, o)]["seeds"]]
                bt = min(two, key=lambda s: s["time_ms"][0]) if two else None
                ok = bt is not None and am <= bt["time_ms"][0] + bt["time_ms"][1]
                auto_ok[0] += ok
                auto_ok[1] += 1
                hit = sum(map(math.isfinite, times))
                cost = f" {pilot_ms(whole[(t, S)], S, pilot):.3g} |" if whole else ""
                lines.append(f"| {t} | {S} | {o} | {', '.join(p or '?' for p in picks)} | "
                             f"{hit}/{len(times)} | {fmt(am, asd)} | {fmt(*bt['time_ms']) if bt else '-'} | "
                             f"{'yes' if ok else 'no'} |{cost}")
    lines.append("")
    return lines, auto_ok


# ----------------------------------------------------------------------------- output

def figure(data: dict, stats: dict, tasks: list[str], opts: list[str], path: Path,
           key: str = "updates") -> None:
    """Updates (``key="updates"``) or predicted time (``"time_ms"``) to target relative to
    flush's, every variant, task x depth, one marker per optimizer (mean over the seeds that
    reached it; a cross at the top: no seed reached it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(tasks), 3, figsize=(15, 3.6 * len(tasks)), squeeze=False,
                             sharey=True)
    colors = dict(zip(opts, ("tab:blue", "tab:orange", "tab:green", "tab:red")))
    top = 4.0
    for i, t in enumerate(tasks):
        for j, S in enumerate((2, 4, 8)):
            ax = axes[i][j]
            for k, o in enumerate(opts):
                base = stats.get((t, S, "1f1b-flush", o))
                if base is None or math.isnan(base[key][0]):
                    continue
                for x, v in enumerate(ORDER):
                    st = stats.get((t, S, v, o))
                    if st is None:
                        continue
                    r = st[key][0] / base[key][0]
                    xx = x + (k - 1.5) * 0.15
                    if math.isnan(r):
                        ax.plot(xx, top, "x", color=colors[o])
                    else:
                        ax.plot(xx, min(r, top), "o", color=colors[o],
                                label=o if (x == 0 and i == 0 and j == 0) else None)
            ax.axhline(1.0, color="k", lw=0.8)
            ax.axhline(1.1, color="k", lw=0.6, ls="--")
            ax.set_yscale("log")
            ax.set_ylim(0.5, top * 1.15)
            ax.set_xticks(range(len(ORDER)))
            ax.set_xticklabels([v.replace("pipedream", "pd") for v in ORDER], rotation=60,
                               ha="right", fontsize=7)
            ax.set_title(f"{t}, S = {S}", fontsize=10)
            if j == 0:
                ax.set_ylabel(("updates" if key == "updates" else "predicted time")
                              + " to target / flush's")
    axes[0][0].legend(fontsize=8, loc="upper left")
    what = "Updates" if key == "updates" else "Predicted time (simulated commodity cluster)"
    fig.suptitle(f"{what} to target relative to 1f1b-flush (mean over the seeds run, 1 to 3: "
                 "see benchmarks/statistical-efficiency.md; x = never within the budget; dashed: 1.1x)", fontsize=11)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown(data: dict, results: str, pilot: int, fig_rel: str,
             held: list[dict] | None = None) -> tuple[str, dict]:
    from fxpipe.runtime.schedules.staleness import format_table, staleness_table

    from .tasks import make_task

    tasks = [t for t in ("mlp", "cnn", "lm") if any(k[0] == t for k in data)]
    opts = [o for o in ("sgd0", "sgd0.5", "sgd0.9", "adamw") if any(k[3] == o for k in data)]
    tgt = targets(data, tasks, opts)
    got = {(t, S): periods(t, S) for t in tasks for S in (2, 4, 8)}
    per = {k: v[0] for k, v in got.items()}
    whole = {k: v[1]["whole_s"] for k, v in got.items()}
    def all_stats(runs: dict) -> dict[tuple[str, int, str, str], dict[str, Any]]:
        return {(t, S, v, o): row_stats(recs, tgt[(t, o)], make_task(t).higher_is_better,
                                        per[(t, S)][v])
                for (t, S, v, o), recs in runs.items() if (t, o) in tgt}

    stats = all_stats(data)
    lines: list[str] = []
    lines.append("**Staleness** (`fxpipe.runtime.schedules.staleness`, also in `plan.summary()`): own "
                 "updates / global block updates, steady state, straight S = 4 pipeline:")
    lines += ["", "```", format_table(staleness_table([1] * 4)), "```", ""]
    lines.append("Input stage of pipedream at S = 2, 4, 8: "
                 + ", ".join(f"{st.stages[0].own}/{st.stages[0].global_}" for st in
                             (staleness_table([1] * S, ["pipedream"])["pipedream"]
                              for S in (2, 4, 8)))
                 + " (Randomized PipeDream's S^2 - S/2 = 3, 14, 60).")
    lines.append("")
    # the goal
    lines.append("**The goal** (pipedream with its best mitigation within 1.1x flush's updates "
                 "to target, S = 4 and 8). Updates to target: mean ± sd over the seeds that "
                 "reached it, (k/n) seeds reached it; ratios are of those means to flush's; the "
                 "best mitigation is the one with the smallest ratio among those that reached "
                 "the target in every seed run; `-`: no seed reached it within the budget.")
    lines.append("")
    lines.append("| task | S | optimizer | target | flush updates | pipedream updates | ratio "
                 "| best mitigation | its updates | its ratio | within 1.1x "
                 "| fastest predicted time to target |")
    lines.append("|---|---:|---|---:|---:|---:|---:|---|---:|---:|---|---|")
    goal = {}
    for t in tasks:
        for S in (4, 8):
            for o in opts:
                b = stats.get((t, S, "1f1b-flush", o))
                if b is None or (t, S, "pipedream", o) not in stats:
                    continue  # the asynchronous side was not run at this depth
                fu = b["updates"][0]
                ratio = lambda v: stats[(t, S, v, o)]["updates"][0] / fu  # noqa: E731
                pdr = ratio("pipedream") if (t, S, "pipedream", o) in stats else math.nan
                cands = [(ratio(v), v) for v in MITIGATED if (t, S, v, o) in stats
                         and stats[(t, S, v, o)]["reached"] == stats[(t, S, v, o)]["seeds"]]
                best = min(cands) if cands else (math.nan, "none reached in every seed")
                fastest = min(((stats[(t, S, v, o)]["time_ms"][0], v) for v in ORDER
                               if (t, S, v, o) in stats
                               and stats[(t, S, v, o)]["reached"] == stats[(t, S, v, o)]["seeds"]),
                              default=(math.nan, "-"))
                goal[(t, S, o)] = best
                bst = stats.get((t, S, best[1], o))
                lines.append(f"| {t} | {S} | {o} | {tgt[(t, o)]:g} | {updates_cell(b)} | "
                             f"{updates_cell(stats[(t, S, 'pipedream', o)])} | "
                             f"{'-' if math.isnan(pdr) else f'{pdr:.2f}x'} | {best[1]} | "
                             f"{updates_cell(bst) if bst else '-'} | "
                             f"{'-' if math.isnan(best[0]) else f'{best[0]:.2f}x'} | "
                             f"{'yes' if best[0] <= 1.1 else 'no'} | {fastest[1]} |")
    lines.append("")
    # auto
    lines.append(f"**auto** (`fxpipe.runtime.training.auto.decide`, applied to each seed's first {pilot} "
                 "updates of every candidate, with the simulated periods below): its pick per "
                 "seed, and its predicted time to target against the better of pipedream and "
                 "flush (mean ± sd over seeds; 'within spread': auto's mean <= the better one's "
                 "mean + its sd).")
    lines.append("")
    table, auto_ok = auto_table(data, stats, tasks, opts, per, pilot, whole)
    lines += table
    lines.append(f"auto within the seed spread of the better of pipedream and flush: "
                 f"**{auto_ok[0]} of {auto_ok[1]}** rows.")
    lines.append("")
    held_ok: list[list[int]] = []
    for group in (g for g in held or [] if g):
        hs = ", ".join(map(str, sorted({r["seed"] for v in group.values() for r in v})))
        lines.append(f"**auto on held-out seeds {hs}** (auto's candidates only; targets from "
                     "the seeds above, so these runs do not move them): the same replay, "
                     "against the better of pipedream and flush over the same seeds.")
        lines.append("")
        table, ok = auto_table(group, all_stats(group), tasks, opts, per, pilot, whole)
        held_ok.append(ok)
        lines += table
        lines.append(f"auto within the seed spread on seeds {hs}: **{ok[0]} of {ok[1]}** rows.")
        lines.append("")
    lines.append(f"![updates to target relative to flush]({fig_rel})")
    lines.append("")
    lines.append(f"![predicted time to target relative to flush]"
                 f"({fig_rel.replace('.png', '-time.png')})")
    lines.append("")
    # full tables
    lines.append("**All rows**: updates to target (mean ± sd, seeds that reached it / seeds), "
                 "final metric (mean ± sd), predicted time to target in ms (simulated seconds "
                 "per update x updates). `*`: flush/2bw not run at this depth, the S = 2 runs "
                 "stand in (same arithmetic, see bench/ablation/run.py); gpipe, zb-h1 and zb-h2 "
                 "are flush's training (the same updates) with their own throughput.")
    for t in tasks:
        task = make_task(t)
        for o in opts:
            if (t, o) not in tgt:
                continue
            lines.append("")
            lines.append(f"*{t}, {o}*: target {task.metric} {'>=' if task.higher_is_better else '<='}"
                         f" {tgt[(t, o)]:g}, budget {task.updates} updates of {task.batch} samples")
            lines.append("")
            head = "| variant |" + "".join(f" S={S} updates | S={S} final | S={S} ms |"
                                           for S in (2, 4, 8))
            lines.append(head)
            lines.append("|---|" + "---:|" * 9)
            for v in ORDER:
                cells = []
                for S in (2, 4, 8):
                    st = stats.get((t, S, v, o))
                    if st is None:
                        cells += ["", "", ""]
                        continue
                    mark = "*" if st["fallback"] else ""
                    div = f" ({st['diverged']} diverged)" if st["diverged"] else ""
                    cells += [f"{updates_cell(st)}{mark}",
                              fmt(*st["final"]) + div, fmt(*st["time_ms"])]
                lines.append(f"| {v} | " + " | ".join(cells) + " |")
    lines.append("")
    lines.append("Simulated seconds per update (commodity cluster, see above):")
    lines.append("")
    lines.append("| task | S | " + " | ".join(ORDER[:7]) + " |")
    lines.append("|---|---:|" + "---:|" * 7)
    for (t, S), p in sorted(per.items()):
        lines.append(f"| {t} | {S} | " + " | ".join(f"{p[v] * 1e3:.3g} ms" for v in ORDER[:7])
                     + " |")
    return "\n".join(lines), {"stats": stats, "targets": tgt, "goal": goal, "auto": auto_ok,
                              "auto_heldout": held_ok, "periods": per}


def main(argv: list[str] | None = None) -> int:
    from bench._report import publish

    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--results", default=DEFAULT_OUT)
    p.add_argument("--pilot", type=int, default=100,
                   help="updates auto's pilot sees (the trainer's rule: at most 1/2 of the run)")
    p.add_argument("--out", default=None, help="write the markdown here, not "
                   "benchmarks/statistical-efficiency.md")
    p.add_argument("--figure", default=str(ROOT / "docs/figures/statistical-efficiency.png"))
    p.add_argument("--minutes", default="?", help="how long the sweep took (for the text)")
    p.add_argument("--sweep", action="append", default=None,
                   help="a bench.ablation.run command line that filled --results (repeatable; "
                        "default: the plain sweep)")
    p.add_argument("--date", default=None, help="when the sweep ran (default: today, UTC)")
    p.add_argument("--seeds", default="0,1,2",
                   help="the seeds of every table but the held-out one (comma-separated)")
    p.add_argument("--heldout", default="3,4,5;6,7,8",
                   help="seeds of the held-out auto tables, one table per ';'-separated group "
                        "('' for none; absent seeds are skipped)")
    a = p.parse_args(argv)
    shown = (str(Path(a.results).resolve().relative_to(ROOT))
             if Path(a.results).resolve().is_relative_to(ROOT) else a.results)
    data = load(a.results, {int(x) for x in a.seeds.split(",")})
    held = [load(a.results, {int(x) for x in g.split(",") if x}) for g in a.heldout.split(";")
            if g.strip()]
    body, extra = markdown(data, a.results, a.pilot, "docs/figures/statistical-efficiency.png",
                           held)
    tasks = sorted({k[0] for k in data})
    opts = [o for o in ("sgd0", "sgd0.5", "sgd0.9", "adamw") if any(k[3] == o for k in data)]
    figure(data, extra["stats"], tasks, opts, Path(a.figure))
    figure(data, extra["stats"], tasks, opts,
           Path(a.figure).with_name(Path(a.figure).stem + "-time.png"), key="time_ms")
    trained = [v for k, v in data.items() if k[2] not in SAME_AS_FLUSH and
               not any(r.get("fallback") for r in v)]
    runs = sum(map(len, trained))
    by_seeds = Counter(len(v) for v in trained)
    seeds = sorted({r["seed"] for v in trained for r in v})
    sweeps = a.sweep or [".venv/bin/python -m bench.ablation.run"]
    date = a.date or datetime.now(timezone.utc).strftime("%Y-%m-%d")
    head = (f"### Statistical efficiency: schedules, mitigations and auto\n\n"
            f"Measured {date}. Commands (the sweep, {a.minutes}; a configuration already in the "
            f"results file is skipped, so "
            f"each command adds seeds to the cells it names): "
            + "; ".join(f"`{c}`" for c in sweeps)
            + f"; then `.venv/bin/python -m bench.ablation.report --results {shown}`. "
            f"{runs} training runs on fxpipe's reference executor, seeds "
            f"{', '.join(map(str, seeds))}; of the {len(trained)} trained cells (task, S, "
            f"variant, optimizer), "
            + ", ".join(f"{n} have {k} seed{'s' if k > 1 else ''}"
                        for k, n in sorted(by_seeds.items(), reverse=True))
            + f". Results in `{shown}`. Setup: bench/ablation/tasks.py, train.py and the "
            f"report's module doc (targets, predicted time). SGD's lr is scaled by (1 - momentum) "
            f"so every momentum has the same effective step; AdamW has weight decay 0.01. "
            f"A statistic over fewer than 3 seeds (the `(k/n)` counts say how many) is no "
            f"statistical claim.\n")
    publish("statistical-efficiency", head + "\n" + body, a.out)
    Path(a.results).with_suffix(".summary.json").write_text(json.dumps(
        {"targets": {f"{t}|{o}": v for (t, o), v in extra["targets"].items()},
         "auto": extra["auto"], "auto_heldout": extra["auto_heldout"],
         "goal": {f"{t}|{S}|{o}": list(v) for (t, S, o), v in extra["goal"].items()},
         "stats": {"|".join(map(str, k)): v for k, v in extra["stats"].items()}},
        default=str, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
