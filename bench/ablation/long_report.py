"""The 1,000-update rows (issue 25) -> benchmarks/long-horizon.md.

    .venv/bin/python -m bench.ablation.run --long          # the runs (resumable; results in
                                                           # bench/ablation/results-long.jsonl)
    .venv/bin/python -m bench.ablation.long_report         # this page

* **Target** per task and optimizer: what 1f1b-flush reaches, mean over its seeds at the
  smallest depth run, after 60% of the budget (loss rounded up to 0.01, accuracy down), as in
  the 200-update report (flush's arithmetic is the same at every depth).
* **Updates to target**: the first evaluation at or past it, mean ± sd over the seeds that
  reached it (k/n); **final**: mean of the last 3 evaluations, mean ± sd over seeds.
* **Goal** (issue 25): at each depth, the best asynchronous variant (pipedream, its Nesterov
  correction, 2bw) reaches the target in every seed within 1.1x flush's updates, seed by seed
  (the worst of ``updates(variant, seed) / updates(flush, seed)``; the ratio of the means is
  shown beside it).
* **Predicted time to target**: updates x simulated seconds per update of GPT-2 124M (32
  sequences of 1024 tokens per update, estimated V100 costs) on S V100s at 10 Gbps, the
  planner's S-stage straight plan, bubbles included (``fxpipe.runtime.pricing.plansim``):
  pipedream and its corrections at minibatch 32, flush and 2bw at S microbatches of 32 / S.
  The miniature's updates stand in for the big model's: a prediction, not a measurement.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

from bench._report import publish

from .report import final, fmt, mean_sd, metric_at, reached

SECTION = "long-horizon"
RESULTS = Path(__file__).resolve().parent / "results-long.jsonl"
VARIANTS = ("1f1b-flush", "pipedream", "pipedream+nesterov", "2bw")
ASYNC = VARIANTS[1:]
GOAL = 1.1


def load(path: Path) -> dict[tuple[str, int, str, str], list[dict[str, Any]]]:
    """(task, S, variant, opt) -> records sorted by seed (errored runs left out)."""
    runs: dict[tuple[str, int, str, str], dict[int, dict]] = defaultdict(dict)
    for line in path.read_text().splitlines():
        if line.strip():
            r = json.loads(line)
            if "error" not in r:
                runs[(r["task"], r["S"], r["variant"], r["opt"])][r["seed"]] = r
    return {k: [r for _, r in sorted(v.items())] for k, v in runs.items()}


def targets(data: dict, budget: dict[str, int]) -> dict[tuple[str, str], float]:
    """(task, opt) -> target: flush at its smallest depth run, 60% of the budget (module doc)."""
    from .tasks import make_task

    out = {}
    for t, o in sorted({(k[0], k[3]) for k in data if k[2] == "1f1b-flush"}):
        S = min(k[1] for k in data if (k[0], k[2], k[3]) == (t, "1f1b-flush", o))
        m = statistics.fmean(metric_at(r, int(0.6 * budget[t]))
                             for r in data[(t, S, "1f1b-flush", o)])
        higher = make_task(t).higher_is_better
        out[(t, o)] = math.floor(m * 100) / 100 if higher else math.ceil(m * 100) / 100
    return out


def gpu_periods(S: int) -> dict[str, float]:
    """Simulated seconds per update of each variant for GPT-2 124M on S V100s (module doc)."""
    from bench.zero_bubble import UNLIMITED, gpt
    from fxpipe.costmodel import Cluster
    from fxpipe.passes import partition
    from fxpipe.runtime.pricing.plansim import simulate_plan

    cluster = Cluster(workers=S, bandwidth="10Gbps", device="V100", memory=UNLIMITED)
    whole, micro = gpt(32), gpt(32 // S)
    plan = partition(whole, cluster, stages=S, straight=True)
    pd = simulate_plan(plan, whole, schedule="pipedream", minibatches=8 * S).steady_state_period
    mplan = partition(micro, cluster, stages=S, straight=True)
    out = {"pipedream": pd, "pipedream+nesterov": pd}
    for kind in ("1f1b-flush", "2bw"):
        sim = simulate_plan(mplan, micro, schedule=kind, minibatches=8 * S, microbatches=S)
        out[kind] = sim.steady_state_period * S
        untied = simulate_plan(mplan, micro, schedule=kind, minibatches=8 * S, microbatches=S,
                               tied=[])  # the same without the tied embedding/head sum
        out[kind + " untied"] = untied.steady_state_period * S
    return out


def paired(recs: list[dict], base: list[dict], target: float, higher: bool) -> float | None:
    """The worst seed's updates to target over flush's in the same seed; None unless every
    seed of both reached it."""
    flush = {r["seed"]: reached(r, target, higher) for r in base}
    ratios = []
    for r in recs:
        u, f = reached(r, target, higher), flush.get(r["seed"])
        if u is None or not f:
            return None
        ratios.append(u / f)
    return max(ratios) if ratios else None


def stats(recs: list[dict], target: float, higher: bool) -> dict[str, Any]:
    ups = [reached(r, target, higher) for r in recs]
    got = [float(u) for u in ups if u is not None]
    return {"updates": mean_sd(got), "reached": len(got), "seeds": len(recs),
            "final": mean_sd([final(r) for r in recs if not r.get("diverged")]),
            "diverged": sum(1 for r in recs if r.get("diverged"))}


def _shown(path: Path) -> str:
    root = Path(__file__).resolve().parents[2]
    return str(path.relative_to(root)) if path.is_relative_to(root) else str(path)


def markdown(data: dict, results: Path, periods: dict[int, dict[str, float]] | None = None
             ) -> tuple[str, dict[str, Any]]:
    """The page, and its figures as data; ``periods`` (S -> variant -> seconds per update):
    :func:`gpu_periods` when not given."""
    from .tasks import make_task

    budget = {t: max(r["evals"][-1][0] for k, rs in data.items() if k[0] == t for r in rs)
              for t in {k[0] for k in data}}
    tgt = targets(data, budget)
    depths = sorted({k[1] for k in data})
    periods = periods or {S: gpu_periods(S) for S in depths}
    seeds = sorted({r["seed"] for rs in data.values() for r in rs})
    lines = ["## Asynchrony at a longer horizon: 1,000 updates, AdamW and Muon", "",
             "Command: `.venv/bin/python -m bench.ablation.run --long` (resumable, results in "
             f"`{_shown(results)}`), then "
             "`.venv/bin/python -m bench.ablation.long_report`. Seeds run: "
             f"{', '.join(map(str, seeds))}; method in the module doc of "
             "`bench/ablation/long_report.py` (target: flush's loss or accuracy after 60% of "
             "the budget; predicted time: GPT-2 124M on S V100s at 10 Gbps, simulated).", ""]
    goal_rows = []
    summary: dict[str, Any] = {}
    for t in sorted(budget):
        task = make_task(t)
        for o in sorted({k[3] for k in data if k[0] == t}):
            if (t, o) not in tgt:
                continue
            target = tgt[(t, o)]
            cmp = ">=" if task.higher_is_better else "<="
            lines += [f"**{t}, {o}** ({budget[t]} updates; target {task.metric} {cmp} "
                      f"{target:g})", "",
                      "| S | variant | updates to target (seeds) | / flush (means) | "
                      "worst seed / flush's | final | predicted time to target |",
                      "|---:|---|---|---:|---:|---|---:|"]
            for S in depths:
                base, flush_recs = None, data.get((t, S, "1f1b-flush", o)) or []
                best: tuple[float, str, float] | None = None
                for v in VARIANTS:
                    recs = data.get((t, S, v, o))
                    if not recs:
                        continue
                    st = stats(recs, target, task.higher_is_better)
                    m = st["updates"][0]
                    if v == "1f1b-flush":
                        base = m if st["reached"] == st["seeds"] else None
                    ratio = m / base if base and st["reached"] else float("nan")
                    worst = (paired(recs, flush_recs, target, task.higher_is_better)
                             if base else None)
                    if v in ASYNC and worst is not None:
                        best = min(best or (worst, v, ratio), (worst, v, ratio))
                    time_ms = m * periods[S][v] * 1e3
                    lines.append(
                        f"| {S} | {v} | {fmt(*st['updates'])} ({st['reached']}/{st['seeds']})"
                        f"{' diverged ' + str(st['diverged']) if st['diverged'] else ''} | "
                        f"{ratio:.2f} | {'-' if worst is None else f'{worst:.2f}'} | "
                        f"{fmt(*st['final'], digits=4)} | {time_ms / 1e3:.1f} s |"
                        if st["reached"] else
                        f"| {S} | {v} | - (0/{st['seeds']}) | - | - | "
                        f"{fmt(*st['final'], digits=4)} | - |")
                if base is not None:
                    goal_rows.append((t, S, o, best))
                    summary[f"{t}|{S}|{o}"] = (None if best is None
                                               else [best[1], best[2], best[0]])
            lines.append("")
    met = [r for r in goal_rows if r[3] is not None and r[3][0] <= GOAL]
    lines.append(f"**Goal** (best asynchronous variant within {GOAL}x flush's updates in every "
                 f"seed, seed by seed): met on {len(met)} of {len(goal_rows)} rows.")
    for t, S, o, best in goal_rows:
        verdict = ("" if best is None else
                   " (met)" if best[0] <= GOAL else f" (missed by {best[0] / GOAL - 1:.1%})")
        lines.append(f"- {t}, S = {S}, {o}: " + (
            f"best {best[1]}: worst seed {best[0]:.3f}x flush's updates, means "
            f"{best[2]:.2f}x{verdict}" if best else
            "no asynchronous variant reached the target in every seed"))
    lines += ["", "Simulated seconds per update (GPT-2 124M, 32 x 1024 tokens per update): " +
              "; ".join(f"S = {S}: " + ", ".join(f"{v} {periods[S][v] * 1e3:.0f} ms"
                                                 for v in VARIANTS) for S in depths) + "."]
    if all("2bw untied" in periods[S] for S in depths):
        lines += ["", "2bw runs GPT-2's tied embedding/head sum (stage 0 with stage S - 1, "
                  "154 MB) synchronously once per update, so the non-flushing pipeline waits "
                  "for it (pipedream lags the tied sum a round and overlaps it); without the "
                  "tie, 2bw simulates at " + ", ".join(
                      f"{periods[S]['2bw untied'] * 1e3:.0f} ms (S = {S})" for S in depths) +
                  " per update and 1f1b-flush at " + ", ".join(
                      f"{periods[S]['1f1b-flush untied'] * 1e3:.0f} ms" for S in depths) +
                  ". The time column prices the model as it is, tied."]
    replay_lines, replays = replay(data, tgt, periods, depths)
    lines += replay_lines
    return "\n".join(lines), {"targets": {f"{t}|{o}": v for (t, o), v in tgt.items()},
                              "best": summary, "replay": replays}


PILOTS = (50, 100, 200)
"""Pilot lengths (updates per candidate) the replay tries; 200 is auto's default pilot."""


