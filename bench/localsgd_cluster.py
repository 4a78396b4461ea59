"""LocalSGD against the pipeline schedules on a slow network, in the spirit of Randomized PipeDream.

Run from the repository root, as root (network namespaces):
    .venv/bin/python -m bench.localsgd_cluster            # 20, 50, 200 Mbit/s, seeds 0-2
    .venv/bin/python -m bench.localsgd_cluster --smoke    # one rate, one seed: plumbing
Writes its page benchmarks/localsgd-cluster.md (``--out FILE`` writes the markdown there).

The analysis's bargain: PipeDream's asynchronous pipeline reads stale weights (a delay that grows
as S squared in block updates), while LocalSGD over R copies of the pipeline reads none but
lets the copies drift apart between averages. Here every configuration trains the same model on
the same minibatches with the same four ranks: two emulated hosts (``tools.cluster``: network
namespaces, veth links shaped to R Mbit/s each way, one core per host), two ranks per host,
torchrun across the hosts, gloo. The model is a character-level next-byte predictor (embedding of
a 16-byte context, two hidden layers of 256, 128 outputs) on the Python standard library's own
source, cut into 2 stages after the first hidden layer (256 floats per sample cross the cut).

Configurations (every stage has 2 replicas: stage s's replicas on host s, so a replica group's
sum or average stays on its host and every activation and gradient crosses the link):

* ``localsgd H=2`` and ``localsgd H=8``: R = 2 copies of the 2-stage pipeline, each updating after
  every minibatch of its own, averaged every H updates (``Trainer(schedule="localsgd")``);
* ``pipedream``: asynchronous 1F1B with weight stashing, a stage's two replicas summing their
  gradients at each update (an update covers 2 minibatches);
* ``2bw`` (PipeDream-2BW) and ``1f1b-flush`` with 4 microbatches per update.

Each trains the same budget of minibatches (one pass over ``EPOCHS`` x ``EPOCH`` fresh
minibatches of ``BATCH`` samples; Adam, lr 3e-3), from the same initial weights, evaluating a
held-out set after every ``EPOCH`` minibatches. Reported per rate and configuration, over seeds
0-2 (the seed draws the initial weights and the data's order; median [min-max]): the seconds of
training to first reach the target held-out loss, the updates per stage replica by then, and the
final held-out loss.
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
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SECTION = "localsgd-cluster"
RATES = (20, 50, 200)
SEEDS = (0, 1, 2)
CONTEXT, VOCAB, HIDDEN, EMBED = 16, 128, 256, 32
BATCH, EPOCH, EPOCHS, EVAL = 64, 32, 12, 8
TARGET = 2.6
"""Held-out loss (nats per byte) every configuration is timed to (uniform over 128 bytes: 4.85)."""
CONFIGS: dict[str, dict[str, Any]] = {
    "localsgd H=2": {"schedule": "localsgd", "average_every": 2},
    "localsgd H=8": {"schedule": "localsgd", "average_every": 8},
    "pipedream": {"schedule": "pipedream"},
    "2bw": {"schedule": "2bw", "microbatches": 4},
    "1f1b-flush": {"schedule": "1f1b-flush", "microbatches": 4},
}


def corpus(limit: int = 4 << 20) -> bytes:
    """The standard library's Python source, files in sorted order, up to ``limit`` bytes."""
    root = Path(os.__file__).parent
    out, n = [], 0
    for p in sorted(root.glob("*.py")):
        data = p.read_bytes()
        out.append(data)
        n += len(data)
        if n >= limit:
            break
    return b"".join(out)[:limit]


def minibatches(seed: int) -> tuple[list[tuple[Any, Any]], list[tuple[Any, Any]]]:
    """The training minibatches (``EPOCH`` x ``EPOCHS`` contexts drawn by ``seed`` from the
    first 90% of the corpus: each seen once, see :class:`Slices`) and the held-out ones (fixed,
    from the last 10%)."""
    import torch

    text = torch.frombuffer(bytearray(corpus()), dtype=torch.uint8).long().clamp(max=VOCAB - 1)
    cut = int(len(text) * 0.9)

    def draw(lo: int, hi: int, n: int, g: torch.Generator) -> list[tuple[Any, Any]]:
        starts = torch.randint(lo, hi - CONTEXT - 1, (n, BATCH), generator=g)
        idx = starts[..., None] + torch.arange(CONTEXT + 1)
        seq = text[idx]
        return [(s[:, :CONTEXT], s[:, CONTEXT]) for s in seq]

    train = draw(0, cut, EPOCH * EPOCHS, torch.Generator().manual_seed(1000 + seed))
    held = draw(cut, len(text), EVAL, torch.Generator().manual_seed(7))
    return train, held


