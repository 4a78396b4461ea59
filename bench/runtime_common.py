"""Shared pieces of the runtime benchmarks (bench/runtime_*.py): models, data, timing, stats.

Every measurement here is steady state: a run's start-up (process spawn, rendezvous, the first
minibatches) is excluded by timing only the minibatches after a warm-up, using per-minibatch
completion times (fxpipe: the end of the input stage's update ``U<k>`` on the runtime's own
timeline; baselines: ``time.perf_counter()`` after each optimizer step).
"""
from __future__ import annotations

import functools
import os
import re
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from fxpipe.runtime.execution.launch import run_children

ROOT = Path(__file__).resolve().parents[1]
PY = ".venv/bin/python"


# ----------------------------------------------------------------------------- optimizer, loss
def sgd(params: list[torch.Tensor], lr: float = 0.01, momentum: float = 0.9) -> torch.optim.Optimizer:
    """The optimizer every configuration uses (module level: picklable for spawned ranks)."""
    return torch.optim.SGD(params, lr=lr, momentum=momentum)


def sgd_factory(lr: float, momentum: float = 0.9) -> Callable[[list[torch.Tensor]], Any]:
    return functools.partial(sgd, lr=lr, momentum=momentum)


def cross_entropy(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out, target)


# ----------------------------------------------------------------------------- models
def mlp(dim: int = 512, hidden: int = 1024, depth: int = 4, classes: int = 10, seed: int = 0
        ) -> nn.Sequential:
    """A mid-size MLP (parameter-heavy relative to its compute: stresses per-step overheads that
    scale with the number of weights)."""
    g = torch.random.fork_rng()
    with g:
        torch.manual_seed(seed)
        layers: list[nn.Module] = []
        d = dim
        for _ in range(depth):
            layers += [nn.Linear(d, hidden), nn.ReLU()]
            d = hidden
        layers.append(nn.Linear(d, classes))
        return nn.Sequential(*layers)


# ----------------------------------------------------------------------------- data
def teacher_pool(shape: tuple[int, ...], batch: int, batches: int, classes: int = 10,
                 seed: int = 1234) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A fixed, learnable classification task: random inputs labelled by a random linear teacher
    (argmax of a projection of the flattened input, classes roughly balanced)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch * batches, *shape, generator=g)
    w = torch.randn(x[0].numel(), classes, generator=g)
    y = (x.reshape(len(x), -1) @ w).argmax(-1)
    return [(x[i * batch:(i + 1) * batch].contiguous(), y[i * batch:(i + 1) * batch].contiguous())
            for i in range(batches)]


def cycle(pool: Sequence[Any], n: int) -> list[Any]:
    """``n`` minibatches cycling through ``pool`` (the same objects repeated: pickling a list of
    repeats sends each tensor once, so spawning ranks stays cheap)."""
    return [pool[k % len(pool)] for k in range(n)]


# ----------------------------------------------------------------------------- timing
def steady_rate(done_at: Sequence[float], batch: int, warmup: int) -> float:
    """Samples/s between the completion of minibatch ``warmup`` and of the last one."""
    n = len(done_at)
    if n - 1 <= warmup:
        raise ValueError(f"{n} minibatches leave no steady state after warm-up {warmup}")
    return batch * (n - 1 - warmup) / (done_at[-1] - done_at[warmup])


def fxpipe_updates(events: Sequence[Any]) -> dict[int, list[Any]]:
    """A rank's optimizer events grouped by update number (``args["update"]``, else the ``U<k>``
    in the name): the runtime may record several spans per update (e.g. "U3 gradients", "U3")."""
    out: dict[int, list[Any]] = {}
    for e in events:
        if e.category != "optimizer":
            continue
        k = e.args.get("update") if hasattr(e, "args") else None
        if k is None:
            m = re.match(r"U(\d+)", e.name)
            if m is None:
                continue
            k = int(m.group(1))
        out.setdefault(int(k), []).append(e)
    return dict(sorted(out.items()))


def fxpipe_done_at(timeline: dict[int, list[Any]], rank: int = 0) -> list[float]:
    """Completion time of each minibatch at ``rank`` (the input stage): the end of the last
    optimizer span of its update ``U<k>`` (pipedream, one replica: update k follows backward k),
    from the runtime's own timeline."""
    return [max(e.end for e in evs) for evs in fxpipe_updates(timeline[rank]).values()]


def fxpipe_first_forward(timeline: dict[int, list[Any]], rank: int = 0) -> float:
    """Start of the rank's first forward, in seconds after the runtime's common start (the
    barrier after rendezvous): what the rank spent setting up before training."""
    return min(e.start for e in timeline[rank] if e.category == "forward")


# ----------------------------------------------------------------------------- stats
def med(xs: Sequence[float]) -> float:
    return statistics.median(xs)


def spread(xs: Sequence[float], fmt: str = "{:.3f}") -> str:
    """``median [min-max]`` of a list, formatted."""
    return f"{fmt.format(med(xs))} [{fmt.format(min(xs))}-{fmt.format(max(xs))}]"


def machine() -> str:
    load = ", ".join(f"{v:.1f}" for v in os.getloadavg())
    return (f"{os.cpu_count()} CPU cores shared with other jobs (load average {load} at the "
            f"end), torch {torch.__version__}, Python {sys.version.split()[0]}, 1 thread per "
            "process")


# ----------------------------------------------------------------------------- spawning
def spawn_and_collect(target: Callable[..., None], nprocs: int, args: tuple,
                      timeout_s: float = 300.0) -> list[Any]:
    """Run ``target(rank, outdir, *args)`` in ``nprocs`` spawned processes; each writes
    ``outdir/rank<r>.pt``. Children are always joined and, past the deadline, terminated
    (the runtime's own launch, ``run_children``: once one fails the others get 2 s to notice)."""
    ctx = torch.multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="fxpipe-bench-") as outdir:
        procs = [ctx.Process(target=target, args=(r, outdir, *args), daemon=True)
                 for r in range(nprocs)]
        run_children(procs, timeout_s=0.0, join_timeout_s=timeout_s)
        codes = [p.exitcode for p in procs]
        if any(c != 0 for c in codes):
            errs = [(Path(outdir) / f"rank{r}.err") for r in range(nprocs)]
            msg = "; ".join(e.read_text() for e in errs if e.exists())
            raise RuntimeError(f"spawned benchmark processes failed (exit codes {codes}): {msg}")
        return [torch.load(Path(outdir) / f"rank{r}.pt", weights_only=False) for r in range(nprocs)]


def write_error(outdir: str, rank: int, err: BaseException) -> None:
    import traceback
    (Path(outdir) / f"rank{rank}.err").write_text(f"rank {rank}: {err!r}\n{traceback.format_exc()}")
