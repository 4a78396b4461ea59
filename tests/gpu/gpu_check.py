"""GPU check: the distributed runtime on NCCL against the single-process reference, plus throughput.

The checks behind the ``gpu``-marked tests of ``test_gpu_check.py`` (2-4 GPUs; skipped where
``torch.cuda.is_available()`` is false), and the same checks as one command, from the repository
root:

    .venv/bin/python -m pytest -q tests/gpu                 # the tests: every case that fits the
    GPUs .venv/bin/python -m tests.gpu.gpu_check                 # every case, as one table
    .venv/bin/python -m tests.gpu.gpu_check --publish       # and record the table (benchmarks/)
    .venv/bin/python -m tests.gpu.gpu_check --dry           # the same cases on the CPU with gloo

For each case (schedule x pipeline shape, 2 to 4 ranks, one GPU each: rank i on cuda:i) it:

1. trains N minibatches with ``run_distributed(device="cuda")`` (NCCL) and with the
   ``ReferenceExecutor`` (one process, on the CPU) from the same weights on the same data, and
   compares every loss and every rank's final weights (TF32 off; tolerance ``--rtol``);
2. replays every rank's recorded communication under NCCL's rules
   (``fxpipe.runtime.schedules.ncclcheck.check_logs``): the messages of each rank pair meet in order;
3. times a longer run and prints steady-state samples/s (from the runtime's own timeline,
   compute spans timed with CUDA events);

and finally trains through the ``Trainer`` under torchrun (2 ranks, NCCL, the path
``fxpipe train`` takes) and compares its ``state_dict()`` with the reference executor's.
Exit status 0 only if every comparison holds. ``--dry`` runs the same code on gloo/CPU (what
the test machine without GPUs can check; ``test_gpu_check.py`` runs one case of it as a CPU
test); it proves the script, not the GPU path.
"""
from __future__ import annotations

import argparse
import copy
import functools
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from fxpipe.codegen.split import placed_nodes, split_graph
from fxpipe.runtime.execution.launch import run_distributed
from fxpipe.runtime.execution.reference import ReferenceExecutor
from fxpipe.runtime.schedules.ncclcheck import check_logs
from fxpipe.runtime.schedules.kinds import make_schedule
from fxpipe.runtime.timeline import busy_fraction

SECTION = "gpu_check"
ROOT = Path(__file__).resolve().parents[2]
sgd = functools.partial(torch.optim.SGD, lr=0.01, momentum=0.9)


class TiedMLP(nn.Module):
    """An embedding whose weight is also the output layer's (GPT's wte / lm_head)."""

    def __init__(self, vocab: int, width: int, depth: int) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.body = nn.Sequential(*[m for _ in range(depth) for m in (nn.Linear(width, width),
                                                                     nn.Tanh())])
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.wte(idx)))


@dataclass(frozen=True)
class Case:
    name: str
    kind: str
    replicas: tuple[int, ...]
    tied: bool = False
    microbatches: int | None = None

    @property
    def ranks(self) -> int:
        return sum(self.replicas)


CASES = [Case("2 stages", "pipedream", (1, 1)),
         Case("2 stages", "1f1b-flush", (1, 1), microbatches=4),
         Case("3 stages", "pipedream", (1, 1, 1)),
         Case("replicated input stage", "pipedream", (2, 1)),
         Case("replicated input stage", "1f1b-flush", (2, 1), microbatches=4),
         Case("4 stages", "pipedream", (1, 1, 1, 1)),
         Case("4 stages, tied embedding", "pipedream", (1, 1, 1, 1), tied=True),
         Case("4 stages, tied embedding", "1f1b-flush", (1, 1, 1, 1), tied=True,
              microbatches=4)]


def build(case: Case, width: int, seed: int = 0) -> tuple[nn.Module, list]:
    """The model and its stages (cut evenly by placed node)."""
    torch.manual_seed(seed)
    stages_n = len(case.replicas)
    if case.tied:
        model: nn.Module = TiedMLP(64, width, 2 * stages_n)
    else:
        layers: list[nn.Module] = []
        for _ in range(2 * stages_n):
            layers += [nn.Linear(width, width), nn.Tanh()]
        model = nn.Sequential(*layers, nn.Linear(width, 16))
    gm = fx.symbolic_trace(model)
    nodes = placed_nodes(gm)
    per = len(nodes) / stages_n
    return model, split_graph(gm, {n.name: min(stages_n - 1, int(i / per))
                                   for i, n in enumerate(nodes)})


