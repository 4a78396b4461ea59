"""Do no harm on a slow link: a 2-stage plan that measures slower than one worker falls back.

    sudo .venv/bin/python -m bench.harm_fallback            # gpt at 20, vgg at 50 Mbit/s, 3 launches
    sudo .venv/bin/python -m bench.harm_fallback --smoke    # gpt at 20, one launch

Two emulated hosts (``tools.cluster``, one core each, links shaped to R Mbit/s), the models and
2-stage plans of ``bench.pipeline_cluster`` (costs measured on one core; each rank compiles
with costs measured on its own core, as a user's job does), ``1f1b-flush`` with
each minibatch cut into 2 microbatches (``split=2``: one update per minibatch, the user's
recipe), segments of 8 minibatches (48 in all).
Three runs per launch, from the same weights on the same minibatches:

* ``2 workers``: the 2-stage plan as planned;
* ``replan="auto"``: the same, with re-planning on: after the first segment the plan may be
  re-cut from measured stage times (``Replanner``); from a plan's second segment on every rank
  checks whether the segment took longer than one worker would have (``Trainer.harm``: the
  least of all its stages' compute together and the compiled profile's whole steps for its
  samples, + 5%) and, on rank 0's verdict, the job goes on with one worker
  (``Replanner.fall_back``);
* ``one process``: a plain PyTorch loop on one core, no network.

Reported: samples/s over the last half of the minibatches (from minibatch 24: a fall back at
the earliest, after a re-cut at 8, happens at 24), median [min-max] over the launches; what the
verdict said; the switch's own cost (the fit's wall time less its segments'); the verdict's
inputs in the 2-worker runs (each segment from the second on against the two figures for one
worker; the median per launch).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.pipeline_cluster import (BATCHES, MODELS, _run, batches, build, launch, make_plans,
                                    optimizer, plain_loop_rate)

SECTION = "harm-fallback"
CASES = (("gpt", 20), ("vgg", 50))
M = 2  # microbatches each minibatch is cut into
SEGMENT, COUNT, FROM = 8, 48, 24  # minibatches per segment, in all, timed from


def worker(args: argparse.Namespace) -> None:
    """One rank: train the plan with 1f1b-flush, split=2, optionally replan='auto'; rank 0
    writes each segment's (position, minibatches, seconds) and the re-planning records."""
    import torch

    import fxpipe
    from fxpipe.passes import Plan

    torch.set_num_threads(1)
    model, make, loss = build(args.model)
    size = BATCHES[args.model]
    x, _ = make(size, 0)
    # costs measured on this rank's core, as a user's job would (the harm verdict holds the
    # segments against the measured profile's whole steps; an estimated one is not used)
    compiled = fxpipe.compile(model, fxpipe.Cluster(workers=2), example_inputs=(x,),
                              loss_fn=loss, plan=Plan.load(args.plan))
    kw = dict(optimizer=optimizer, schedule="1f1b-flush", split=M, segment=SEGMENT,
              timeout_s=300, progress=False)
    if args.replan:
        kw["replan"] = "auto"
    trainer = compiled.trainer(**kw)
    segments: list[tuple[int, int, float]] = []
    run = trainer._train_segment

    def timed(parts, epoch, pos, n, final):  # noqa: ANN001, ANN202 - the bench's own record
        out = run(parts, epoch, pos, n, final)
        segments.append((pos, n, trainer._dt))
        return out
    trainer._train_segment = timed
    verdicts: list[tuple[float, float | None, float]] = []  # the verdict's inputs per segment
    check = trainer._check_harm

    def checked(busy, dt, n):  # noqa: ANN001, ANN202 - the bench's own record
        verdicts.append((sum(b * r for b, r in zip(busy, trainer.replicas)),
                         trainer._one_worker_s(trainer._samples), dt))
        return check(busy, dt, n)
    trainer._check_harm = checked
    t0 = time.perf_counter()
    trainer.fit(batches(args.model, size, COUNT), epochs=1)
    wall = time.perf_counter() - t0
    rank = int(os.environ["RANK"])
    if rank == 0:
        recs = [] if trainer.replanner is None else [
            {"position": r.position, "adopted": r.adopted,
             "replicas": list(r.proposal.proposed.replicas), "gain": r.proposal.gain}
            for r in trainer.replanner.records]
        Path(f"{args.result}.rank0").write_text(json.dumps({
            "segments": segments, "wall_s": wall, "records": recs, "harm": trainer.harm,
            "verdicts": verdicts}))
    else:
        Path(f"{args.result}.rank{rank}").write_text(json.dumps({"idle": trainer.idle}))
    trainer.close()


