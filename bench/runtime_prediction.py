"""The plan's prediction against the runtime's measurement: time per minibatch, busy fractions.

Run from the repository root:  .venv/bin/python -m bench.runtime_prediction
Writes its page benchmarks/runtime_prediction.md (``--out FILE`` writes the markdown there instead).

``fxpipe.compile`` profiles the model on this machine (one thread, as each rank runs) and plans a
1-stage and a 2-stage (straight) pipeline; the plan predicts the time per minibatch (its
bottleneck stage) and each stage's compute. ``run_distributed`` (pipedream schedule) then trains
N minibatches of each, interleaved and repeated, and the runtime's own timeline (RunResult
.timeline: forward, backward, optimizer, send, recv, allreduce, idle per rank) gives:

* measured time per minibatch: steady state, from the completion times (end of ``U<k>``) of
  minibatches --warmup..N-1 on the input stage;
* per-stage busy fraction in steady state (``fxpipe.runtime.timeline.busy_fraction``: compute
  time / wall time over the middle half of the rank's forward/backward events) and where the
  rest of that window went;
* measured compute per minibatch per stage (median forward+backward, and the optimizer step)
  against the plan's ``compute_s`` (forward+backward from the profile);
* after re-planning (issue 13, item 3): the profile rescaled stage by stage to the forward,
  backward and optimizer times measured over minibatches --warmup..N/2-1
  (``fxpipe.runtime.pricing.replan.rescale``, what ``trainer(replan="auto")`` does after its first
  segments), the running plan costed on it (``plan_for``), against the time per minibatch
  measured over the second half (N/2..N-1): a prediction for time it has not seen.
"""
from __future__ import annotations

import argparse
import logging
import math
import statistics
import time

import torch

from bench import runtime_common as rc
from bench._report import publish
import fxpipe
from fxpipe.passes.partition import plan_for
from fxpipe.runtime.execution.launch import run_distributed
from fxpipe.runtime.pricing.replan import measure as replan_measure
from fxpipe.runtime.pricing.replan import rescale, stage_starts
from fxpipe.runtime.schedules.kinds import make_schedule
from fxpipe.runtime.timeline import busy_fraction

log = logging.getLogger("runtime_prediction")
SECTION = "runtime_prediction"
BATCH = 32
CATS = ("forward", "backward", "optimizer", "recv", "send", "idle")


