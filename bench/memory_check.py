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
(4 layers, 64 wide), batch sizes chosen so activations and weights are of one order, and the
same GPT-2 with a 4096-token vocabulary, whose tied embedding is most of its weights (the head's
stage keeps a copy).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench._report import publish
from fxpipe.runtime.execution.ports import free_port  # torch-free

SECTION = "memory-check"
ROOT = Path(__file__).resolve().parents[1]
RAW = ROOT / "benchmarks" / "memory-check.raw.json"
STAGES, M, MINIBATCHES = 4, 4, 16
MODELS = {  # name -> (fxpipe.models.resolve name, batch size)
    "gpt": ("gpt", 16),
    "vgg-mini": ("vgg16", 16),
    "hf-gpt2": ("hf:GPT2LMHeadModel:n_layer=4,n_embd=64,n_head=4,vocab_size=256,"
                "n_positions=64", 8),
    # the same with a vocabulary that dwarfs the rest: its tied embedding (1 MiB) has a copy on
    # the stage of the head, and the two copies' gradients are summed at each update
    "hf-gpt2-4k": ("hf:GPT2LMHeadModel:n_layer=4,n_embd=64,n_head=4,vocab_size=4096,"
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
                       "copy_bytes": [sp.copy_bytes for sp in plan.stages],
                       "activation_bytes": [sp.activation_bytes for sp in plan.stages],
                       "rows": [{"stage": c.stage, "state": c.state, "versions": c.versions,
                                 "activations": c.activations, "measured": c.measured,
                                 "walked": c.walked, "walked_parts": dict(c.walked_parts)}
                                for c in checks]}
    Path(args.result).with_suffix(f".rank{rank}.json").write_text(json.dumps(out))
    trainer.close()


# ----------------------------------------------------------------------------- the parent

def job(model: str, kind: str, recompute: str) -> dict:
    """One torchrun job; the plan's prediction and every rank's measured peak."""
    with tempfile.TemporaryDirectory() as tmp:
        result = str(Path(tmp) / "r")
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={STAGES}",
               "--master-addr=127.0.0.1", f"--master-port={free_port()}", "-m",
               "bench.memory_check", "--bench-worker", "--model", model, "--kind", kind, "--recompute", recompute,
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




def _rows(runs: list[dict]) -> list[dict]:
    """One dict per (run, stage): the plan's terms and the measured peak's parts, in bytes."""
    out = []
    for run in runs:
        if "error" in run:
            continue
        by_stage = {r["stage"]: r for r in run["ranks"]}
        plan = run["ranks"][0]["plan"]
        copies = plan.get("copy_bytes") or [0.0] * len(plan["parameter_bytes"])  # older runs
        for row in plan["rows"]:
            parts = by_stage[row["stage"]]["parts"]
            out.append({"model": run["model"], "kind": run["kind"],
                        "recompute": run["recompute"], **row,
                        "P": plan["parameter_bytes"][row["stage"]] + copies[row["stage"]],
                        "predicted": row["state"] + row["versions"] + row["activations"],
                        "held": parts.get("held", 0), "F": parts.get("F", 0),
                        "BW": parts.get("B", 0) + parts.get("W", 0), "U": parts.get("U", 0),
                        "comm": parts.get("comm", 0) + parts.get("other", 0),
                        "walked": row.get("walked") or float("nan"),
                        "wparts": row.get("walked_parts") or {}})
    return out


def _span(values: list[float]) -> str:
    values = sorted(values)
    return f"{values[0]:.2f} / {values[len(values) // 2]:.2f} / {values[-1]:.2f}"


def page(runs: list[dict]) -> str:
    rows = _rows(runs)
    lines = ["## Predicted against measured memory per stage", "",
             "Command: `.venv/bin/python -m bench.memory_check` (4 torchrun ranks, gloo, one "
             "thread each; raw reports in `benchmarks/memory-check.raw.json`). Predicted: the "
             "plan's bytes per replica for the schedule it was compiled for (what "
             "`plan.summary()` shows), in its rule's terms: state `P (2 + opt)` (AdamW: opt = "
             "2), stashed versions, activations (the in-flight sets; recomputing: kept inputs "
             "plus one set, or under zb-h2 a set per minibatch it holds, an upper bound). "
             "Measured: each rank's peak of live tensor bytes over 16 "
             "minibatches (`Trainer(measure_memory=True)`), and its parts by what made each "
             "tensor: held when training began (the weights), forwards (F), backwards (B, W), "
             "updates (U: AdamW's moments, weight versions and the step's temporaries), "
             "receives posted ahead (comm). MiB.", ""]
    failed = [r for r in runs if "error" in r]
    if rows:
        ratio = [r["measured"] / r["predicted"] for r in rows]
        worst = max(range(len(rows)), key=lambda i: ratio[i])
        best = min(range(len(rows)), key=lambda i: ratio[i])

        def name(i: int) -> str:
            r = rows[i]
            return f"{r['model']} {r['kind']} recompute {r['recompute']} stage {r['stage']}"

        # the gradient sums (P) are made by the backwards: state's, not the working set's
        state = [(r["held"] + r["U"] + r["P"]) / (r["state"] + r["versions"]) for r in rows
                 if r["state"] + r["versions"] > 0]  # a stage with no weights: no ratio
        acts = [r["F"] / r["activations"] for r in rows if r["recompute"] == "never"]
        working = [max(r["BW"] - r["P"], 0) / r["predicted"] for r in rows]
        comm = [r["comm"] / r["predicted"] for r in rows]
        walked = [r["measured"] / r["walked"] for r in rows]
        wbest = min(range(len(rows)), key=lambda i: walked[i])
        wworst = max(range(len(rows)), key=lambda i: walked[i])
        lines += [
            f"**The walked peak** (`fxpipe.runtime.pricing.memory_walk`: the schedule's action "
            "list walked with the receive buffers posted ahead, the sent tensors not yet proven "
            "received, the backward's working set, what a split backward leaves for W, the "
            "loss's output, the optimizer step's temporaries and a tie's sum's buffers; what "
            "`compiled.memory_check` "
            "reports): stages within 10%: "
            f"**{sum(0.9 <= x <= 1.1 for x in walked)} of {len(rows)}**; measured / walked "
            f"from {walked[wbest]:.2f} ({name(wbest)}) to {walked[wworst]:.2f} "
            f"({name(wworst)}), median {sorted(walked)[len(walked) // 2]:.2f}. Outside 10%: "
            + (", ".join(f"{name(i)} ({walked[i]:.2f})" for i in range(len(rows))
                         if not 0.9 <= walked[i] <= 1.1) or "none") + ".", "",
            "**The plan's rule** (what the planner fits to the memory cap; below, by term): "
            f"stages within 10% of their prediction: {sum(0.9 <= x <= 1.1 for x in ratio)} of "
            f"{len(rows)}; measured / predicted from {ratio[best]:.2f} ({name(best)}) to "
            f"{ratio[worst]:.2f} ({name(worst)}), median {sorted(ratio)[len(ratio) // 2]:.2f}. "
            "Which term misses (min / median / max over the stages):", "",
            f"- weights, gradient sums, optimizer state and versions ((held + U + P) over state "
            f"+ versions, P the stage's parameter bytes with its copies of tied ones: the "
            f"gradient sums, made by the "
            f"backwards): {_span(state)}; above 1 where AdamW's step makes temporaries and "
            "a new weight version beside the old ones;",
            f"- activations without recomputation (F over predicted activations): "
            f"{_span(acts)}: what the forwards keep, priced per minibatch in flight;",
            f"- the backward's working set, not priced ((B + W - P) over predicted): "
            f"{_span(working)}: a minibatch's new weight gradients beside the sums, the "
            "activations' gradients, and where recomputing the recomputed set;",
            f"- receive buffers posted ahead, not priced (comm over predicted): {_span(comm)}: "
            "the runtime posts receives ahead of the compute that needs them (issue 27), each a "
            "buffer of the message's size.", ""]
    lines += ["| model | schedule | recompute | stage | predicted | state | versions | "
              "activations | measured | measured / predicted | walked | measured / walked | "
              "held | F | B+W | U | comm |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['kind']} | {r['recompute']} | {r['stage']} | "
            f"{_mib(r['predicted'])} | {_mib(r['state'])} | {_mib(r['versions'])} | "
            f"{_mib(r['activations'])} | {_mib(r['measured'])} | "
            f"{r['measured'] / r['predicted']:.2f} | {_mib(r['walked'])} | "
            f"{r['measured'] / r['walked']:.2f} | {_mib(r['held'])} | {_mib(r['F'])} | "
            f"{_mib(r['BW'])} | {_mib(r['U'])} | {_mib(r['comm'])} |")
    for run in failed:
        lines.append(f"\nFailed: {run['model']} {run['kind']} recompute {run['recompute']}: "
                     f"{run['error'].strip().splitlines()[-1][:200]}")
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
