"""The statistical-efficiency ablation: every schedule variant x depth x optimizer x seed x task.

    .venv/bin/python -m bench.ablation.run                        # the published run (hours)
    .venv/bin/python -m bench.ablation.run --tasks mlp --depths 2 --seeds 1 --updates 30  # smoke
    .venv/bin/python -m bench.ablation.run --first-seed 3 --variants 1f1b-flush,pipedream  # seeds 3-5
    .venv/bin/python -m bench.ablation.run --long    # the 1,000-update rows (LONG below)

Each configuration trains on fxpipe's reference executor (see bench/ablation/train.py) and
appends one JSON line to ``--out`` (default bench/ablation/results.jsonl, in the repository:
commit it with the report, so the published section can be regenerated); configurations
already there are skipped, so an interrupted run resumes. ``--workers`` processes run in
parallel (one torch thread each). ``python -m bench.ablation.report`` turns the results into
benchmarks/statistical-efficiency.md and the figure.

gpipe is not trained separately: on the reference executor it performs exactly 1f1b-flush's
arithmetic (same microbatches, same weight version, gradients summed in the same order), which
``tests/bench/test_ablation.py`` checks bit for bit; the report gives it flush's statistics and
its own simulated throughput.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import time
from pathlib import Path
from typing import Any

# in the repository, not /tmp: a sweep's results outlive its machine (a lost /tmp took the
# data behind a published report once)
DEFAULT_OUT = str(Path(__file__).resolve().parent / "results.jsonl")
SAME_AT_EVERY_DEPTH = ("1f1b-flush", "2bw")
TRAINED = ("1f1b-flush", "2bw", "pipedream", "pipedream-nostash", "pipedream+vsync", "localsgd",
           "pipedream+lr_scale", "pipedream+predict", "pipedream+dc", "pipedream+momentum",
           "pipedream+predict+momentum")
LONG = ("--tasks lm,mlp --depths 4,8 --optimizers adamw,muon --variants "
        "1f1b-flush,pipedream,pipedream+nesterov,2bw --updates 1000 --out "
        "bench/ablation/results-long.jsonl")
"""The longer horizon (issue 25): 1,000 updates, AdamW and Muon, the Nesterov correction and
2bw beside flush and pipedream (``--long`` runs it; its report: ``bench.ablation.long_report``)."""


def _work(args: tuple[str, int, str, str, int, int | None]) -> dict[str, Any]:
    import torch

    torch.set_num_threads(1)
    from .tasks import make_task
    from .train import Run, run_one

    task, S, variant, opt, seed, updates = args
    try:
        return run_one(make_task(task, updates), Run(task, S, variant, opt, seed))
    except Exception as err:  # noqa: BLE001 - recorded, the sweep goes on
        return {"key": Run(task, S, variant, opt, seed).key, "task": task, "S": S,
                "variant": variant, "opt": opt, "seed": seed, "error": repr(err)}


def main(argv: list[str] | None = None) -> int:
    from .train import OPTIMIZERS

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tasks", default="mlp,cnn,lm")
    p.add_argument("--depths", default="2,4,8")
    p.add_argument("--optimizers", default=",".join(o for o in OPTIMIZERS if o != "muon"))
    p.add_argument("--variants", default=",".join(TRAINED))
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--first-seed", type=int, default=0,
                   help="seeds first-seed .. first-seed + seeds - 1 (held-out seeds: 3)")
    p.add_argument("--updates", type=int, default=None, help="override every task's budget")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--out", default=DEFAULT_OUT)
    p.add_argument("--long", action="store_true", help=f"the long rows: {LONG}")
    argv = list(argv if argv is not None else __import__("sys").argv[1:])
    if "--long" in argv:
        argv = [x for x in argv if x != "--long"] + LONG.split()
    a = p.parse_args(argv)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    done = set()
    if out.exists():
        done = {json.loads(line)["key"] for line in out.read_text().splitlines() if line.strip()}
    jobs = [(t, int(S), v, o, seed, a.updates)  # seeds outermost: complete tables early
            for seed in range(a.first_seed, a.first_seed + a.seeds) for t in a.tasks.split(",")
            for S in a.depths.split(",") for o in a.optimizers.split(",")
            for v in a.variants.split(",")
            if f"{t}|{S}|{v}|{o}|{seed}" not in done]
    # flush and 2bw do the same arithmetic at every depth (the mean gradient of the update's B
    # samples, on the current / the previous weights; only rounding differs): their runs at
    # S > 2 repeat S = 2 and go last (the report falls back to S = 2 where they are missing)
    jobs.sort(key=lambda j: j[2] in SAME_AT_EVERY_DEPTH and j[1] > 2)
    print(f"{len(jobs)} runs to do ({len(done)} already in {out}), {a.workers} workers", flush=True)
    t0 = time.time()
    ctx = mp.get_context("spawn")
    with ctx.Pool(a.workers, maxtasksperchild=20) as pool, out.open("a") as f:
        for i, rec in enumerate(pool.imap_unordered(_work, jobs)):
            rec["loadavg"] = [round(x, 2) for x in os.getloadavg()]
            f.write(json.dumps(rec) + "\n")
            f.flush()
            status = rec.get("error") or rec.get("diverged") or f"final {rec['final']:.4g}"
            print(f"[{i + 1}/{len(jobs)} {time.time() - t0:.0f}s] {rec['key']}: {status} "
                  f"({rec.get('seconds', '-')} s)", flush=True)
    print(f"done in {(time.time() - t0) / 60:.1f} min", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