def timed_rate(res: dict, size: int, start: int = FROM) -> float:
    """Samples/s over the segments from minibatch ``start`` on."""
    segs = [(n, dt) for pos, n, dt in res["segments"] if pos >= start]
    return size * sum(n for n, _ in segs) / sum(dt for _, dt in segs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bench-worker", dest="worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--replan", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--plan", default="", help=argparse.SUPPRESS)
    ap.add_argument("--model", default="gpt", help=argparse.SUPPRESS)
    ap.add_argument("--result", default="", help=argparse.SUPPRESS)
    ap.add_argument("--launches", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="gpt at 20 Mbit/s, one launch")
    ap.add_argument("--out", default=None, help="write the markdown here instead")
    args = ap.parse_args()
    if args.worker:
        if args.one:
            Path(args.result).write_text(json.dumps(plain_loop_rate(args.model, COUNT, FROM)))
        else:
            worker(args)
        return
    from tools.cluster import EmulatedCluster

    cases = CASES[:1] if args.smoke else CASES
    launches = 1 if args.smoke else args.launches
    started = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix="fxp-harm-"))
    rows = []
    for model, rate in cases:
        plan = make_plans(model, [rate], tmp)[f"{rate}-two"]
        got: dict[str, list] = {"two": [], "replan": [], "one": []}
        with EmulatedCluster(hosts=2, bandwidth=f"{rate}Mbit", latency=0, cpus=[0, 1],
                             prefix="fxharm") as cluster:
            for i in range(launches):
                for name in (("two", "replan") if i % 2 == 0 else ("replan", "two")):
                    extra = ["--replan"] if name == "replan" else []
                    ranks = launch(cluster, tmp, ["--bench-worker", "--model", model,
                                                  "--plan", plan["path"], *extra],
                                   f"{model}-{rate}-{name}-{i}", module="bench.harm_fallback")
                    got[name].append(ranks)
        for i in range(launches):
            out = tmp / f"one-{model}-{i}.json"
            _run(["taskset", "-c", "1", sys.executable, "-m", "bench.harm_fallback",
                  "--bench-worker", "--one", "--model", model, "--result", str(out)])
            got["one"].append(json.loads(out.read_text()))
        rows.append((model, rate, plan, got))
        print(f"{model} {rate} Mbit/s done", file=sys.stderr, flush=True)
    from bench._report import publish
    publish(SECTION, page(rows, launches, started), args.out)


def _med(xs: list[float], digits: int = 1, unit: str = "") -> str:
    f = f"{{:.{digits}f}}"
    return (f"{f.format(statistics.median(xs))}{unit} [{f.format(min(xs))}-"
            f"{f.format(max(xs))}]")


def page(rows: list, launches: int, started: float) -> str:
    import torch

    lines = ["# Do no harm: falling back to one worker on a slow link", "",
             "Command: `.venv/bin/python -m bench.harm_fallback` (from the repository root, as "
             f"root; torch {torch.__version__}, {os.cpu_count()} CPU cores, one per emulated "
             f"host, gloo; {launches} launches, the two fxpipe runs alternating; "
             f"{time.perf_counter() - started:.0f} s in all; load average at the end "
             f"{', '.join(f'{v:.1f}' for v in os.getloadavg())})", "",
             __doc__.split("\n\n", 2)[2].strip(), "",
             "| model | Mbit/s | 2-stage plan (predicted ms/minibatch) | one process | 2 workers "
             "| / one | replan='auto' | / one | fell back (launches) | verdict: one worker "
             "faster by | switch s | 2 workers: segment / compute sum | segment / profile's "
             "steps |", "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for model, rate, plan, got in rows:
        size = BATCHES[model]
        one = got["one"]
        two = [timed_rate(r[0], size) for r in got["two"]]
        rep = [timed_rate(r[0], size) for r in got["replan"]]
        fell = [bool(r[0]["records"]) and r[0]["records"][-1]["replicas"] == [1]
                for r in got["replan"]]
        ratio = [1 + r[0]["records"][-1]["gain"] for r, f in zip(got["replan"], fell) if f]
        switch = [r[0]["wall_s"] - sum(dt for _, _, dt in r[0]["segments"])
                  for r in got["replan"]]
        # the verdict's inputs in the 2-worker runs, from the second segment on (medians)
        vs = [r[0]["verdicts"][1:] for r in got["two"]]
        by_sum = [statistics.median(dt / c for c, _, dt in v) for v in vs if v]
        by_step = [statistics.median(dt / p for _, p, dt in v) for v in vs
                   if v and all(p for _, p, _ in v)]
        lines.append(
            f"| {model} | {rate} | {plan['replicas']} ({1e3 * plan['predicted_s']:.1f}) | "
            f"{_med(one)} | {_med(two)} | {_med([a / b for a, b in zip(two, one)], 2)} | "
            f"{_med(rep)} | {_med([a / b for a, b in zip(rep, one)], 2)} | "
            f"{sum(fell)} of {len(fell)} | {_med(ratio, 2, 'x') if ratio else '-'} | "
            f"{_med(switch)} | {_med(by_sum, 2) if by_sum else '-'} | "
            f"{_med(by_step, 2) if by_step else '-'} |")
    lines += ["", f"Models: {'; '.join(f'{k}: {v}' for k, v in MODELS.items())}.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