class Slices:
    """A loader serving epoch e the minibatches ``[e * n, (e + 1) * n)`` of ``data``: one pass
    over fresh data, cut into "epochs" so that the held-out loss is evaluated every ``n``."""

    def __init__(self, data: list[Any], n: int) -> None:
        self.data, self.n, self.epoch = data, n, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Any:
        return iter(self.data[self.epoch * self.n:(self.epoch + 1) * self.n])

    def __len__(self) -> int:
        return self.n


def model(seed: int) -> Any:
    import torch
    import torch.nn as nn

    torch.manual_seed(seed)
    return nn.Sequential(nn.Embedding(VOCAB, EMBED), nn.Flatten(),
                         nn.Linear(CONTEXT * EMBED, HIDDEN), nn.ReLU(),
                         nn.Linear(HIDDEN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, VOCAB))


def stages(seed: int) -> list[Any]:
    """Two stages, cut after the first hidden layer's ReLU."""
    import torch.fx as fx

    from fxpipe.codegen.split import placed_nodes, split_graph

    gm = fx.symbolic_trace(model(seed))
    nodes = placed_nodes(gm)
    cut = 4  # the input, embedding, flatten, first linear layer and its ReLU: stage 0
    return split_graph(gm, {n.name: int(i > cut) for i, n in enumerate(nodes)})


def adam(params: Any) -> Any:
    import torch

    return torch.optim.Adam(params, lr=3e-3)


def worker(args: argparse.Namespace) -> None:
    """One rank of one configuration's run; rank 0 writes the history."""
    import torch
    import torch.nn.functional as F

    from fxpipe.runtime.training.trainer import Trainer

    torch.set_num_threads(1)
    cfg = CONFIGS[args.config]
    train, held = minibatches(args.seed)
    executor = "reference" if args.reference else "distributed"
    trainer = Trainer(stages(args.seed), [2, 2], F.cross_entropy, adam, executor=executor,
                      timeout_s=300, progress=False, seed=args.seed, **cfg)
    history = trainer.fit(Slices(train, EPOCH), epochs=EPOCHS, eval_loader=held)
    if int(os.environ.get("RANK", "0")) == 0:
        Path(f"{args.result}.rank0").write_text(json.dumps(
            {"config": args.config, "seed": args.seed, "history": history}))
    trainer.close()