def batches(case: Case, n: int, width: int, batch: int) -> list:
    g = torch.Generator().manual_seed(1)
    if case.tied:
        return [(torch.randint(0, 64, (batch,), generator=g),
                 torch.randint(0, 64, (batch,), generator=g)) for _ in range(n)]
    return [(torch.randn(batch, width, generator=g), torch.randn(batch, 16, generator=g))
            for _ in range(n)]


def loss_of(case: Case):
    return F.cross_entropy if case.tied else F.mse_loss


def check_case(case: Case, device: str, n: int, width: int, batch: int, rtol: float
               ) -> dict:
    """Distributed vs reference on n minibatches, the NCCL checker, then a timed run."""
    data = batches(case, n, width, batch)
    sched = make_schedule(case.kind, list(case.replicas), n, microbatches=case.microbatches)
    _, stages = build(case, width)
    ref = ReferenceExecutor(copy.deepcopy(stages), list(case.replicas), sched, loss_of(case),
                            sgd).run(data)
    got = run_distributed(copy.deepcopy(stages), list(case.replicas), sched, loss_of(case), sgd,
                          data, device=device, timeout_s=120, join_timeout_s=900,
                          record_comm=True)
    worst = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(got.losses, ref.losses))
    for rank, params in ref.replica_params.items():
        for name, want in params.items():
            have = got.replica_params[rank][name]
            torch.testing.assert_close(have, want, rtol=rtol, atol=rtol,
                                       msg=f"{case} rank {rank} {name}")
    messages = check_logs(got.comm_logs)
    # throughput: a longer run
    long = 4 * n
    data = batches(case, long, width, batch)
    sched = make_schedule(case.kind, list(case.replicas), long, microbatches=case.microbatches)
    t0 = time.perf_counter()
    timed = run_distributed(copy.deepcopy(stages), list(case.replicas), sched, loss_of(case),
                            sgd, data, device=device, timeout_s=120, join_timeout_s=1800)
    wall = time.perf_counter() - t0
    ends = sorted(e.end for e in timed.timeline[0] if e.category == "backward")
    steady = ends[len(ends) // 4:]
    rate = ((len(steady) - 1) * batch * case.replicas[0] / (steady[-1] - steady[0])
            if len(steady) > 1 and steady[-1] > steady[0] else float("nan"))
    busy = busy_fraction(timed.timeline)
    return {"case": case, "worst_loss_rel": worst, "messages": messages, "samples_per_s": rate,
            "busy": min(busy.values()), "wall_s": wall}


def trainer_job(device: str, out: str, reference: bool) -> None:
    """One rank of the torchrun Trainer check (or the reference executor, in one process)."""
    from fxpipe.runtime.training.trainer import Trainer

    case = Case("trainer", "pipedream", (1, 1))
    _, stages = build(case, 64)
    data = batches(case, 40, 64, 16)
    trainer = Trainer(stages, [1, 1], F.mse_loss, sgd, executor="reference" if reference
                      else "distributed", device=None if reference else device,
                      progress=False, timeout_s=120)
    history = trainer.fit(data, epochs=2, eval_loader=data[:8])
    state = trainer.state_dict()
    if reference or int(os.environ.get("RANK", "0")) == 0:
        torch.save({"state": {k: v.cpu() for k, v in state.items()}, "history": history}, out)
    trainer.close()


def check_trainer(device: str, rtol: float) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        dist = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
             "--master-addr=127.0.0.1", f"--master-port={port}", __file__, "--trainer-rank",
             "--trainer-device", device, "--trainer-out", f"{tmp}/dist.pt"],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
        if dist.returncode != 0:
            raise SystemExit(f"Trainer under torchrun failed:\n{dist.stdout[-4000:]}"
                             f"{dist.stderr[-4000:]}")
        trainer_job(device, f"{tmp}/ref.pt", reference=True)
        got = torch.load(f"{tmp}/dist.pt", weights_only=True)
        want = torch.load(f"{tmp}/ref.pt", weights_only=True)
    for name, t in want["state"].items():
        torch.testing.assert_close(got["state"][name], t, rtol=rtol, atol=rtol, msg=name)
    return {"loss": [h["loss"] for h in got["history"]],
            "eval": got["history"][-1]["eval_loss"]}