def steady_window(evs) -> tuple[float, float]:
    """The window busy_fraction uses: middle half of the rank's forward/backward events."""
    fb = sorted((e for e in evs if e.category in ("forward", "backward")), key=lambda e: e.start)
    return fb[len(fb) // 4].start, fb[math.ceil(3 * len(fb) / 4) - 1].end


def window_shares(evs, lo: float, hi: float) -> dict[str, float]:
    out = {c: 0.0 for c in CATS}
    for e in evs:
        if e.category in out:
            out[e.category] += max(0.0, min(e.end, hi) - max(e.start, lo))
    return {c: v / (hi - lo) for c, v in out.items()}


def per_mb(evs, cat: str, skip: int) -> float:
    """Median duration of a category's events per minibatch after ``skip`` warm-up events."""
    ds = [e.duration for e in evs if e.category == cat][skip:]
    return statistics.median(ds) if ds else 0.0


def rescaled_prediction(c, timeline, lo: int, hi: int) -> float:
    """The running plan's time per minibatch on ``c``'s profile rescaled to the stage times
    measured over minibatches (and updates) ``lo..hi-1`` of ``timeline`` (one rank per stage)."""
    times = []
    for r in range(len(c.plan.stages)):
        evs = [e for e in timeline[r]
               if lo <= e.args.get("update" if e.category == "optimizer" else "minibatch",
                                   -1) < hi]
        times.append(replan_measure(evs))
    scaled, _ = rescale(c.profile, c.plan, times)
    return plan_for(scaled, fxpipe.Cluster.from_dict(dict(c.plan.cluster)),
                    stage_starts(c.profile, c.plan), c.plan.replicas,
                    sync=c.plan.sync).time_per_minibatch


def measure(c, batches, warmup: int) -> dict:
    specs, replicas = c.stage_specs, c.plan.replicas
    sched = make_schedule("pipedream", replicas, len(batches))
    res = run_distributed(specs, replicas, sched, rc.cross_entropy, rc.sgd, batches, timeout_s=120.0)
    done = rc.fxpipe_done_at(res.timeline, rank=0)
    tpm = (done[-1] - done[warmup]) / (len(done) - 1 - warmup)
    busy = busy_fraction(res.timeline)
    ranks = {}
    for r, evs in sorted(res.timeline.items()):
        lo, hi = steady_window(evs)
        ranks[r] = dict(busy=busy[r], shares=window_shares(evs, lo, hi),
                        fb=per_mb(evs, "forward", warmup) + per_mb(evs, "backward", warmup),
                        opt=statistics.median(sum(e.duration for e in g) for g in
                                              list(rc.fxpipe_updates(evs).values())[warmup:]))
    half = len(batches) // 2
    tpm2 = (done[-1] - done[half]) / (len(done) - 1 - half)
    return dict(tpm=tpm, ranks=ranks, tpm2=tpm2,
                rescaled=rescaled_prediction(c, res.timeline, warmup, half))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--minibatches", type=int, default=150)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--out", default=None, help="write the markdown here instead of "
                    "benchmarks/runtime_prediction.md")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(1)  # profile with one thread, as each rank runs
    t_start = time.perf_counter()
    model = rc.mlp()
    pool = rc.teacher_pool((512,), BATCH, 16)
    batches = rc.cycle(pool, args.minibatches)
    plans = {}
    for stages in (1, 2):
        c = fxpipe.compile(model, fxpipe.Cluster(workers=stages), example_inputs=(pool[0][0],),
                           loss_fn=rc.cross_entropy, stages=stages, straight=True)
        assert c.plan.replicas == [1] * stages, c.plan.replicas
        plans[stages] = c
    got: dict[int, list[dict]] = {1: [], 2: []}
    for rnd in range(args.rounds):
        for stages in ((1, 2) if rnd % 2 == 0 else (2, 1)):
            c = plans[stages]
            m = measure(c, batches, args.warmup)
            got[stages].append(m)
            log.info("round %d, %d stage(s): %.2f ms/minibatch (predicted %.2f), busy %s", rnd,
                     stages, m["tpm"] * 1e3, c.plan.time_per_minibatch * 1e3,
                     {r: round(v["busy"], 2) for r, v in m["ranks"].items()})
    elapsed = time.perf_counter() - t_start

    def s(xs, fmt="{:.2f}"):
        return rc.spread(xs, fmt)

    rows, stage_rows, after_rows = [], [], []
    for stages in (1, 2):
        plan = plans[stages].plan
        pred = plan.time_per_minibatch
        meas = [m["tpm"] for m in got[stages]]
        err = [(x / pred - 1) * 100 for x in meas]
        rows.append(f"| {stages} | {plan.replicas} | {pred * 1e3:.2f} | {s([x * 1e3 for x in meas])} | "
                    f"**{s(err, '{:+.0f}')}%** |")
        m2 = [m["tpm2"] for m in got[stages]]
        resc = [m["rescaled"] for m in got[stages]]
        after_rows.append(
            f"| {stages} | {pred * 1e3:.2f} | {s([x * 1e3 for x in resc])} | "
            f"{s([x * 1e3 for x in m2])} | {s([(x / pred - 1) * 100 for x in m2], '{:+.0f}')}% | "
            f"**{s([(x / p - 1) * 100 for x, p in zip(m2, resc)], '{:+.0f}')}%** |")
        for r in range(stages):
            st = plan.stages[r]
            runs = [m["ranks"][r] for m in got[stages]]
            sh = {c: s([x["shares"][c] * 100 for x in runs], "{:.0f}") for c in CATS}
            stage_rows.append(
                f"| {stages} | {r} | {st.compute_s * 1e3:.2f} | {s([x['fb'] * 1e3 for x in runs])} | "
                f"{s([x['opt'] * 1e3 for x in runs])} | **{s([x['busy'] for x in runs])}** | "
                + " | ".join(sh[c] for c in CATS) + " |")
    cmd = f"{rc.PY} -m bench.runtime_prediction" + (
        f" --rounds {args.rounds}" if args.rounds != 3 else "") + (
        f" --minibatches {args.minibatches}" if args.minibatches != 150 else "")
    md = "\n".join([
        "## Prediction against measurement: time per minibatch and busy fractions",
        "",
        f"Command: `{cmd}` (from the repository root; {rc.machine()}; {args.rounds} rounds, the "
        f"1- and 2-stage runs interleaved; {elapsed:.0f} s in all)",
        "",
        f"Model: MLP 512-4x1024-10 (3.7M parameters), batch {BATCH}, SGD lr 0.01 momentum 0.9, "
        f"{args.minibatches} minibatches per run, pipedream schedule through `run_distributed` "
        "(gloo, one process per stage). Plans: `fxpipe.compile(model, Cluster(workers=k), "
        "stages=k, straight=True)`, costs profiled on this machine with one thread. Measured "
        f"time per minibatch: steady state (minibatches {args.warmup}..N-1, end of `U<k>` on "
        "the input stage's timeline). Error = measured / predicted - 1.",
        "",
        "| stages | replicas | predicted ms/minibatch | measured ms/minibatch | error |",
        "|---:|---|---:|---:|---:|",
        *rows,
        "",
        "Per stage, from the runtime's timeline (steady-state window = middle half of each rank's "
        "forward/backward events; the shares are % of that window; the plan's compute "
        "includes its profiled optimizer step, U):",
        "",
        "| stages | stage | plan compute ms (F+B+U) | measured F+B ms | measured optimizer ms | "
        "busy fraction | forward % | backward % | optimizer % | recv wait % | send % | idle % |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        *stage_rows,
        "",
        "After re-planning (issue 13, item 3): the profile rescaled stage by stage to the "
        f"forward, backward and optimizer times measured over minibatches {args.warmup}.."
        f"{args.minibatches // 2 - 1} of the same run (`fxpipe.runtime.pricing.replan.rescale`, what "
        "`trainer(replan=\"auto\")` re-plans from), the running plan costed on it "
        "(`plan_for`), against the time per minibatch measured over minibatches "
        f"{args.minibatches // 2}..N-1 (error = measured / predicted - 1, as above):",
        "",
        "| stages | predicted ms (profile) | predicted ms (rescaled) | measured ms, 2nd half | "
        "error before | error after re-plan |",
        "|---:|---:|---:|---:|---:|---:|",
        *after_rows,
        "",
        "Cells: median [min-max] over the rounds.",
    ])
    publish(SECTION, md, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