UPDATES_PER_EPOCH = {"localsgd H=2": EPOCH // 2, "localsgd H=8": EPOCH // 2,
                     "pipedream": EPOCH // 2, "2bw": EPOCH // 4, "1f1b-flush": EPOCH // 4}
"""Updates each stage replica makes per epoch: a LocalSGD copy one per minibatch of its own
(half of them); pipedream one per 2 minibatches (its two replicas' sum); 4 microbatches per
update for 2bw and 1f1b-flush."""


def reached(run: dict[str, Any]) -> tuple[float | None, int | None]:
    """Seconds of training and updates per replica to the first epoch whose held-out loss is at
    most ``TARGET`` (None, None: never)."""
    t = 0.0
    for e, h in enumerate(run["history"]):
        t += h["time_s"]
        if h["eval_loss"] <= TARGET:
            return t, (e + 1) * UPDATES_PER_EPOCH[run["config"]]
    return None, None


def launch(cluster: Any, tmp: Path, config: str, seed: int) -> dict[str, Any]:
    """One configuration and seed across the emulated hosts (2 ranks per host): rank 0's
    history (:func:`bench.pipeline_cluster.launch`)."""
    from bench.pipeline_cluster import launch as launch_ranks

    tag = f"{config.replace(' ', '').replace('=', '')}-s{seed}-{time.monotonic_ns()}"
    return launch_ranks(cluster, tmp, ["--bench-worker", "--config", config, "--seed",
                                       str(seed)], tag, "bench.localsgd_cluster",
                        nproc_per_host=2)[0]


def measure(rate: int, seeds: list[int], tmp: Path) -> dict[str, list[dict[str, Any]]]:
    """Every configuration and seed at one rate; the configurations' order rotates per seed."""
    from tools.cluster import EmulatedCluster

    names = list(CONFIGS)
    got: dict[str, list[dict[str, Any]]] = {k: [] for k in names}
    with EmulatedCluster(hosts=2, bandwidth=f"{rate}Mbit", latency=0, cpus=[0, 1],
                         prefix="fxlsg") as cluster:
        for i, seed in enumerate(seeds):
            for name in names[i % len(names):] + names[:i % len(names)]:
                got[name].append(launch(cluster, tmp, name, seed))
    return got


def _med(xs: list[float], fmt: str = "{:.1f}") -> str:
    if not xs:
        return "-"
    return (fmt.format(statistics.median(xs)) + " [" + fmt.format(min(xs)) + "-"
            + fmt.format(max(xs)) + "]")


def page(runs: dict[int, dict[str, list[dict[str, Any]]]], args: argparse.Namespace,
         started: float) -> str:
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    cmd = ".venv/bin/python -m bench.localsgd_cluster" + (" --smoke" if args.smoke else "")
    lines = [f"# LocalSGD against the pipeline schedules on an emulated 2-host cluster "
             f"({', '.join(map(str, args.rates))} Mbit/s)", "",
             f"Command: `{cmd}` (from the repository root, as root; torch "
             f"{__import__('torch').__version__}, 2 CPU cores, one per host, 2 ranks per host, "
             f"gloo; seeds {', '.join(map(str, args.seeds))}; "
             f"{time.perf_counter() - started:.0f} s in all; load average at the end {load})", "",
             __doc__.split("\n\n", 2)[2].strip(), "",
             f"Target: held-out loss {TARGET} nats per byte. Budget: {EPOCHS * EPOCH} minibatches "
             f"of {BATCH} (held-out loss after every {EPOCH}). Median [min-max] over the seeds; "
             "\"reached\" counts the seeds that reached the target within the budget, and the "
             "time and updates to it are over those seeds only.", ""]
    for rate, got in runs.items():
        lines += [f"## {rate} Mbit/s", "",
                  "| configuration | reached | s to target | updates per replica to target "
                  "| final held-out loss | s for the whole budget |",
                  "|---|---:|---:|---:|---:|---:|"]
        for name, rs in got.items():
            hits = [reached(r) for r in rs]
            ok = [(t, u) for t, u in hits if t is not None]
            final = [r["history"][-1]["eval_loss"] for r in rs]
            total = [sum(h["time_s"] for h in r["history"]) for r in rs]
            lines.append(f"| {name} | {len(ok)}/{len(rs)} | {_med([t for t, _ in ok])} | "
                         f"{_med([float(u) for _, u in ok], '{:.0f}')} | "
                         f"{_med(final, '{:.3f}')} | {_med(total)} |")
        lines.append("")
    lines += ["Held-out loss after each block of minibatches, median over the seeds:", ""]
    for rate, got in runs.items():
        lines += [f"{rate} Mbit/s:", "", "| configuration | " + " | ".join(
            str((e + 1) * EPOCH) for e in range(EPOCHS)) + " |",
                  "|---|" + "---:|" * EPOCHS]
        for name, rs in got.items():
            lines.append(f"| {name} | " + " | ".join(
                f"{statistics.median(r['history'][e]['eval_loss'] for r in rs):.3f}"
                for e in range(EPOCHS)) + " |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bench-worker", dest="worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--reference", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--config", default="pipedream", help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--result", default="", help=argparse.SUPPRESS)
    ap.add_argument("--rates", type=int, nargs="+", default=list(RATES), help="Mbit/s")
    ap.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS))
    ap.add_argument("--smoke", action="store_true", help="one rate (50), one seed")
    ap.add_argument("--work", default=None, help="folder for every launch's raw results "
                    "(default: a new temporary folder, kept)")
    ap.add_argument("--out", default=None, help="write the markdown here instead of "
                    "benchmarks/localsgd-cluster.md")
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    if args.smoke:
        args.rates, args.seeds = [50], [0]
    started = time.perf_counter()
    tmp = Path(args.work or tempfile.mkdtemp(prefix="fxp-localsgd-cluster-"))
    tmp.mkdir(parents=True, exist_ok=True)
    runs = {rate: measure(rate, args.seeds, tmp) for rate in args.rates}
    (tmp / "runs.json").write_text(json.dumps({str(k): v for k, v in runs.items()}))
    sys.path.insert(0, str(ROOT))
    from bench._report import publish

    publish(SECTION, page(runs, args, started), args.out)


if __name__ == "__main__":
    main()
