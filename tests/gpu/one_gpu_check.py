"""One-GPU check (issue 26): what a single lent GPU can tell about the plans, in one short run.

NCCL cannot put two ranks on one device, so nothing here runs a multi-rank pipeline; from the
repository root:

    .venv/bin/python -m tests.gpu.one_gpu_check --dry        # the same code on the CPU (~1 min)
    .venv/bin/python -m tests.gpu.one_gpu_check --publish    # on the GPU (a few minutes):
                                                             # benchmarks/one-gpu-check.md

Four sections, each reported (or its error) without stopping the others, so one short loan of a
device yields every table it can:

1. **Costs**: a GPT (the zoo's architecture, ``fxpipe.models.gpt``) compiled for 4 straight
   stages with costs measured on the GPU, and the same nodes' costs estimated for the device in
   fxpipe's table (FLOPs and bytes, ``costmodel/hardware.py``): forward + backward per stage of
   the measured plan, estimated / measured; and one whole float32 step (AdamW) of an eager
   loop against both profiles' nodes summed: whether the whole-step calibration (which on a
   GPU may scale nodes down to 0.1x, ``costmodel/calibrate.py``) lands on the real step.
2. **Reference on the device**: the reference executor (every stage in this process) with 2 and
   4 stages under ``1f1b-flush`` and ``pipedream`` on the GPU against the same on the CPU, from
   the same weights and data: worst relative loss difference and largest weight difference
   (TF32 off).
3. **One stage against eager**: ``compiled.trainer`` on one rank (torchrun, NCCL world of 1) for
   fp32, bf16 and fp16 with loss scaling, samples per second against a plain loop of the same
   model, optimizer and autocast (GradScaler for fp16) on the same device, alternating for
   ``ROUNDS`` rounds (median and range: both loops are host-bound at this size).
4. **Memory**: one-stage plans for ``1f1b-flush``, ``gpipe`` (every microbatch's activations
   held at once: where recomputation saves), ``pipedream``, ``2bw`` and ``zb-h2``, without
   and with recomputation, AdamW: the plan's rule and its walked peak
   (``fxpipe.runtime.pricing.memory_walk``, priced for the device's foreach optimizer path)
   against ``torch.cuda.max_memory_allocated`` over the run (``Trainer(measure_memory=True)``),
   and recomputation's saving measured against predicted.

``--dry`` runs it all on the CPU with the table's "CPU" estimates, gloo, and the live-tensor
counter instead of ``max_memory_allocated``: it proves the script, not the GPU.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
SECTION = "one-gpu-check"
KINDS = ("1f1b-flush", "gpipe", "pipedream", "2bw", "zb-h2")
FLUSHING = ("1f1b-flush", "gpipe", "zb-h2")
M = 4  # microbatches per update under the flushing kinds


def sizes(dry: bool) -> dict[str, int]:
    """The GPT and the run lengths: big enough for a GPU to be busy, or tiny on the CPU."""
    if dry:
        return dict(vocab=128, seq=32, layers=4, heads=4, width=32, batch=8, steps=6)
    return dict(vocab=8192, seq=256, layers=8, heads=8, width=512, batch=16, steps=40)


def gpt(z: dict[str, int], seed: int = 0) -> torch.nn.Module:
    from fxpipe.models.gpt import GPT

    torch.manual_seed(seed)
    return GPT(vocab_size=z["vocab"], block_size=z["seq"], n_layer=z["layers"],
               n_head=z["heads"], n_embd=z["width"])


def batches(z: dict[str, int], n: int) -> list[tuple[tuple[torch.Tensor], torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        t = torch.randint(0, z["vocab"], (z["batch"], z["seq"] + 1), generator=g)
        out.append(((t[:, :-1].contiguous(),), t[:, 1:].contiguous()))
    return out


def lm_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, out.size(-1)).float(), y.reshape(-1))


def adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)


def table_device(dry: bool) -> str:
    """The device in fxpipe's table closest to the one here (by name)."""
    if dry:
        return "CPU"
    name = torch.cuda.get_device_name(0).upper()
    return next((d for d in ("H200", "H100", "A100", "V100") if d in name), "H100")