def auto_time(recs: dict[str, list[dict]], i: int, pilot: int, per: dict[str, float],
              target: float, higher: bool, budget: int, margin: float = 0.05
              ) -> tuple[str, float, str]:
    """Seed ``i``'s pick, its predicted time to target and how auto got there, deciding on the
    job's pipeline as the trainer does (``auto_options={"where": "pipeline"}``, the default
    ``max_fraction`` and ``max_cost``): flush pilots ``pilot`` updates, every other candidate
    as many as fit in flush's seconds (:func:`~fxpipe.runtime.training.auto.pilot_lengths`, at
    most ``STRETCH x pilot`` and half the ``budget``); a pilot whose losers would cost more
    than a quarter of the run (:func:`~fxpipe.runtime.training.auto_resolve.price_pipeline`'s
    rule) is not run and auto trains flush; otherwise each candidate after flush stops at the
    end of the first of the trainer's segments where :func:`~fxpipe.runtime.training.auto.can_stop`
    lets it, :func:`~fxpipe.runtime.training.auto.decide` picks on these curves, the losers'
    pilots are paid and the winner's is part of its run (it continues from its pilot), so
    time = the others' ``piloted x period`` + the winner's updates to target x its period
    (inf where it never reaches it)."""
    from fxpipe.runtime.training.auto import STRETCH, Level, can_stop, decide, pilot_lengths
    from fxpipe.runtime.training.trainer_schedule import DEFAULT_SEGMENT, FIRST_SEGMENT

    cap = max(pilot, min(STRETCH * pilot, budget // 2))
    lengths = pilot_lengths(list(recs), per, pilot, cap)
    each = {v: lengths[v] * per[v] for v in recs}
    if sum(each.values()) - min(each.values()) > 0.25 * budget * per["1f1b-flush"]:
        u = reached(recs["1f1b-flush"][i], target, higher)
        return "1f1b-flush", math.inf if u is None else u * per["1f1b-flush"], "priced out"
    curves = {v: [math.inf if x is None else x for x in rs[i]["train_losses"][:lengths[v]]]
              for v, rs in recs.items()}
    level = Level.of(curves["1f1b-flush"])
    bound = level.minibatches(curves["1f1b-flush"]) * per["1f1b-flush"]
    for v, curve in curves.items():  # flush first (it sets the level), then the others in turn
        if v == "1f1b-flush":
            continue
        end = 0
        while end < len(curve):  # the trainer's segments: 8, 16, 32, ... minibatches
            end = min(end + min(DEFAULT_SEGMENT, end + FIRST_SEGMENT), len(curve))
            if can_stop(curve[:end], per[v], level, bound):
                break
        curves[v] = curve[:end]
        bound = min(bound, level.minibatches(curves[v]) * per[v])
    pick = decide(curves, {v: per[v] for v in curves}, margin=margin).schedule
    u = reached(recs[pick][i], target, higher)
    others = sum(len(curves[v]) * per[v] for v in curves if v != pick)
    return pick, others + (math.inf if u is None else u * per[pick]), "piloted"


def picks_table(data: dict, tgt: dict[tuple[str, str], float],
                periods: dict[int, dict[str, float]], depths: list[int]) -> list[str]:
    """What the rule picks, the pilot's cost left out: the picked schedule's time to target
    over the best schedule's (mean over the seeds, then over the rows; worst row), judged on
    every candidate's first P updates (the rule before issue 25's equal seconds) and on
    flush's P updates' seconds (each candidate as many updates as fit, at most 2P and half
    the run, as the trainer reads)."""
    from fxpipe.runtime.training.auto import STRETCH, decide

    from .tasks import make_task

    out = ["", "The choice itself, the pilot's cost left out (the picked schedule's time to "
           "target over the best schedule's, mean over the seeds; mean over the rows, and the "
           "worst row):", "", "| P | equal updates (the rule before) | equal seconds (the rule "
           "now) |", "|---:|---:|---:|"]
    for P in PILOTS:
        ratios: dict[str, list[float]] = {"updates": [], "seconds": []}
        for (t, o), target in sorted(tgt.items()):
            higher = make_task(t).higher_is_better
            for S in depths:
                recs = {v: data[(t, S, v, o)] for v in VARIANTS if (t, S, v, o) in data}
                if "1f1b-flush" not in recs or any("train_losses" not in r
                                                   for rs in recs.values() for r in rs):
                    continue
                per = {v: periods[S][v] for v in recs}
                n = len(recs["1f1b-flush"])
                means = {v: statistics.fmean((reached(r, target, higher) or math.inf) * per[v]
                                             for r in rs) for v, rs in recs.items()}
                best = min(means.values())
                for how in ratios:
                    times = []
                    for i in range(n):
                        cv = {v: [math.inf if x is None else x for x in rs[i]["train_losses"]]
                              for v, rs in recs.items()}
                        cap = max(P, min(STRETCH * P, len(cv["1f1b-flush"]) // 2))
                        cv = {v: c[:P] if how == "updates" or v == "1f1b-flush" else c[:cap]
                              for v, c in cv.items()}
                        pick = decide(cv, per).schedule
                        u = reached(recs[pick][i], target, higher)
                        times.append(math.inf if u is None else u * per[pick])
                    ratios[how].append(statistics.fmean(times) / best)
        cells = [f"{statistics.fmean(r):.2f} (worst {max(r):.2f})" for r in ratios.values()]
        out.append(f"| {P} | {cells[0]} | {cells[1]} |")
    return out


def replay(data: dict, tgt: dict[tuple[str, str], float], periods: dict[int, dict[str, float]],
           depths: list[int]) -> tuple[list[str], dict[str, Any]]:
    """auto replayed on these rows, its pilot's cost included (:func:`auto_time`), against the
    best schedule's predicted time to target (mean ± sd over the seeds; "within the spread":
    auto's mean at most the best's mean + sd, the 200-update report's rule)."""
    from .tasks import make_task

    lines = ["", "**auto replayed on these rows, its pilot included** (candidates: the variants "
             "above, on the job's pipeline as `auto_options={\"where\": \"pipeline\"}` "
             "decides: flush pilots P updates and every other candidate as many as fit in "
             "flush's simulated seconds, at most 2P and half the run, stopping early where that "
             "cannot change the choice; the trainer's rule picks on each seed's curves; the "
             "losers' pilots are paid, the winner continues from its "
             "own; a pilot whose losers would cost more than a quarter of the run is not run and "
             "auto trains flush, as `max_cost` says). auto / flush: auto's time over flush's "
             "alone (below 1: auto paid for itself):", "",
             "| task | optimizer | S | P | picks (seeds) | auto, pilot included | auto / flush "
             "| best schedule | within spread |", "|---|---|---:|---:|---|---:|---:|---|---|"]
    out: dict[str, Any] = {}
    for (t, o), target in sorted(tgt.items()):
        higher = make_task(t).higher_is_better
        for S in depths:
            recs = {v: data[(t, S, v, o)] for v in VARIANTS if (t, S, v, o) in data}
            if ("1f1b-flush" not in recs or len({len(r) for r in recs.values()}) != 1
                    or any("train_losses" not in r for rs in recs.values() for r in rs)):
                continue  # every candidate's curve, for every seed, or no replay
            per = {v: periods[S][v] for v in recs}
            budget = len(recs["1f1b-flush"][0]["train_losses"])
            best = None
            for v, rs in recs.items():
                ups = [reached(r, target, higher) for r in rs]
                if all(u is not None for u in ups):
                    m, sd = mean_sd([u * per[v] for u in ups])
                    best = min(best or (m, sd, v), (m, sd, v))
            flush = statistics.fmean((reached(r, target, higher) or math.inf)
                                     * per["1f1b-flush"] for r in recs["1f1b-flush"])
            for P in PILOTS:
                got = [auto_time(recs, i, P, per, target, higher, budget)
                       for i in range(len(recs["1f1b-flush"]))]
                times = [x for _, x, _ in got]
                am = statistics.fmean(times)
                ok = best is not None and am <= best[0] + best[1]
                out[f"{t}|{o}|{S}|{P}"] = [[p for p, _, _ in got], am, ok, am / flush]
                shown = "never (a pick misses the target)" if math.isinf(am) else f"{am:.0f} s"
                picks = ("priced out: 1f1b-flush" if all(h == "priced out" for _, _, h in got)
                         else ", ".join(p for p, _, _ in got))
                lines.append(f"| {t} | {o} | {S} | {P} | {picks} | {shown} | {am / flush:.2f} | "
                             + (f"{best[2]} {best[0]:.0f} ± {best[1]:.0f} s" if best else "-")
                             + f" | {'yes' if ok else 'no'} |")
    if not out:
        return [], out
    lines += picks_table(data, tgt, periods, depths)
    for P in PILOTS:
        rows = [v for k, v in out.items() if k.endswith(f"|{P}")]
        lines += ["" if P == PILOTS[0] else "",
                  f"P = {P}{' (auto' + chr(39) + 's default pilot)' if P == 200 else ''}: within "
                  f"the spread on {sum(r[2] for r in rows)} of {len(rows)} rows; auto / flush "
                  f"{min(r[3] for r in rows):.2f} to {max(r[3] for r in rows):.2f}, paid for "
                  f"itself (below 1) on {sum(r[3] < 1 for r in rows)} of {len(rows)} rows."]
    return lines, out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--results", type=Path, default=RESULTS)
    p.add_argument("--out", default=None, help="write the markdown here instead of "
                   "benchmarks/long-horizon.md")
    a = p.parse_args(argv)
    text, _ = markdown(load(a.results), a.results.resolve())
    publish(SECTION, text, a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