def settings(dry: bool, minibatches: int | None = None, width: int | None = None,
             batch: int | None = None, rtol: float | None = None) -> tuple[int, int, int, float]:
    """(minibatches, width, batch, rtol): the GPU run's defaults, or the smaller CPU ones."""
    return (minibatches or (16 if dry else 64), width or (32 if dry else 1024),
            batch or (8 if dry else 64), rtol or (1e-5 if dry else 1e-4))


def gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def exact_math() -> None:
    """TF32 off: the comparisons with the CPU reference are to rounding, not to TF32's 10 bits."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def markdown(rows: list[dict], trainer: dict, dry: bool, n: int, width: int, batch: int,
             rtol: float, seconds: float) -> str:
    where = (f"{gpus()} x {torch.cuda.get_device_name(0)}, NCCL {torch.cuda.nccl.version()}"
             if not dry else f"CPU only ({os.cpu_count()} cores), gloo: --dry")
    lines = ["## GPU check: NCCL against the reference executor", "",
             f"Command: `.venv/bin/python -m tests.gpu.gpu_check{' --dry' if dry else ''}` "
             f"({where}; torch {torch.__version__}, Python {platform.python_version()}; "
             f"{seconds:.0f} s in all)", "",
             f"Every case: {n} minibatches of {batch} (width {width}) trained by "
             "`run_distributed` and by the reference executor from the same weights; every "
             f"loss and weight equal within rtol {rtol:g}; every rank's recorded communication "
             "passes `check_logs` (NCCL's pairing rules); throughput from a 4x longer run "
             "(steady state, input stage).", "",
             "| schedule | replicas | case | messages checked | worst loss rel. diff | "
             "samples/s | min busy fraction |", "|---|---|---|---:|---:|---:|---:|"]
    for r in rows:
        c = r["case"]
        lines.append(f"| {c.kind} | {list(c.replicas)} | {c.name} | {r['messages']} | "
                     f"{r['worst_loss_rel']:.1e} | {r['samples_per_s']:.0f} | "
                     f"{r['busy']:.2f} |")
    lines += ["", "Trainer under torchrun (2 ranks, 2 epochs of 40 minibatches): "
              f"state_dict() equals the reference executor's; losses {json.dumps(trainer)}."]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry", action="store_true", help="run on the CPU with gloo")
    ap.add_argument("--minibatches", type=int, default=None, help="per correctness run")
    ap.add_argument("--width", type=int, default=None)
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--rtol", type=float, default=None)
    ap.add_argument("--publish", action="store_true", help="write the table to benchmarks/")
    ap.add_argument("--trainer-rank", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--trainer-device", default="cuda", help=argparse.SUPPRESS)
    ap.add_argument("--trainer-out", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.trainer_rank:
        trainer_job(args.trainer_device, args.trainer_out, reference=False)
        return
    device = "cpu" if args.dry else "cuda"
    if not args.dry and gpus() < 2:
        raise SystemExit(f"{gpus()} GPU(s) here: the check needs 2 to 4 (or use --dry)")
    exact_math()
    n, width, batch, rtol = settings(args.dry, args.minibatches, args.width, args.batch,
                                     args.rtol)
    cases = [c for c in CASES if args.dry or c.ranks <= gpus()]
    started = time.perf_counter()
    rows = []
    for case in cases:
        res = check_case(case, device, n, width, batch, rtol)
        rows.append(res)
        print(f"ok: {case.kind} {list(case.replicas)} {case.name}: {res['messages']} messages, "
              f"{res['samples_per_s']:.0f} samples/s", flush=True)
    trainer = check_trainer(device, rtol)
    print(f"ok: Trainer under torchrun equals the reference executor ({trainer})", flush=True)
    text = markdown(rows, trainer, args.dry, n, width, batch, rtol,
                    time.perf_counter() - started)
    if args.publish and not args.dry:
        from bench._report import publish  # run with -m from the repository root

        publish(SECTION, text)
    else:
        print(text)


if __name__ == "__main__":
    main()