def estimated(workers: int, dry: bool) -> Any:
    """A cluster of ``workers`` of the table's device (costs estimated, in milliseconds: where
    the costs do not matter, or are the ones being checked); the optimizer step's temporaries
    are then priced on torch's CUDA path (foreach) unless ``dry``."""
    import fxpipe

    return fxpipe.Cluster(workers=workers, device=table_device(dry))


def exact_math() -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def guarded(fn: Callable[[], Any]) -> Any:
    """A section's result, or its error as text (the other sections still run)."""
    try:
        return fn()
    except Exception:  # noqa: BLE001 - a one-shot device run reports, it does not stop
        return {"error": traceback.format_exc(limit=4)[-1500:]}


# ----------------------------------------------------------------------------- 1. costs
def costs(z: dict[str, int], device: str, dry: bool) -> dict:
    import fxpipe

    model = gpt(z).to(device)
    ex = batches(z, 1)[0][0]
    measured = fxpipe.compile(model, fxpipe.Cluster(workers=4), example_inputs=tuple(
        x.to(device) for x in ex), loss_fn=lm_loss, stages=4, straight=True, repeats=3,
        optimizer=adamw)
    guess = fxpipe.compile(gpt(z), estimated(4, dry), example_inputs=ex, loss_fn=lm_loss,
                           stages=4, straight=True, optimizer=adamw)
    est = {n.name: n for n in guess.profile.nodes}
    mes = {n.name: n for n in measured.profile.nodes}
    rows = []
    for sp in measured.plan.stages:
        m = sum(mes[n].forward_s + mes[n].backward_s for n in sp.nodes if n in mes)
        e = sum(est[n].forward_s + est[n].backward_s for n in sp.nodes if n in est)
        rows.append({"stage": sp.index, "nodes": len(sp.nodes), "measured_s": m,
                     "estimated_s": e})
    # the whole training step, three ways: a plain eager loop timed here (the truth), the
    # measured profile's nodes summed (calibrated to whole steps: on a GPU down to 0.1x, a
    # hypothesis this checks) and the estimate's
    eager = eager_loop(z, device, "fp32")
    data = batches(z, z["steps"] // 4)
    eager(data[:2])
    from bench.runtime_common import med  # run with -m from the repository root

    step_s = med([eager(data) / len(data) for _ in range(3)])
    total = {k: sum(n.forward_s + n.backward_s + n.update_s for n in c.profile.nodes)
             for k, c in (("measured", measured), ("estimated", guess))}
    return {"device": table_device(dry), "profile_device": measured.profile.device,
            "rows": rows, "calibration": measured.profile.meta.get("calibration"),
            "step": {"eager_s": step_s, "measured_s": total["measured"],
                     "estimated_s": total["estimated"]}}


# ----------------------------------------------------------------------------- 2. reference
def reference(z: dict[str, int], device: str, dry: bool) -> list[dict]:
    import fxpipe
    from fxpipe.runtime.execution.reference import ReferenceExecutor
    from fxpipe.runtime.schedules.kinds import make_schedule

    exact_math()
    data = batches(z, 8)
    rows = []
    for stages in (2, 4):
        compiled = fxpipe.compile(gpt(z), estimated(stages, dry), loss_fn=lm_loss,
                                  example_inputs=data[0][0], stages=stages, straight=True)
        for kind in ("1f1b-flush", "pipedream"):
            sched = make_schedule(kind, [1] * stages, len(data),
                                  microbatches=M if kind in FLUSHING else None)
            runs = {}
            for where, dev in (("host", None), ("device", device)):  # --dry: "cpu" by name
                specs = fxpipe.compile(gpt(z), estimated(stages, dry), loss_fn=lm_loss,
                                       example_inputs=data[0][0],
                                       plan=compiled.plan).stage_specs
                ex = ReferenceExecutor(specs, [1] * stages, sched, lm_loss, adamw, device=dev)
                res = ex.run(data)
                runs[where] = ([float(v) for v in res.losses],
                             {f"{s}.{k}": v.detach().cpu() for s, params in
                              enumerate(res.params) for k, v in params.items()})
            (l0, p0), (l1, p1) = runs["host"], runs["device"]
            loss_rel = max(abs(a - b) / max(abs(a), 1e-12) for a, b in zip(l0, l1))
            weight = max(float((p0[k] - p1[k]).abs().max()) for k in p0)
            rows.append({"stages": stages, "kind": kind, "loss_rel": loss_rel,
                         "weight_abs": weight})
    return rows


# ----------------------------------------------------------------------------- 3 and 4: a rank
def rank_job(args: argparse.Namespace) -> None:
    """One torchrun rank (world 1): the one-stage Trainer against eager, and the memory runs."""
    z, device = sizes(args.dry), args.device
    out = {"throughput": guarded(lambda: throughput(z, device, args.dry)),
           "memory": guarded(lambda: memory(z, device, args.dry))}
    Path(args.result).write_text(json.dumps(out))


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


ROUNDS = 3  # fxpipe and eager timed alternately: one 40-step sample swung by +-15% on the H200


def throughput(z: dict[str, int], device: str, dry: bool) -> list[dict]:
    """Samples/s of the one-stage Trainer and of an eager loop, ``ROUNDS`` times each,
    alternating (so a slow spell of the host hits both); the median and range of each."""
    import fxpipe

    data = batches(z, z["steps"])
    n = len(data) * z["batch"]
    rows = []
    for precision in ("fp32", "bf16", "fp16"):
        compiled = fxpipe.compile(gpt(z), estimated(1, dry), loss_fn=lm_loss,
                                  example_inputs=data[0][0], stages=1)
        trainer = compiled.trainer(optimizer=adamw, schedule="1f1b-flush", microbatches=1,
                                   precision=precision, device=device, progress=False,
                                   timeout_s=300)
        trainer.fit(data[:4], epochs=1)  # warm-up: kernels, allocator, optimizer state
        eager = eager_loop(z, device, precision)
        eager(data[:4])
        fx, ea = [], []
        for _ in range(ROUNDS):
            t0 = time.perf_counter()
            trainer.fit(data, epochs=1)
            fx.append(n / (time.perf_counter() - t0))
            ea.append(n / eager(data))
        trainer.close()
        rows.append({"precision": precision, "fxpipe": sorted(fx), "eager": sorted(ea)})
        del trainer, compiled, eager
        _free(device)
    return rows


def eager_loop(z: dict[str, int], device: str, precision: str
               ) -> Callable[[list], float]:
    """A plain loop on one model: the same GPT, AdamW, autocast for bf16/fp16 and GradScaler
    for fp16, on ``device``; calling it trains on the batches given and returns the seconds."""
    model = gpt(z).to(device)
    opt = adamw(model.parameters())
    kind = device.split(":")[0]
    scaler = torch.amp.GradScaler(kind, enabled=precision == "fp16")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        with torch.autocast(kind, dtype=dtype or torch.float32, enabled=dtype is not None):
            loss = lm_loss(model(x), y)
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()

    def run(data: list) -> float:
        _sync(device)
        t0 = time.perf_counter()
        for (x,), y in data:
            step(x.to(device), y.to(device))
        _sync(device)
        return time.perf_counter() - t0

    return run


def _free(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def memory(z: dict[str, int], device: str, dry: bool) -> list[dict]:
    import fxpipe

    data = batches(z, 2 * M)
    rows = []
    for kind in KINDS:
        for recompute in ("never", "always"):
            m = M if kind in FLUSHING else None
            # on the CPU (the run copies its own weights to the device), priced for the device
            compiled = fxpipe.compile(
                gpt(z), estimated(1, dry), loss_fn=lm_loss, example_inputs=data[0][0],
                stages=1, optimizer=adamw, schedule=kind, microbatches=m, recompute=recompute)
            _free(device)
            trainer = compiled.trainer(optimizer=adamw, schedule=kind, microbatches=m,
                                       device=device, measure_memory=True, progress=False,
                                       timeout_s=300)
            trainer.fit(data, epochs=1)
            (check,) = compiled.memory_check(trainer)
            rows.append({"kind": kind, "recompute": recompute, "rule": check.predicted,
                         "walked": check.walked, "measured": check.measured})
            trainer.close()
            del trainer, compiled
    return rows


def run_rank(dry: bool) -> dict:
    from fxpipe.runtime.execution.ports import free_port

    device = "cpu" if dry else "cuda"
    with tempfile.TemporaryDirectory() as tmp:
        result = str(Path(tmp) / "rank.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=1",
               "--master-addr=127.0.0.1", f"--master-port={free_port()}", "-m",
               "tests.gpu.one_gpu_check", "--rank-job", "--device", device, "--result", result]
        cmd += ["--dry"] if dry else []
        proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"},
                              capture_output=True, text=True, timeout=1500)
        if proc.returncode != 0 or not Path(result).exists():
            err = {"error": (proc.stdout[-1500:] + proc.stderr[-1500:])}
            return {"throughput": err, "memory": err}
        return json.loads(Path(result).read_text())


# ----------------------------------------------------------------------------- the page
def _error(section: Any) -> str | None:
    if isinstance(section, dict) and "error" in section:
        return "Failed:\n\n```\n" + section["error"].strip() + "\n```"
    return None


def _calibration(rec: dict | None) -> str:
    """The measured profile's whole-step calibration (costmodel/calibrate.py): what the nodes,
    each timed alone, summed to against whole steps, and the ratio applied (1: not applied)."""
    if not rec:
        return "The measured profile was not calibrated to whole steps."
    parts = "; ".join(
        f"{p} {1e3 * rec[f'node_{p}_s']:.3f} ms summed, {1e3 * rec[f'{p}_s']:.3f} ms whole, "
        f"x{rec[f'{p}_ratio']:.2f} applied" for p in ("forward", "backward", "update"))
    return f"Whole-step calibration of the measured profile: {parts}."


def _whole_step(rec: dict | None) -> str:
    """One float32 training step (forward, backward, AdamW) of the section's GPT: a plain eager
    loop against the profiles' nodes summed (forward + backward + update)."""
    if not rec:
        return ""
    e = rec["eager_s"]
    return (f"One whole float32 step with AdamW (the median of 3 timings of an eager loop): "
            f"{1e3 * e:.2f} ms; the measured profile's nodes sum to "
            f"{1e3 * rec['measured_s']:.2f} ms ({rec['measured_s'] / e:.2f}x), the estimate's "
            f"to {1e3 * rec['estimated_s']:.2f} ms ({rec['estimated_s'] / e:.2f}x).")


def markdown(res: dict, dry: bool, seconds: float) -> str:
    where = ("CPU only: --dry (it proves the script, not the GPU)" if dry else
             f"{torch.cuda.get_device_name(0)}, CUDA {torch.version.cuda}")
    mib = 1 << 20
    lines = ["## One-GPU check", "",
             f"Command: `.venv/bin/python -m tests.gpu.one_gpu_check{' --dry' if dry else ''}` "
             f"({where}; torch {torch.__version__}, Python {platform.python_version()}; "
             f"{seconds:.0f} s in all).", "", "### 1. Costs: measured against estimated", ""]
    c = res["costs"]
    lines.append(_error(c) or "\n".join(
        [f"Forward + backward per stage of the plan made from the measured costs; estimated "
         f"for `{c['device']}` from FLOPs and bytes (profile measured on: "
         f"{c['profile_device']}).", "",
         "| stage | nodes | measured | estimated | estimated / measured |", "|---|---|---|---|---|"]
        + [f"| {r['stage']} | {r['nodes']} | {1e3 * r['measured_s']:.3f} ms | "
           f"{1e3 * r['estimated_s']:.3f} ms | {r['estimated_s'] / r['measured_s']:.2f} |"
           for r in c["rows"]] + ["", _calibration(c.get("calibration")), "",
                                    _whole_step(c.get("step"))]))
    lines += ["", "### 2. The reference executor on the device against the CPU", ""]
    r2 = res["reference"]
    lines.append(_error(r2) or "\n".join(
        ["8 minibatches from the same weights and data, TF32 off.", "",
         "| stages | schedule | worst loss rel. diff | largest weight diff |", "|---|---|---|---|"]
        + [f"| {r['stages']} | {r['kind']} | {r['loss_rel']:.1e} | {r['weight_abs']:.1e} |"
           for r in r2]))
    lines += ["", "### 3. One stage against an eager loop", ""]
    r3 = res["rank"]["throughput"]
    from bench.runtime_common import med, spread  # run with -m from the repository root
    lines.append(_error(r3) or "\n".join(
        ["Samples per second, the same model, AdamW and autocast (fp16: GradScaler / fxpipe's "
         f"loss scaling), after 4 warm-up minibatches; {ROUNDS} rounds of {sizes(dry)['steps']} "
         "minibatches each, fxpipe and eager alternating: median [range].", "",
         "| precision | fxpipe | eager | fxpipe / eager (medians) |", "|---|---|---|---|"]
        + [f"| {r['precision']} | {spread(r['fxpipe'], '{:.1f}')} | "
           f"{spread(r['eager'], '{:.1f}')} | {med(r['fxpipe']) / med(r['eager']):.2f} |"
           for r in r3]))
    lines += ["", "### 4. Memory: predicted against measured", ""]
    r4 = res["rank"]["memory"]
    if _error(r4):
        lines.append(_error(r4) or "")
    else:
        counter = "live tensor bytes (CPU)" if dry else "torch.cuda.max_memory_allocated"
        lines += [f"One stage, AdamW, {2 * M} minibatches; measured: {counter}. MiB.", "",
                  "| schedule | recompute | rule | walked peak | measured | measured / rule | "
                  "measured / walked |", "|---|---|---|---|---|---|---|"]
        for r in r4:
            w = r["walked"] or float("nan")
            lines.append(f"| {r['kind']} | {r['recompute']} | {r['rule'] / mib:.2f} | "
                         f"{w / mib:.2f} | {r['measured'] / mib:.2f} | "
                         f"{r['measured'] / r['rule']:.2f} | {r['measured'] / w:.2f} |")
        by = {(r["kind"], r["recompute"]): r for r in r4}
        saving = []
        for k in KINDS:
            if (k, "always") in by and (k, "never") in by:
                rc, plain = by[(k, "always")], by[(k, "never")]
                saving.append(f"{k}: measured {rc['measured'] / plain['measured']:.2f}, walked "
                              f"{(rc['walked'] or 0) / (plain['walked'] or 1):.2f}")
        lines += ["", "Recomputation's peak over the plain run's: " + "; ".join(saving) + "."]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry", action="store_true", help="on the CPU (proves the script)")
    ap.add_argument("--publish", action="store_true", help="write benchmarks/one-gpu-check.md")
    ap.add_argument("--out", default=None, help="write the markdown to this file")
    ap.add_argument("--rank-job", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--device", default="cuda", help=argparse.SUPPRESS)
    ap.add_argument("--result", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank_job:
        rank_job(args)
        return
    if not args.dry and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --dry on the CPU")
    torch.set_num_threads(1 if args.dry else torch.get_num_threads())
    t0 = time.perf_counter()
    z, device = sizes(args.dry), "cpu" if args.dry else "cuda"
    res: dict[str, Any] = {}
    for name, section in (("costs", lambda: guarded(lambda: costs(z, device, args.dry))),
                          ("reference", lambda: guarded(lambda: reference(z, device, args.dry))),
                          ("rank", lambda: run_rank(args.dry))):
        res[name] = section()
        # each section's numbers as soon as they exist: a run cut short by its lease keeps them
        print(f"[{time.perf_counter() - t0:.0f} s] {name}: {json.dumps(res[name])}", flush=True)
    text = markdown(res, args.dry, time.perf_counter() - t0)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    if args.publish:
        from bench._report import publish

        publish(SECTION, text, None)
    failed = [k for k, v in (("costs", res["costs"]), ("reference", res["reference"]),
                             *res["rank"].items()) if isinstance(v, dict) and "error" in v]
    if failed:
        raise SystemExit(f"sections failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
