"""The plan's prediction against the runtime's measurement: time per minibatch, and where it goes.

Run from the repository root:  .venv/bin/python -m bench.runtime_prediction
Writes its page benchmarks/runtime_prediction.md (``--out FILE`` writes the markdown there instead;
``--models mlp,gpt --stages 1,2,4 --rounds 3`` are the defaults).

For each model (an MLP and the zoo's GPT mini) ``fxpipe.compile`` profiles it on this machine (one
thread, as each rank runs; node by node, then scaled to whole training steps) and plans straight
pipelines of 1, 2 and 4 stages; the plan predicts the time per minibatch (its bottleneck stage)
and each stage's compute. ``run_distributed`` (pipedream schedule) then trains N minibatches of
each, interleaved and repeated, and the runtime's own timeline (RunResult.timeline: forward,
backward, optimizer, send, recv, allreduce, idle per rank) gives:

* measured time per minibatch: steady state, from the completion times (end of ``U<k>``) of
  minibatches --warmup..N-1 on the input stage;
* where each rank's time per minibatch went: forward, backward and update against the plan's;
  posting sends; receive waits split into the transfer, a transfer started late, and the peer's
  compute (``fxpipe.runtime.timeline.wait_breakdown``); the executor's idle time between actions;
* per-stage busy fraction in steady state (``fxpipe.runtime.timeline.busy_fraction``);
* after stage calibration: before each run the stages train CALIBRATE (48) minibatches in this
  process (``CompiledModel.calibrate_stages``: the reference executor, no links) and the plan is
  priced on the profile rescaled to those stage times: a prediction made before any process
  starts, with the measured / profiled factors per stage;
* the machine's drift: before each run a plain whole training step of the model is timed as
  the profile's whole-step calibration timed it (``machine_speed``); measured / (predicted x
  that ratio) - 1 is the error with the drift between profile and run taken out (a
  diagnostic next to the prediction's own error);
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
import os
import statistics
import time
from dataclasses import replace

import torch

from bench import runtime_common as rc
from bench._report import publish
import fxpipe
import fxpipe.models
from fxpipe.api import choose_plan
from fxpipe.costmodel.calibrate import time_whole_step
from fxpipe.costmodel.overheads import Overheads, with_overheads
from fxpipe.costmodel.profiler import isolated
from fxpipe.runtime.execution.launch import run_distributed
from fxpipe.runtime.execution.overhead_probe import machine_overheads
from fxpipe.runtime.pricing.replan import measure as replan_measure
from fxpipe.runtime.pricing.replan import reprice
from fxpipe.runtime.schedules.kinds import make_schedule
from fxpipe.runtime.timeline import (busy_fraction, minibatch_window, of_minibatches,
                                     wait_breakdown)
from fxpipe.runtime.training.stage_calibration import calibrate_stages

log = logging.getLogger("runtime_prediction")
SECTION = "runtime_prediction"
BATCH = 32
GPT_BATCH = 16
CATS = ("forward", "backward", "optimizer", "recv", "send", "idle")
CALIBRATE = 48  # minibatches the stages run in one process before the run


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
        times.append(replan_measure([e for e in timeline[r] if of_minibatches(e, lo, hi)]))
    return reprice(c.profile, c.plan, times, fxpipe.Cluster.from_dict(dict(c.plan.cluster)),
                   sync=c.plan.sync)[2].time_per_minibatch


def decompose(timeline, lo: int, hi: int) -> dict[int, dict[str, float]]:
    """Seconds per minibatch of every rank over minibatches ``lo..hi-1``, by what the runtime
    did: forward, backward, optimizer (its compute), send (posting), the receive waits split by
    :func:`~fxpipe.runtime.timeline.wait_breakdown` (for the peer's compute; for a transfer
    posted late; for the transfer itself), idle (the executor between actions)."""
    n = hi - lo
    win = minibatch_window(timeline, lo, hi)
    waits = wait_breakdown(win)
    out = {}
    for r, evs in win.items():
        d = {c: sum(e.duration for e in evs if e.category == c) / n
             for c in ("forward", "backward", "optimizer", "send", "idle")}
        d.update({f"recv_{k}": v / n for k, v in waits[r].items()})
        out[r] = d
    return out


def machine_speed(c) -> float:
    """How much slower this machine runs now than when ``c``'s profile was taken: a plain
    training step of the whole model timed as the profile's whole-step calibration timed it
    (``fxpipe.costmodel.calibrate.time_whole_step``, this process, one thread), over that
    calibration's step (NaN where the profile has none). This VM's speed drifts by up to 1.7x
    within an hour; the ratio tells a run's error from the machine's drift."""
    cal = c.profile.meta.get("calibration") or {}
    then = sum(cal.get(f"{p}_s", 0.0) for p in ("forward", "backward", "update"))
    if then <= 0:
        return math.nan
    gm = c.traced.gm
    with isolated(gm):
        now = sum(time_whole_step(gm, c.traced.flat_inputs, rc.sgd, lambda: None, warmup=2,
                                  repeats=15))
    return now / then


def measure(c, loss_fn, batches, warmup: int) -> dict:
    specs, replicas = c.stage_specs, c.plan.replicas
    speed = machine_speed(c)
    # before the run: the stages run in this process, the plan priced on them (no links)
    cal = calibrate_stages(specs, c.plan, c.profile, loss_fn, rc.sgd, batches[:CALIBRATE])
    sched = make_schedule("pipedream", replicas, len(batches))
    res = run_distributed(specs, replicas, sched, loss_fn, rc.sgd, batches, timeout_s=120.0)
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
    return dict(tpm=tpm, ranks=ranks, tpm2=tpm2, calibrated=cal.time_per_minibatch, speed=speed,
                factors=cal.factors,
                parts=decompose(res.timeline, warmup, len(batches) - 1),
                rescaled=rescaled_prediction(c, res.timeline, warmup, half))


def overhead_line(ov: Overheads) -> str:
    """The overheads the plans were priced with, in words."""
    return (f"{ov.action_s * 1e3:.2f} ms per stage and minibatch, {ov.tensor_s * 1e6:.1f} us per "
            f"parameter tensor, {ov.message_s * 1e3:.2f} ms per message "
            f"({ov.further_s * 1e3:.2f} ms per message of a value beyond a cut's first), "
            f"{ov.stash_tensor_s * 1e6:.1f} us per tensor more where the stash copies; "
            f"{ov.source}")


def plan_parts(c) -> list[dict[str, float]]:
    """The plan's forward, backward and update seconds per stage (its profile's nodes)."""
    prof = {n.name: n for n in c.profile.nodes}
    return [{k: sum(getattr(prof[n], f"{k}_s") for n in st.nodes)
             for k in ("forward", "backward", "update")} for st in c.plan.stages]


def workload(name: str, minibatches: int):
    """(model, example input, loss, batches, description) of a benchmark model."""
    if name == "mlp":
        pool = rc.teacher_pool((512,), BATCH, 16)
        return (rc.mlp(), pool[0][0], rc.cross_entropy, rc.cycle(pool, minibatches),
                f"MLP 512-4x1024-10 (3.7M parameters), batch {BATCH}")
    spec = fxpipe.models.get("gpt", "mini", batch_size=GPT_BATCH)
    pool = [spec.make_batch(GPT_BATCH, seed=k) for k in range(16)]
    x = pool[0][0][0] if isinstance(pool[0][0], tuple) else pool[0][0]
    pool = [((i[0] if isinstance(i, tuple) else i), t) for i, t in pool]
    n = sum(p.numel() for p in spec.model.parameters())
    return (spec.model, x, spec.loss_fn, rc.cycle(pool, minibatches),
            f"the zoo's GPT mini (12 blocks, width 32, {n / 1e3:.0f}k parameters), batch "
            f"{GPT_BATCH} x 16 tokens")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--minibatches", type=int, default=150)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--models", default="mlp,gpt")
    ap.add_argument("--stages", default="1,2,4")
    ap.add_argument("--out", default=None, help="write the markdown here instead of "
                    "benchmarks/runtime_prediction.md")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(1)  # profile with one thread, as each rank runs
    # the overheads of this session (the cache may hold a probe taken beside other jobs): the
    # compiles below read them from the cache
    machine_overheads(refresh=True)
    t_start = time.perf_counter()
    models = args.models.split(",")
    counts = [int(k) for k in args.stages.split(",")]
    plans, loads, descr = {}, {}, {}
    bare: dict[tuple[str, int], float] = {}
    for name in models:
        model, x, loss_fn, batches, descr[name] = workload(name, args.minibatches)
        loads[name] = (loss_fn, batches)
        for stages in counts:
            c = fxpipe.compile(model, fxpipe.Cluster(workers=stages), example_inputs=(x,),
                               loss_fn=loss_fn, stages=stages, straight=True)
            assert c.plan.replicas == [1] * stages, c.plan.replicas
            plans[name, stages] = c
            # the same profile planned the same way without the runtime's overheads
            bare[name, stages] = choose_plan(
                replace(c.profile, meta=with_overheads(c.profile.meta, Overheads(source="off"))),
                fxpipe.Cluster(workers=stages), stages=stages,
                straight=True).time_per_minibatch
    got: dict[tuple[str, int], list[dict]] = {k: [] for k in plans}
    for rnd in range(args.rounds):
        order = list(plans) if rnd % 2 == 0 else list(reversed(plans))
        for key in order:
            c = plans[key]
            m = measure(c, *loads[key[0]], args.warmup)
            got[key].append(m)
            log.info("round %d, %s, %d stage(s): %.2f ms/minibatch (predicted %.2f), busy %s",
                     rnd, key[0], key[1], m["tpm"] * 1e3, c.plan.time_per_minibatch * 1e3,
                     {r: round(v["busy"], 2) for r, v in m["ranks"].items()})
    elapsed = time.perf_counter() - t_start

    def s(xs, fmt="{:.2f}"):
        return rc.spread(xs, fmt)

    rows, stage_rows, after_rows, part_rows, calib_rows = [], [], [], [], []
    factor_rows: list[str] = []
    for name in models:
        cal = plans[name, counts[0]].profile.meta.get("calibration", {})
        calib_rows.append(
            f"| {name} | " + " | ".join(
                f"{cal.get(f'node_{p}_s', 0) * 1e3:.2f} → {cal.get(f'{p}_s', 0) * 1e3:.2f} "
                f"(x{cal.get(f'{p}_ratio', 1.0):.2f})" for p in ("forward", "backward", "update"))
            + " |")
    for key, c in plans.items():
        name, stages = key
        plan = c.plan
        pred = plan.time_per_minibatch
        runs = got[key]
        meas = [m["tpm"] for m in runs]
        err = [(x / pred - 1) * 100 for x in meas]
        pp = plan_parts(c)
        # the rank whose own work per minibatch is largest, and what it pays besides compute
        work = [[sum(m["parts"][r][k] for k in ("forward", "backward", "optimizer"))
                 for r in range(stages)] for m in runs]
        slow = [max(range(stages), key=w.__getitem__) for w in work]
        ratio = [w[r] / sum(pp[r].values()) for w, r in zip(work, slow)]
        extra = [sum(m["parts"][r][k] for k in ("send", "recv_transfer", "recv_late", "idle"))
                 for m, r in zip(runs, slow)]
        cal = [m["calibrated"] for m in runs]
        drift_err = [(x / (pred * m["speed"]) - 1) * 100 for x, m in zip(meas, runs)]
        b = bare[key]
        rows.append(f"| {name} | {stages} | {b * 1e3:.2f} | "
                    f"{s([(x / b - 1) * 100 for x in meas], '{:+.0f}')}% | "
                    f"{max(st.overhead_s for st in plan.stages) * 1e3:.2f} | "
                    f"{pred * 1e3:.2f} | {s([x * 1e3 for x in meas])} | "
                    f"**{s(err, '{:+.0f}')}%** | {s([x * 1e3 for x in cal])} | "
                    f"**{s([(x / p - 1) * 100 for x, p in zip(meas, cal)], '{:+.0f}')}%** | "
                    f"{s(ratio)} | {s([x * 1e3 for x in extra])} | "
                    f"{s([m['speed'] for m in runs])} | "
                    f"{s(drift_err, '{:+.0f}')}% |")
        for r in range(stages):
            fs = [m["factors"][r] for m in runs]
            factor_rows.append(f"| {name} | {stages} | {r} | " + " | ".join(
                s([f[i] for f in fs]) for i in range(3)) + " |")
        m2 = [m["tpm2"] for m in runs]
        resc = [m["rescaled"] for m in runs]
        after_rows.append(
            f"| {name} | {stages} | {pred * 1e3:.2f} | {s([x * 1e3 for x in resc])} | "
            f"{s([x * 1e3 for x in m2])} | {s([(x / pred - 1) * 100 for x in m2], '{:+.0f}')}% | "
            f"**{s([(x / p - 1) * 100 for x, p in zip(m2, resc)], '{:+.0f}')}%** |")
        for r in range(stages):
            st = plan.stages[r]
            rr = [m["ranks"][r] for m in runs]
            sh = {k: s([x["shares"][k] * 100 for x in rr], "{:.0f}") for k in CATS}
            stage_rows.append(
                f"| {name} | {stages} | {r} | {st.compute_s * 1e3:.2f} | "
                f"{s([x['fb'] * 1e3 for x in rr])} | {s([x['opt'] * 1e3 for x in rr])} | "
                f"**{s([x['busy'] for x in rr])}** | " + " | ".join(sh[k] for k in CATS) + " |")
            parts = [m["parts"][r] for m in runs]

            def ms(k: str) -> str:
                return f"{rc.med([p[k] for p in parts]) * 1e3:.2f}"
            part_rows.append(
                f"| {name} | {stages} | {r} | {pp[r]['forward'] * 1e3:.2f} / "
                f"{pp[r]['backward'] * 1e3:.2f} / {pp[r]['update'] * 1e3:.2f} | "
                f"{ms('forward')} / {ms('backward')} / {ms('optimizer')} | {ms('send')} | "
                f"{ms('recv_transfer')} / {ms('recv_late')} / {ms('recv_peer')} | {ms('idle')} | "
                f"{rc.med(meas) * 1e3:.2f} |")
    cmd = f"{rc.PY} -m bench.runtime_prediction" + (
        f" --rounds {args.rounds}" if args.rounds != 3 else "") + (
        f" --minibatches {args.minibatches}" if args.minibatches != 150 else "") + (
        f" --models {args.models}" if args.models != "mlp,gpt" else "") + (
        f" --stages {args.stages}" if args.stages != "1,2,4" else "")
    cores = len(os.sched_getaffinity(0))
    md = "\n".join([
        "## Prediction against measurement: time per minibatch and busy fractions",
        "",
        f"Command: `{cmd}` (from the repository root; {rc.machine()}; {args.rounds} rounds, the "
        f"runs interleaved; {elapsed:.0f} s in all)",
        "",
        "Models: " + "; ".join(descr[n] for n in models) + ". SGD lr 0.01 momentum 0.9, "
        f"{args.minibatches} minibatches per run, pipedream schedule through `run_distributed` "
        "(gloo, one process per stage). Plans: `fxpipe.compile(model, Cluster(workers=k), "
        "stages=k, straight=True)`, costs profiled on this machine with one thread "
        "(node by node, then scaled to whole training steps: `fxpipe.costmodel.calibrate`). "
        f"Measured time per minibatch: steady state (minibatches {args.warmup}..N-1, end of "
        "`U<k>` on the input stage's timeline). Error = measured / predicted - 1. "
        "The plan prices the runtime's overheads (`fxpipe.costmodel.overheads`; "
        f"{overhead_line(next(iter(plans.values())).profile.overheads)}, probed again at the "
        "start of this run); \"without the "
        "overheads\" is the same profile planned with them off (the cost model before them). "
        f"This machine has {cores} cores: at 4 stages, 4 ranks share them, which the plan "
        "(one worker, one core) does not price; `run_distributed` says so in a warning before "
        "the ranks start (`fxpipe.runtime.execution.cores`).",
        "",
        "| model | stages | without the overheads: predicted ms | error | overheads of the "
        "busiest stage ms | predicted ms/minibatch | measured ms/minibatch | error | "
        "after stage calibration: predicted ms | error | "
        "busiest rank: compute as run / plan | busiest rank: send + transfer + idle ms | "
        "machine: now / at the profile | error at the profile's speed |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        *rows,
        "",
        "After stage calibration: before each run, its stages ran "
        f"{CALIBRATE} minibatches in this process (the reference executor, the same schedule, "
        "stage replicas, stash and optimizer; no links) and the plan was priced on its profile "
        "rescaled to those stage times "
        "(`fxpipe.runtime.training.stage_calibration.calibrate_stages`); error = measured / that "
        "prediction - 1. The factors, measured / profiled per stage (forward, backward, update):",
        "",
        "| model | stages | stage | forward | backward | update |",
        "|---|---:|---:|---:|---:|---:|",
        *factor_rows,
        "",
        "Busiest rank: the one with the most forward + backward + optimizer time per minibatch "
        "in the run; its compute as run over the plan's F + B + U for that stage; and what it "
        "spent per minibatch posting sends, in transfers and in the executor between actions "
        "(none of which the plan prices; see the table after next).",
        "",
        "Machine: a plain training step of the whole model, timed in this process just before "
        "the run as the profile's whole-step calibration timed it, over that calibration's "
        "step (`machine_speed`): above 1, the machine ran slower than when the plan was "
        "profiled. Error at the profile's speed = measured / (predicted x that ratio) - 1: "
        "what is left of the error once the machine's drift is taken out (a diagnostic; the "
        "bold error is the prediction's).",
        "",
        "The profile's whole-step calibration (sum of the node-by-node times → one whole "
        "training step, ms; the ratio scales every node's time of that part):",
        "",
        "| model | forward | backward | update |",
        "|---|---|---|---|",
        *calib_rows,
        "",
        "Where each rank's time per minibatch goes (ms per minibatch over minibatches "
        f"{args.warmup}..N-2, medians over the rounds): the plan's forward / backward / update "
        "against the runtime's; posting sends; receive waits split by "
        "`fxpipe.runtime.timeline.wait_breakdown` into the transfer itself, a transfer that "
        "started late (the data was ready before the receive was posted) and the peer's compute; "
        "the executor's idle time between actions. The plan prices only the first column: "
        "sends, transfers, late starts and idle are what it leaves out on this runtime.",
        "",
        "| model | stages | stage | plan F / B / U | measured F / B / U | send | "
        "recv: transfer / late / peer | idle | measured ms/minibatch |",
        "|---|---:|---:|---|---|---:|---|---:|---:|",
        *part_rows,
        "",
        "Per stage, from the runtime's timeline (steady-state window = middle half of each rank's "
        "forward/backward events; the shares are % of that window; the plan's compute "
        "includes its profiled optimizer step, U):",
        "",
        "| model | stages | stage | plan compute ms (F+B+U) | measured F+B ms | "
        "measured optimizer ms | busy fraction | forward % | backward % | optimizer % | "
        "recv wait % | send % | idle % |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        *stage_rows,
        "",
        "After re-planning (issue 13, item 3): the profile rescaled stage by stage to the "
        f"forward, backward and optimizer times measured over minibatches {args.warmup}.."
        f"{args.minibatches // 2 - 1} of the same run (`fxpipe.runtime.pricing.replan.rescale`, what "
        "`trainer(replan=\"auto\")` re-plans from), the running plan costed on it "
        "(`plan_for`), against the time per minibatch measured over minibatches "
        f"{args.minibatches // 2}..N-1 (error = measured / predicted - 1, as above):",
        "",
        "| model | stages | predicted ms (profile) | predicted ms (rescaled) | measured ms, 2nd half | "
        "error before | error after re-plan |",
        "|---|---:|---:|---:|---:|---:|---:|",
        *after_rows,
        "",
        "Cells: median [min-max] over the rounds.",
    ])
    publish(SECTION, md, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
