"""Pipelines on a slow network: fxpipe against its own compute bound, torch and one process.

Run from the repository root, as root (network namespaces):
    .venv/bin/python -m bench.pipeline_cluster            # 20, 50, 200 Mbit/s, 3 launches each
    .venv/bin/python -m bench.pipeline_cluster --smoke    # one rate, one launch: plumbing
Writes its page benchmarks/pipeline-cluster.md (``--out FILE`` writes the markdown there).

PipeDream's claim is that a pipeline hides communication behind computation, so a slow link costs
nothing while it is not the bottleneck (issue 27). Two emulated hosts (``tools.cluster``: network
namespaces, veth links shaped to R Mbit/s each way, one core per host), gloo, torchrun across the
hosts as a user launches on two machines. Two models:

* ``vgg``: VGG16 at a quarter of its channels on 32x32 images (fxpipe's zoo, 1.25M parameters),
  batch 32;
* ``gpt``: an 8-layer GPT (fxpipe's zoo: d = 512, 8 heads, 32 tokens, vocabulary 256; 25M
  parameters), batch 4 sequences: a transformer's cut carries d floats per token each way, so
  the model is sized for compute to outweigh its cut at these rates.

For each rate and model, the planner's 2-stage plan for that rate (``stages=2, straight=True``,
costs measured on one core) trains, each configuration from the same weights on the same
minibatches (W warm-up updates, then T timed ones):

* fxpipe ``pipedream`` (asynchronous 1F1B; the Trainer with its default segments and its
  default window: the fewest minibatches in flight that hide the plan's round trips,
  :func:`fxpipe.runtime.pricing.plansim.noam_for` on the plan's measured costs) and, where that
  window is wider, with PipeDream's NOAM (``noam="pipedream"``);
* fxpipe ``1f1b-flush`` with m = 2 microbatches of half the batch per update;
* torch.distributed.pipelining ``Schedule1F1B`` with m = 2 and 4 on the same stage modules;
* fxpipe's own choice at that rate (``fxpipe.compile`` with ``Cluster(workers=2,
  bandwidth=R)``: the planner's optimum, or the simulation's where that optimum splits tied
  weights across stages or simulates more than 5% slower than planned with the Trainer's
  window), when it uses both hosts, with pipedream and its default window;
* one process on one core, no network (a plain PyTorch loop).

Reported per configuration: samples/s over the T timed updates (fxpipe: from the last stage's
update times; torch: its steps), the median of 3 launches with the range; for fxpipe pipedream
also its compute bound (the batch over the busiest rank's forward + backward + optimizer seconds
per update, from its own timeline) and where the ranks' receive waits went
(:func:`fxpipe.runtime.timeline.wait_breakdown`: the peer still computing, the transfer itself,
or a transfer that started late because its receive was posted late); for fxpipe 1f1b-flush the
schedule's own compute bound (:func:`schedule_bound`: its 1F1B order simulated with the launch's
own compute per stage, transfers free, so a flush's bubble counts), which torch's Schedule1F1B
runs in the same order.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SECTION = "pipeline-cluster"
WARMUP, TIMED = 8, 40
RATES = (20, 50, 200)
MODELS = {  # name -> what it trains on
    "vgg": "VGG16 (channels / 4) on 32x32 images, batch 32",
    "gpt": "GPT, 8 layers, d 512, 8 heads, 32 tokens, vocabulary 256, batch 4 sequences",
}
BATCHES = {"vgg": 32, "gpt": 4}  # samples per update


# ----------------------------------------------------------------------------- models
def build(name: str) -> tuple[Any, Any, Any]:
    """(model, make_batch(batch, seed) -> (x, y), loss_fn), seeded."""
    import torch
    import torch.nn.functional as F

    torch.manual_seed(0)
    if name == "vgg":
        from fxpipe.models.cnn import VGG16

        model = VGG16(num_classes=10, width_div=4, image_size=32, hidden=512)

        def make(b: int, seed: int) -> tuple[Any, Any]:
            g = torch.Generator().manual_seed(seed)
            return torch.randn(b, 3, 32, 32, generator=g), torch.randint(0, 10, (b,), generator=g)
        return model, make, F.cross_entropy
    from fxpipe.models.gpt import GPT

    model = GPT(vocab_size=256, block_size=32, n_layer=8, n_head=8, n_embd=512)

    def make_tokens(b: int, seed: int) -> tuple[Any, Any]:
        g = torch.Generator().manual_seed(seed)
        t = torch.randint(0, 256, (b, 33), generator=g)
        return t[:, :-1], t[:, 1:]

    def lm_loss(out: Any, y: Any) -> Any:
        return F.cross_entropy(out.reshape(-1, out.size(-1)), y.reshape(-1))
    return model, make_tokens, lm_loss


def batches(name: str, size: int, count: int) -> list[tuple[Any, Any]]:
    """``count`` batches (BATCHES[name] samples) as minibatches of ``size``; the same on every
    rank and in every mode (a batch cut in two is the same samples)."""
    _, make, _ = build(name)
    out = []
    for i in range(count):
        x, y = make(BATCHES[name], 1000 + i)
        for j in range(0, BATCHES[name], size):
            out.append((x[j:j + size], y[j:j + size]))
    return out


def optimizer(params: Any) -> Any:
    import torch
    return torch.optim.SGD(params, lr=0.01, momentum=0.9)


# ----------------------------------------------------------------------------- workers
def plan_worker(args: argparse.Namespace) -> None:
    """On one core: the plans every launch loads (the 2-stage plan and the planner's choice)."""
    from dataclasses import replace

    import torch

    import fxpipe
    from fxpipe.api import choose_plan
    from fxpipe.runtime.pricing.plansim import trainer_window
    from fxpipe.runtime.schedules.staleness import plan_staleness

    torch.set_num_threads(1)
    out = {}
    for rate in args.rates:
        model, make, loss = build(args.model)
        x, _ = make(BATCHES[args.model], 0)
        cluster = fxpipe.Cluster(workers=2, bandwidth=f"{rate}Mbps")
        two = fxpipe.compile(model, cluster, example_inputs=(x,), loss_fn=loss, stages=2,
                             straight=True, repeats=10)
        # fxpipe.compile's own choice for pipedream on the same measured costs (the planner's
        # optimum, or the simulation's where that splits tied weights across stages)
        free = replace(choose_plan(two.profile, cluster), model_fingerprint=two.plan.
                       model_fingerprint)
        free = replace(free, staleness=plan_staleness(free.replicas))
        for kind, plan in (("two", two.plan), ("pick", free)):
            path = Path(args.dir) / f"plan-{args.model}-{rate}-{kind}.json"
            plan.save(path)
            out[f"{rate}-{kind}"] = {"replicas": list(plan.replicas), "path": str(path),
                                     "predicted_s": plan.time_per_minibatch,
                                     "noam": trainer_window(plan, two.profile, "pipedream")
                                     or plan.noam}
    Path(args.result).write_text(json.dumps(out))


def plain_loop_rate(model: str, count: int, start: int) -> float:
    """Samples/s of a plain PyTorch loop on one core over ``count`` batches of ``model``, timed
    from batch ``start``: the reference a pipeline has to beat. With the malloc tuning fxpipe's
    ranks use (freed buffers stay in the process): without it this loop pays page faults on
    every step's fresh gradients, and the comparison would be about that."""
    import torch

    from fxpipe.host_memory import keep_freed_memory

    keep_freed_memory()
    torch.set_num_threads(1)
    net, _, loss_fn = build(model)
    opt = optimizer(net.parameters())
    data = batches(model, BATCHES[model], count)
    t0 = 0.0
    for i, (x, y) in enumerate(data):
        if i == start:
            t0 = time.perf_counter()
        opt.zero_grad()
        loss_fn(net(x), y).backward()
        opt.step()
    return BATCHES[model] * (count - start) / (time.perf_counter() - t0)


def one_worker(args: argparse.Namespace) -> None:
    """The plain loop over the warm-up and timed batches (:func:`plain_loop_rate`)."""
    Path(args.result).write_text(json.dumps({
        "samples_per_s": plain_loop_rate(args.model, WARMUP + TIMED, WARMUP)}))


def fxpipe_worker(args: argparse.Namespace) -> None:
    """One rank of an fxpipe run (the Trainer, timeline on); writes its events."""
    import torch

    import fxpipe
    from fxpipe.passes import Plan

    torch.set_num_threads(1)
    model, make, loss = build(args.model)
    m = args.microbatches
    size = BATCHES[args.model] // (m or 1)
    x, _ = make(size, 0)
    compiled = fxpipe.compile(model, fxpipe.Cluster(workers=2, device="CPU"),
                              example_inputs=(x,), loss_fn=loss, plan=Plan.load(args.plan))
    trainer = compiled.trainer(optimizer=optimizer, schedule=args.schedule, microbatches=m,
                               timeout_s=300, progress=False, timeline=True, noam=args.noam)
    trainer.fit(batches(args.model, size, WARMUP + TIMED), epochs=1)
    t0 = trainer.timeline_origin
    events = [(e.category, e.name, e.start + t0, e.end + t0, dict(e.args))
              for tl, _ in trainer.timelines for e in tl]
    rank = int(os.environ["RANK"])
    Path(f"{args.result}.rank{rank}").write_text(json.dumps({
        "rank": rank, "stage": trainer.backend.me[0], "events": events,
        "replicas": list(compiled.plan.replicas)}, default=str))
    trainer.close()


def torch_worker(args: argparse.Namespace) -> None:
    """One rank of torch.distributed.pipelining on the same 2-stage split (fxpipe's hand-over,
    :mod:`fxpipe.runtime.execution.torch_pipelining`: values consumed further down ride along,
    tied weights stay one parameter), Schedule1F1B with each m in turn from the same weights."""
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import Schedule1F1B

    import fxpipe
    from fxpipe.passes import Plan
    from fxpipe.runtime.execution.torch_pipelining import torch_stages

    torch.set_num_threads(1)
    model, make, loss_fn = build(args.model)
    x, _ = make(BATCHES[args.model], 0)
    compiled = fxpipe.compile(model, fxpipe.Cluster(workers=2, device="CPU"),
                              example_inputs=(x,), loss_fn=loss_fn, plan=Plan.load(args.plan))
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    out = {}
    data = batches(args.model, BATCHES[args.model], WARMUP + TIMED)
    for m in args.ms:
        pipe = torch_stages(compiled.stage_specs, rank, 2, timeout_s=300)  # fresh copies
        sched = Schedule1F1B(pipe.stages[0], n_microbatches=m, loss_fn=loss_fn)
        params = list(pipe.parameters())
        opt = optimizer(params) if params else None  # a stage may hold no weights
        dist.barrier()
        t0 = 0.0
        for i, (xb, yb) in enumerate(data):
            if i == WARMUP:
                dist.barrier()
                t0 = time.perf_counter()
            if opt is not None:
                opt.zero_grad()
            if pipe.first:
                sched.step(*pipe.inputs(xb), target=yb)
            else:
                sched.step(target=yb)
            pipe.sync_tied_grads()
            if opt is not None:
                opt.step()
        dist.barrier()
        out[str(m)] = BATCHES[args.model] * TIMED / (time.perf_counter() - t0)
    Path(f"{args.result}.rank{rank}").write_text(json.dumps(out))
    dist.destroy_process_group()


# ----------------------------------------------------------------------------- reading runs
def fxpipe_numbers(ranks: list[dict], batch: int) -> dict[str, Any]:
    """Samples/s over the timed updates (the last stage's update ends), the compute bound and
    the receive waits, per update, from every rank's events."""
    from fxpipe.runtime.timeline import TimelineEvent, wait_breakdown

    last = max(ranks, key=lambda r: r["stage"])
    ends = sorted(t1 for cat, name, t0, t1, a in last["events"]  # one step per update (a
                  if cat == "optimizer" and "update" in a      # flushing kind numbers them
                  and not name.endswith("gradients"))           # from 0 in every segment)
    lo, hi = ends[WARMUP - 1], ends[WARMUP + TIMED - 1]
    out: dict[str, Any] = {"samples_per_s": batch * TIMED / (hi - lo)}
    busy, waits = {}, {}
    timeline = {r["rank"]: [TimelineEvent(c, n, s, e, a) for c, n, s, e, a in r["events"]
                            if e > lo and s < hi] for r in ranks}
    for r in ranks:
        busy[r["rank"]] = sum(min(e, hi) - max(s, lo) for c, _, s, e, _ in r["events"]
                              if c in ("forward", "backward", "optimizer") and e > lo and s < hi)
    for rank, w in wait_breakdown(timeline).items():
        waits[rank] = {k: v / TIMED for k, v in w.items()}
    out["compute_bound"] = batch * TIMED / max(busy.values())
    out["busy_s"] = {k: v / TIMED for k, v in busy.items()}
    out["waits_s"] = waits
    out["stage_times"] = stage_times(ranks, lo, hi)
    return out


def stage_times(ranks: list[dict], lo: float, hi: float) -> list[tuple[float, float, float]]:
    """Per stage (one rank each), the median seconds of a forward, a backward (per minibatch
    the schedule runs: a microbatch under ``1f1b-flush``) and an update, over the events
    inside [lo, hi]; an update is its step alone, not the span that gathers a tied segment's
    gradients before it ("U3 gradients")."""
    times = []
    for r in sorted(ranks, key=lambda r: r["stage"]):
        inside = [(c, e - s) for c, n, s, e, _ in r["events"]
                  if s >= lo and e <= hi and not n.endswith("gradients")]
        times.append(tuple(statistics.median(d for c, d in inside if c == cat)
                           for cat in ("forward", "backward", "optimizer")))
    return times


def schedule_bound(times: list[tuple[float, float, float]], kind: str, microbatches: int,
                   batch: int) -> float:
    """Samples/s that ``kind`` with ``microbatches`` per update cannot beat on these stages'
    compute: its own schedule (fxpipe's, the same 1F1B order torch's Schedule1F1B runs)
    simulated with ``times`` (:func:`stage_times`) and transfers taken as free, so the bubble
    counted is the compute's alone. A flushing schedule's bubble is in it; the busiest rank's
    compute alone (``compute_bound``) leaves it out."""
    from fxpipe.runtime.schedules.kinds import make_schedule
    from fxpipe.runtime.schedules.simulate import simulate

    f, b, u = zip(*times)
    sched = make_schedule(kind, [1] * len(times), 8 * microbatches, microbatches=microbatches)
    period = simulate(sched, f, b, 0.0, u).steady_state_period  # seconds per microbatch
    return batch / microbatches / period


# ----------------------------------------------------------------------------- the driver
def _run(cmd: list[str], timeout: float = 900) -> None:
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    if proc.returncode:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")


def make_plans(model: str, rates: Any, tmp: Path) -> dict:
    """:func:`plan_worker` on one core, in a process of its own: the plans per rate."""
    res = tmp / f"plans-{model}.json"
    _run(["taskset", "-c", "1", sys.executable, "-m", "bench.pipeline_cluster",
          "--bench-worker", "--plans", "--model", model, "--dir", str(tmp),
          "--result", str(res), "--rates", *map(str, rates)])
    return json.loads(res.read_text())


def launch(cluster: Any, tmp: Path, worker: list[str], tag: str,
           module: str = "bench.pipeline_cluster", nproc_per_host: int = 1) -> list[dict]:
    """One torchrun job across the emulated hosts (``python -m module worker...`` on every
    rank, ``nproc_per_host`` ranks a host); the results the ranks wrote to
    ``<--result>.rank<i>``."""
    from tools.cluster import read_output, torchrun_across, wait_all

    result = tmp / tag
    procs = torchrun_across(cluster, ["-m", module, *worker, "--result",
                                      str(result)], nproc_per_host=nproc_per_host,
                            env={"PYTHONPATH": str(ROOT)}, log_dir=tmp / f"{tag}-logs")
    codes = wait_all(procs, timeout=900)
    if any(codes):
        raise SystemExit(f"{tag} failed: {codes}\n" + "\n".join(read_output(p)[-3000:]
                                                                 for p in procs))
    return [json.loads(p.read_text()) for p in sorted(tmp.glob(f"{tag}.rank*"))]


def measure(model: str, rate: int, plans: dict, launches: int, tmp: Path) -> dict[str, list]:
    """Every configuration at one rate, ``launches`` rounds, order rotating per round."""
    from tools.cluster import EmulatedCluster

    two, pick = plans[f"{rate}-two"], plans[f"{rate}-pick"]
    configs: dict[str, list[str]] = {
        "pipedream": ["--fxpipe", "--schedule", "pipedream", "--plan", two["path"]],
        "pipedream-pd": ["--fxpipe", "--schedule", "pipedream", "--plan", two["path"],
                         "--noam", "pipedream"],
        "flush-2": ["--fxpipe", "--schedule", "1f1b-flush", "--microbatches", "2",
                    "--plan", two["path"]],
        "torch": ["--torch", "--ms", "2", "4", "--plan", two["path"]]}
    if two["noam"] <= -(-sum(two["replicas"]) // two["replicas"][0]):  # PipeDream's already
        del configs["pipedream-pd"]
    if sum(pick["replicas"]) > 1 and pick["replicas"] != two["replicas"]:
        configs["pick"] = ["--fxpipe", "--schedule", "pipedream", "--plan", pick["path"]]
    got: dict[str, list] = {k: [] for k in configs}
    names = list(configs)
    with EmulatedCluster(hosts=2, bandwidth=f"{rate}Mbit", latency=0, cpus=[0, 1],
                         prefix="fxpov") as cluster:
        for i in range(launches):
            for name in names[i % len(names):] + names[:i % len(names)]:
                tag = f"{model}-{rate}-{name}-{i}"
                ranks = launch(cluster, tmp, ["--bench-worker", "--model", model,
                                              *configs[name]], tag)
                got[name].append(ranks[0] if name == "torch"
                                 else fxpipe_numbers(ranks, BATCHES[model]))
    return got


def _med(xs: list[float]) -> str:
    if not xs:
        return "-"
    f = "{:.0f}" if statistics.median(xs) >= 100 else "{:.1f}"
    return f"{f.format(statistics.median(xs))} [{f.format(min(xs))}-{f.format(max(xs))}]"


def _ratio(xs: list[float], ys: list[float]) -> str:
    rs = [x / y for x, y in zip(xs, ys)]
    return f"{statistics.median(rs):.2f} [{min(rs):.2f}-{max(rs):.2f}]" if rs else "-"


def page(runs: dict, args: argparse.Namespace, started: float) -> str:
    import torch

    lines = [f"## Pipelines on an emulated 2-host cluster ({', '.join(map(str, args.rates))} "
             "Mbit/s)", "",
             f"Command: `.venv/bin/python -m bench.pipeline_cluster` (from the repository root, "
             f"as root; torch {torch.__version__}, {os.cpu_count()} CPU cores, one per host, "
             f"gloo; {args.launches} launches per configuration, order rotating; "
             f"{time.perf_counter() - started:.0f} s in all; load average at the end "
             f"{', '.join(f'{v:.1f}' for v in os.getloadavg())})", "",
             __doc__.split("\n\n", 2)[2].split("Reported")[0].strip(), "",
             f"Samples/s over {TIMED} timed updates after {WARMUP} warm-up ones: median "
             "[min-max] over the launches; ratios are per launch.", ""]
    for model, per_rate in runs.items():
        lines += [f"### {model}: {MODELS[model]}", "",
                  "PipeDream against its own compute bound (the batch over the busiest rank's "
                  "compute per update), with the Trainer's default window (`noam`: the "
                  "fewest minibatches in flight that hide the plan's round trips, "
                  "`noam_for`) and with PipeDream's NOAM (the rates and splits where the "
                  "default is PipeDream's have no second run):", "",
                  "| Mbit/s | 2-stage plan (predicted ms/minibatch) | one process | noam | "
                  "pipedream | its compute bound | pipedream / bound | pipedream, PipeDream's "
                  "NOAM | / its bound |", "|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
        for rate, r in per_rate.items():
            two = r["plans"][f"{rate}-two"]
            pd = [x["samples_per_s"] for x in r["pipedream"]]
            bound = [x["compute_bound"] for x in r["pipedream"]]
            deep = r.get("pipedream-pd", [])
            dv = [x["samples_per_s"] for x in deep]
            db = [x["compute_bound"] for x in deep]
            lines.append(f"| {rate} | {two['replicas']} ({1e3 * two['predicted_s']:.1f}) | "
                         f"{_med(r['one'])} | {two['noam']} | {_med(pd)} | {_med(bound)} | "
                         f"{_ratio(pd, bound)} | {_med(dv)} | {_ratio(dv, db)} |")
        lines += ["", "PipeDream-Flush against torch.distributed.pipelining's Schedule1F1B, the "
                  "same split and samples per update (m microbatches of batch / m). The "
                  "schedule's compute bound: what 1F1B with m = 2 (the order both run) cannot "
                  "beat on this split, simulated with each fxpipe launch's own median forward, "
                  "backward and update per stage and transfers taken as free "
                  "(`schedule_bound`); torch's ratio to it assumes torch's stages compute as "
                  "fast as fxpipe's. No implementation of the schedule can be more than "
                  "bound / torch faster than torch:", "",
                  "| Mbit/s | fxpipe 1f1b-flush m=2 | torch 1F1B m=2 | torch 1F1B m=4 | "
                  "fxpipe / torch (m=2) | the schedule's compute bound | fxpipe / bound | "
                  "torch m=2 / bound | bound / torch m=2 |",
                  "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for rate, r in per_rate.items():
            fl = [x["samples_per_s"] for x in r["flush-2"]]
            t2 = [x["2"] for x in r["torch"]]
            t4 = [x["4"] for x in r["torch"]]
            fb = [schedule_bound(x["stage_times"], "1f1b-flush", 2, BATCHES[model])
                  for x in r["flush-2"]]
            lines.append(f"| {rate} | {_med(fl)} | {_med(t2)} | {_med(t4)} | {_ratio(fl, t2)} "
                         f"| {_med(fb)} | {_ratio(fl, fb)} | {_ratio(t2, fb)} | "
                         f"{_ratio(fb, t2)} |")
        lines += ["", "Do no harm: fxpipe's own choice for 2 workers at each rate "
                  "(pipedream, its default window; `fxpipe.api.choose_plan`: the planner's "
                  "optimum, simulated instead where it splits tied weights or simulates more "
                  "than 5% slower than planned) against one process:", "",
                  "| Mbit/s | fxpipe's pick (predicted ms/minibatch) | samples/s | / one "
                  "process |", "|---:|---|---:|---:|"]
        for rate, r in per_rate.items():
            pick = r["plans"][f"{rate}-pick"]
            runs_ = r.get("pick") or (r["pipedream"] if pick["replicas"] ==
                                      r["plans"][f"{rate}-two"]["replicas"] else [])
            got = [x["samples_per_s"] for x in runs_]
            lines.append(f"| {rate} | {pick['replicas']} ({1e3 * pick['predicted_s']:.1f}) | "
                         + (f"{_med(got)} | {_ratio(got, r['one'])} |" if got else
                            "one worker: the plain loop | 1.00 |"))
        lines += ["", "Where fxpipe pipedream's receive waits went (ms per update, median "
                  "over the launches; `late`: a transfer that could have been in flight but "
                  "started when its receive was posted):", "",
                  "| Mbit/s | run | rank | compute | waiting for the peer | transfer | late |",
                  "|---:|---|---:|---:|---:|---:|---:|"]
        for rate, r in per_rate.items():
            for name in ("pipedream", "pipedream-pd"):
                if not r.get(name):
                    continue
                for rank in sorted(r[name][0]["waits_s"], key=int):
                    w = [x["waits_s"][rank] for x in r[name]]
                    b = [x["busy_s"][rank] for x in r[name]]
                    ms = [1e3 * statistics.median(v) for v in
                          (b, [y["peer"] for y in w], [y["transfer"] for y in w],
                           [y["late"] for y in w])]
                    lines.append(f"| {rate} | {name} | {rank} | "
                                 + " | ".join(f"{v:.1f}" for v in ms) + " |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bench-worker", dest="worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--plans", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--fxpipe", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--torch", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--schedule", default="pipedream", help=argparse.SUPPRESS)
    ap.add_argument("--microbatches", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--noam", type=lambda t: t if t == "pipedream" else int(t), default=None,
                    help=argparse.SUPPRESS)
    ap.add_argument("--ms", type=int, nargs="+", default=[2, 4], help=argparse.SUPPRESS)
    ap.add_argument("--plan", default="", help=argparse.SUPPRESS)
    ap.add_argument("--dir", default="", help=argparse.SUPPRESS)
    ap.add_argument("--result", default="", help=argparse.SUPPRESS)
    ap.add_argument("--model", default="vgg", help=argparse.SUPPRESS)
    ap.add_argument("--models", nargs="+", default=list(MODELS), help="default: vgg gpt")
    ap.add_argument("--rates", type=int, nargs="+", default=list(RATES), help="Mbit/s")
    ap.add_argument("--launches", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="one rate (50), one launch")
    ap.add_argument("--json", default=None, help="also write the raw numbers here")
    ap.add_argument("--work", default=None, help="folder for plans and every launch's raw "
                    "results (default: a new temporary folder, kept)")
    ap.add_argument("--out", default=None, help="write the markdown here instead of "
                    "benchmarks/pipeline-cluster.md")
    args = ap.parse_args()
    if args.worker:
        if args.plans:
            plan_worker(args)
        elif args.one:
            one_worker(args)
        elif args.torch:
            torch_worker(args)
        else:
            fxpipe_worker(args)
        return
    if args.smoke:
        args.rates, args.launches = [50], 1
    started = time.perf_counter()
    runs: dict[str, dict] = {}
    tmp = Path(args.work or tempfile.mkdtemp(prefix="fxp-pipeline-cluster-"))
    tmp.mkdir(parents=True, exist_ok=True)  # every run's raw files stay there
    for model in args.models:
        plans = make_plans(model, args.rates, tmp)
        runs[model] = {}
        for rate in args.rates:
            r = runs[model][rate] = measure(model, rate, plans, args.launches, tmp)
            r["plans"] = plans
            r["one"] = []
            for i in range(args.launches):
                out = tmp / f"one-{model}-{rate}-{i}.json"
                _run(["taskset", "-c", "1", sys.executable, "-m", "bench.pipeline_cluster",
                      "--bench-worker", "--one", "--model", model, "--result", str(out)])
                r["one"].append(json.loads(out.read_text())["samples_per_s"])
            print(f"{model} {rate} Mbit/s done", file=sys.stderr, flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(runs, indent=1, default=str))
    from bench._report import publish
    publish(SECTION, page(runs, args, started), args.out)


if __name__ == "__main__":
    main()
