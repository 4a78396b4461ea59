"""Streaming data through the Trainer: memory over long epochs, time to the first minibatch, and
the cost of making schedules, measured side by side in one run.

Run from the repository root:  .venv/bin/python -m bench.data_streaming
Writes its page benchmarks/data_streaming.md (``--out FILE`` writes the markdown there instead).

1. Memory: a 2-stage MLP (16 -> 64 -> 4, gloo, 2 torchrun ranks) trains one epoch from a LAZY
   loader (each minibatch made when asked for, nothing held) of N minibatches, N = 10,000 and
   100,000; every rank reports its resident set before ``fit`` and its peak at the end
   (``getrusage`` ``ru_maxrss``). Flat memory = the same peak for both N.
2. Time to the first minibatch: seconds from the call to ``fit`` to the start of the first
   forward on rank 0 (taken by a wrapper around the executor's forward), with a fast lazy loader
   and with a slow one (10 ms per minibatch) on 3 stages, whose middle rank reads nothing and
   waits for the others (``timeout_s`` = 2 s, shorter than reading a full 256-minibatch segment:
   such a wait must not be bounded by the pipeline's timeout).
3. ``make_schedule`` wall time for n minibatches (4 stages, ``[1, 1, 1, 1]``), n up to 100,000:
   linear means a constant time per minibatch.
"""
from __future__ import annotations

import argparse
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

SECTION = "data_streaming"
ROOT = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------- the worker
class LazyLoader:
    """``n`` minibatches (8 x 16 inputs, 8 x 4 targets), each made on demand from its index
    (the same on every rank), ``delay_s`` of "reading" each; holds nothing."""

    def __init__(self, n: int, delay_s: float = 0.0) -> None:
        self.n, self.delay_s = n, delay_s

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        import torch

        for k in range(self.n):
            if self.delay_s:
                time.sleep(self.delay_s)
            g = torch.Generator().manual_seed(k)
            yield torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)


def rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def worker(args: argparse.Namespace) -> None:
    import functools

    import torch
    import torch.fx as fx
    import torch.nn as nn
    import torch.nn.functional as F

    from fxpipe.codegen.split import placed_nodes, split_graph
    from fxpipe.runtime.execution import executor
    from fxpipe.runtime.training.trainer import Trainer

    torch.set_num_threads(1)
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(16, 64), nn.Tanh()]
    for _ in range(args.stages - 2):
        layers += [nn.Linear(64, 64), nn.Tanh()]
    model = nn.Sequential(*layers, nn.Linear(64, 4))
    gm = fx.symbolic_trace(model)
    nodes = placed_nodes(gm)
    per = len(nodes) / args.stages
    stages = split_graph(gm, {n.name: min(args.stages - 1, int(i / per))
                              for i, n in enumerate(nodes)})
    first: list[float] = []
    real = executor.RankExecutor.forward

    def timed(self, *a, **kw):
        if not first:
            first.append(time.perf_counter())
        return real(self, *a, **kw)
    executor.RankExecutor.forward = timed  # type: ignore[method-assign]
    trainer = Trainer(stages, [1] * args.stages, F.mse_loss,
                      functools.partial(torch.optim.SGD, lr=0.01), progress=False,
                      timeout_s=args.timeout)
    loader = LazyLoader(args.n, args.delay)
    before = rss_kib()
    t0 = time.perf_counter()
    history = trainer.fit(loader, epochs=1)
    wall = time.perf_counter() - t0
    out = {"rank": int(os.environ["RANK"]), "rss_before_kib": before,
           "peak_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
           "first_forward_s": first[0] - t0 if first else None, "wall_s": wall,
           "loss": history[-1]["loss"], "samples_per_s": history[-1]["samples_per_s"]}
    Path(args.result).with_suffix(f".rank{out['rank']}.json").write_text(json.dumps(out))
    trainer.close()


# ----------------------------------------------------------------------------- the parent

def job(n: int, stages: int, delay: float, timeout: float) -> dict:
    """One torchrun job; every rank's report."""
    with tempfile.TemporaryDirectory() as tmp:
        result = str(Path(tmp) / "r")
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={stages}",
               "--master-addr=127.0.0.1", f"--master-port={free_port()}", "-m", "bench.data_streaming", "--bench-worker",
               "--epoch-minibatches", str(n), "--pipe-stages", str(stages), "--read-delay", str(delay),
               "--msg-timeout", str(timeout), "--result-file", result]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=3600)
        if proc.returncode != 0:
            raise SystemExit(f"job failed ({' '.join(cmd)}):\n{proc.stdout[-3000:]}"
                             f"{proc.stderr[-3000:]}")
        ranks = [json.loads(p.read_text()) for p in sorted(Path(tmp).glob("r.rank*.json"))]
        return {"n": n, "stages": stages, "delay": delay, "ranks": ranks,
                "job_s": time.perf_counter() - t0}


