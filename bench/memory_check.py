"""Predicted against measured memory per stage, per schedule (issue 26).

Run from the repository root:  .venv/bin/python -m bench.memory_check
Writes benchmarks/memory-check.md and keeps every job's report in
benchmarks/memory-check.raw.json (``--resume`` skips the jobs already there; ``--only gpt``
runs one model).

Each row is one torchrun job of 4 ranks (gloo, one thread each, this machine's CPU): a model
compiled for 4 straight stages with the schedule it then trains (``fxpipe.compile(...,
schedule=kind, microbatches=m, recompute=..., optimizer=AdamW)``: the plan's memory priced by
that schedule's rule, state as AdamW keeps it), trained by ``compiled.trainer(schedule=kind,
measure_memory=True)`` for 16 minibatches (4 updates of m = 4 under the flushing kinds). The
prediction is the plan's ``memory_bytes`` per stage, what ``plan.summary()`` shows; the
measurement is the rank's peak of live tensor bytes over the whole run
(:mod:`fxpipe.runtime.replica.live_bytes`: every storage an operator returns, counted once,
until freed). The parts of the peak say which term misses: tensors held when training began
(the weights), made by the forwards (activations, outputs on their way), the backwards
(gradients), the updates (AdamW's moments, made at the first step) and receives.

Models: the zoo's GPT and VGG-mini (``fxpipe.models``) and a Hugging Face GPT-2 from a tiny config
(4 layers, 64 wide), batch sizes chosen so activations and weights are of one order.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench._report import publish

SECTION = "memory-check"
ROOT = Path(__file__).resolve().parents[1]
RAW = ROOT / "benchmarks" / "memory-check.raw.json"
STAGES, M, MINIBATCHES = 4, 4, 16
MODELS = {  # name -> (fxpipe.models.resolve name, batch size)
    "gpt": ("gpt", 16),
    "vgg-mini": ("vgg16", 16),
    "hf-gpt2": ("hf:GPT2LMHeadModel:n_layer=4,n_embd=64,n_head=4,vocab_size=256,"
                "n_positions=64", 8),
}
KINDS = ("pipedream", "1f1b-flush", "zb-h2", "2bw")
RECOMPUTE = ("never", "always")
FLUSHING = ("1f1b-flush", "zb-h2")


def _adamw(params):  # noqa: ANN001, ANN202 (an optimizer factory)
    import torch
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)


# ----------------------------------------------------------------------------- the worker
def worker(args: argparse.Namespace) -> None:
    import torch

    import fxpipe
    from fxpipe.models import resolve

    torch.set_num_threads(1)
    name, batch = MODELS[args.model]
    spec = resolve(name, batch_size=batch, seq_len=32, seed=0)
    m = M if args.kind in FLUSHING else None
    compiled = fxpipe.compile(spec.model, fxpipe.Cluster(workers=STAGES),
                              example_inputs=spec.example_inputs, loss_fn=spec.loss_fn,
                              stages=STAGES, straight=True, repeats=2, optimizer=_adamw,
                              recompute=args.recompute, schedule=args.kind, microbatches=m)
    loader = [spec.make_batch(batch, seed=i) for i in range(MINIBATCHES)]
    trainer = compiled.trainer(optimizer=_adamw, schedule=args.kind, microbatches=m,
                               measure_memory=True, progress=False, timeout_s=120)
    t0 = time.perf_counter()
    trainer.fit(loader, epochs=1)
    rank = int(os.environ["RANK"])
    out = {"rank": rank, "stage": trainer.backend.me[0], "peak": trainer.memory_peaks[
        trainer.backend.me], "parts": trainer.backend.memory.parts,
        "wall_s": time.perf_counter() - t0}
    if rank == 0:
        checks = compiled.memory_check(trainer)
        plan = compiled.plan
        out["plan"] = {"rule": plan.memory_rule.label(), "recompute": list(plan.recompute),
                       "in_flight": [sp.in_flight for sp in plan.stages],
                       "parameter_bytes": [sp.parameter_bytes for sp in plan.stages],
                       "activation_bytes": [sp.activation_bytes for sp in plan.stages],
                       "rows": [{"stage": c.stage, "state": c.state, "versions": c.versions,
                                 "activations": c.activations, "measured": c.measured}
                                for c in checks]}
    Path(args.result).with_suffix(f".rank{rank}.json").write_text(json.dumps(out))
    trainer.close()


# ----------------------------------------------------------------------------- the parent
def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def job(model: str, kind: str, recompute: str) -> dict:
    """One torchrun job; the plan's prediction and every rank's measured peak."""
    with tempfile.TemporaryDirectory() as tmp:
        result = str(Path(tmp) / "r")
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={STAGES}",
               "--master-addr=127.0.0.1", f"--master-port={_port()}", "-m", "bench.memory_check",
               "--bench-worker", "--model", model, "--kind", kind, "--recompute", recompute,
               "--result-file", result]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=1800)
        if proc.returncode != 0:
            return {"model": model, "kind": kind, "recompute": recompute,
                    "error": (proc.stdout[-1500:] + proc.stderr[-1500:])}
        ranks = sorted((json.loads(p.read_text()) for p in Path(tmp).glob("r.rank*.json")),
                       key=lambda r: r["rank"])
        return {"model": model, "kind": kind, "recompute": recompute, "ranks": ranks}


def _mib(b: float) -> str:
    return f"{b / (1 << 20):.2f}"




def page(runs: list[dict]) -> str:
    lines = ["## Predicted against measured memory per stage", "",
             "Command: `.venv/bin/python -m bench.memory_check` (4 torchrun ranks, gloo, one "
             "thread each; raw reports in `benchmarks/memory-check.raw.json`). Predicted: the "
             "plan's bytes per replica for the schedule it was compiled for (what "
             "`plan.summary()` shows), in its rule's terms: state `P (2 + opt)` (AdamW: opt = "
             "2), stashed versions, activations (the in-flight sets; recomputing: kept inputs "
             "plus one set). Measured: each rank's peak of live tensor bytes over 16 "
             "minibatches (`Trainer(measure_memory=True)`), and its parts by what made each "
             "tensor: held when training began (weights), forwards (F), backwards (B, W), "
             "updates (U: AdamW's moments and the step's temporaries), receives (comm). MiB.",
             "",
             "| model | schedule | recompute | stage | predicted | state | versions | "
             "activations | measured | measured / predicted | held | F | B+W | U | comm |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    worst: list[tuple[float, str]] = []
    for run in runs:
        if "error" in run:
            lines.append(f"| {run['model']} | {run['kind']} | {run['recompute']} | "
                         f"failed: {run['error'].strip().splitlines()[-1][:120]} |"
                         + " |" * 11)
            continue
        plan = run["ranks"][0]["plan"]
        by_stage = {r["stage"]: r for r in run["ranks"]}
        for row in plan["rows"]:
            pred = row["state"] + row["versions"] + row["activations"]
            parts = by_stage[row["stage"]]["parts"]
            ratio = row["measured"] / pred
            worst.append((ratio, f"{run['model']} {run['kind']} {run['recompute']} "
                                 f"stage {row['stage']}"))
            lines.append(
                f"| {run['model']} | {run['kind']} | {run['recompute']} | {row['stage']} | "
                f"{_mib(pred)} | {_mib(row['state'])} | {_mib(row['versions'])} | "
                f"{_mib(row['activations'])} | {_mib(row['measured'])} | {ratio:.2f} | "
                f"{_mib(parts.get('held', 0))} | {_mib(parts.get('F', 0))} | "
                f"{_mib(parts.get('B', 0) + parts.get('W', 0))} | {_mib(parts.get('U', 0))} | "
                f"{_mib(parts.get('comm', 0) + parts.get('other', 0))} |")
    within = sum(0.9 <= r <= 1.1 for r, _ in worst)
    lines += ["", f"Stages within 10% of their prediction: {within} of {len(worst)}; "
              f"measured / predicted from {min(worst)[0]:.2f} ({min(worst)[1]}) to "
              f"{max(worst)[0]:.2f} ({max(worst)[1]})." if worst else "No run finished."]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--bench-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", default="gpt", choices=list(MODELS))
    p.add_argument("--kind", default="1f1b-flush", choices=list(KINDS))
    p.add_argument("--recompute", default="never", choices=list(RECOMPUTE))
    p.add_argument("--result-file", dest="result", default=None)
    p.add_argument("--only", default=None, help="one model (a key of MODELS)")
    p.add_argument("--resume", action="store_true", help="keep the finished jobs of the raw file")
    p.add_argument("--out", default=None, help="write the markdown here instead of the page")
    args = p.parse_args()
    if args.bench_worker:
        worker(args)
        return
    runs: list[dict] = json.loads(RAW.read_text()) if args.resume and RAW.exists() else []
    done = {(r["model"], r["kind"], r["recompute"]) for r in runs if "error" not in r}
    runs = [r for r in runs if "error" not in r]
    for model in ([args.only] if args.only else MODELS):
        for kind in KINDS:
            for rc in RECOMPUTE:
                if (model, kind, rc) in done:
                    continue
                t0 = time.perf_counter()
                run = job(model, kind, rc)
                print(f"{model} {kind} {rc}: {'failed' if 'error' in run else 'done'} "
                      f"({time.perf_counter() - t0:.0f} s)", flush=True)
                runs.append(run)
                RAW.write_text(json.dumps(runs, indent=1))
    order = {(m, k, r): i for i, (m, k, r) in enumerate(
        (m, k, r) for m in MODELS for k in KINDS for r in RECOMPUTE)}
    runs.sort(key=lambda r: order[(r["model"], r["kind"], r["recompute"])])
    text = page(runs)
    if args.out:
        Path(args.out).write_text(text + "\n")
    else:
        publish(SECTION, text, None)


if __name__ == "__main__":
    main()