def schedule_times(sizes: list[int]) -> list[tuple[str, int, float]]:
    from fxpipe.runtime.schedules.kinds import make_schedule

    out = []
    for kind in ("pipedream", "1f1b-flush"):
        for n in sizes:
            t0 = time.perf_counter()
            make_schedule(kind, [1, 1, 1, 1], n)
            out.append((kind, n, time.perf_counter() - t0))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    # the worker's options (after the script in a torchrun command line; torchrun would take
    # an abbreviation of its own options, such as --n, for one of them)
    ap.add_argument("--bench-worker", dest="worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--epoch-minibatches", dest="n", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--pipe-stages", dest="stages", type=int, default=2, help=argparse.SUPPRESS)
    ap.add_argument("--read-delay", dest="delay", type=float, default=0.0,
                    help=argparse.SUPPRESS)
    ap.add_argument("--msg-timeout", dest="timeout", type=float, default=60.0,
                    help=argparse.SUPPRESS)
    ap.add_argument("--result-file", dest="result", default="", help=argparse.SUPPRESS)
    ap.add_argument("--epochs-of", type=int, nargs="+", default=[10_000, 100_000])
    ap.add_argument("--schedule-sizes", type=int, nargs="+",
                    default=[1_000, 4_000, 16_000, 64_000, 100_000])
    ap.add_argument("--out", default=None, help="write the markdown here instead of "
                    "benchmarks/data_streaming.md")
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    started = time.perf_counter()
    memory = [job(n, 2, 0.0, 60.0) for n in args.epochs_of]
    fast = job(2_000, 3, 0.0, 2.0)
    slow = job(600, 3, 0.010, 2.0)
    sched = schedule_times(args.schedule_sizes)
    load = ", ".join(f"{v:.1f}" for v in os.getloadavg())
    import torch
    lines = [
        "## Streaming data: memory over long epochs, time to the first minibatch, schedules",
        "",
        f"Command: `.venv/bin/python -m bench.data_streaming` (from the repository root; "
        f"{os.cpu_count()} CPU cores shared with other jobs (load average {load} at the end), "
        f"torch {torch.__version__}, Python {platform.python_version()}, 1 thread per process, "
        f"gloo; {time.perf_counter() - started:.0f} s in all)",
        "",
        "A 2-stage MLP (16-64-4, batch 8, plain SGD, pipedream, default segments) trains one "
        "epoch under torchrun from a lazy loader that makes each minibatch when asked for. "
        "Resident memory per rank before `fit` and its peak at the end (`ru_maxrss`):",
        "",
        "| minibatches per epoch | rank | RSS before fit | peak RSS | growth | samples/s |",
        "|---:|---:|---:|---:|---:|---:|"]
    for m in memory:
        for r in m["ranks"]:
            lines.append(f"| {m['n']:,} | {r['rank']} | {r['rss_before_kib'] / 1024:.0f} MiB | "
                         f"{r['peak_kib'] / 1024:.0f} MiB | "
                         f"{(r['peak_kib'] - r['rss_before_kib']) / 1024:+.0f} MiB | "
                         f"{r['samples_per_s']:.0f} |")
    lines += [
        "",
        "Time from the call to `fit` to the first forward on rank 0 (3 stages, 3 ranks; the "
        "middle rank reads no data; `timeout_s` = 2 s):",
        "",
        "| loader | minibatches | first forward after | whole epoch |",
        "|---|---:|---:|---:|"]
    for name, j in (("lazy, no delay", fast), ("lazy, 10 ms per minibatch", slow)):
        r0 = next(r for r in j["ranks"] if r["rank"] == 0)
        lines.append(f"| {name} | {j['n']:,} | {r0['first_forward_s']:.3f} s | "
                     f"{r0['wall_s']:.1f} s |")
    lines += [
        "",
        "`make_schedule(kind, [1, 1, 1, 1], n)` (generation and validation), in this process:",
        "",
        "| kind | n | seconds | microseconds per minibatch |",
        "|---|---:|---:|---:|"]
    for kind, n, dt in sched:
        lines.append(f"| {kind} | {n:,} | {dt:.3f} | {dt / n * 1e6:.1f} |")
    lines += [
        "",
        "Single runs (one job per row), so the figures carry this machine's noise; the "
        "comparisons that matter are within a table: peak RSS at 10x the epoch length, and "
        "time per minibatch across n. Before this change (issue 9): the input rank read the "
        "whole epoch before the first forward, and `make_schedule` was quadratic (1.6 s at "
        "4,000 minibatches)."]
    publish(SECTION, "\n".join(lines), args.out)


if __name__ == "__main__":
    main()
