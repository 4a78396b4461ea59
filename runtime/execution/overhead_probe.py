"""Measure what the runtime pays beyond plain PyTorch on this machine, once, and keep it.

Why a probe: the profile times each node as plain PyTorch runs it (and scales the sums to whole
plain training steps). The runtime also pays a fixed cost for every stage's F, B and U (the
replica's calls, the executor between actions), a cost per parameter tensor (swapped into the
stage's module for every call, its gradient summed), per message it posts or takes, and the
stash's bookkeeping (:mod:`fxpipe.costmodel.overheads`). Those depend on the machine, torch and
fxpipe far more than on the model, so they are measured here on a probe and reused for every
plan (cached per machine).

The probe: four ``Linear(256, 256) + Tanh`` layers, batch 64 (about 0.6 ms of compute per stage
at two stages, so the pipeline is compute-bound and a message's latency hides behind the next
minibatch's work, as it does for a real stage), trained with ``pipedream`` through
``run_distributed`` (gloo, one thread per rank) three times: on one rank, on one rank with 48
more layers of two 4-element parameters each, and on two ranks. From each rank's own timeline,
over the middle half of the run, the seconds per minibatch it was not waiting for its peer's
compute (:func:`host_seconds`: forward, backward, update, posting sends, idle, and receive
waits for the transfer itself, :func:`fxpipe.runtime.timeline.wait_breakdown`); against them,
plain PyTorch training steps of the same layers in this process (:func:`_eager_step`, freed host
memory kept as the profiler and the ranks keep it; not the probe's own profile, whose error
would land in the overheads):

* ``tensor_s``: (many-tensor run - one-rank run - the extra layers' plain steps) / 96 tensors;
* ``action_s``: one-rank run - plain step - 8 tensors;
* ``message_s``: each stage of the two-rank run - half the plain step - ``action_s`` - its 4
  tensors, mean of the two stages, over its 2 messages (one value crosses the cut);
* ``stash_tensor_s``: a copy-on-write update of 128 tiny parameters against a plain one, per
  tensor (:func:`stash_per_tensor`, in this process).

Each is clamped at 0. ``machine_overheads`` runs the probe in a fresh interpreter
(:func:`measure_in_subprocess`): the ranks are started with multiprocessing's spawn, which runs
the parent's main script again in each child, and a user's script that compiles at its top level
(no ``__main__`` guard, the README's pattern) must not run again inside the probe. A probe that
fails is a warning and no overheads (not cached). Cached in ``$FXPIPE_CACHE_DIR`` (default
``$XDG_CACHE_HOME/fxpipe`` or ``~/.cache/fxpipe``), ``overheads.json``, under a key naming the
host, its cores and the torch, Python and fxpipe versions; ``machine_overheads(refresh=True)``
measures again. About 10 s (three launches). On the project's 2-core machine, five probes gave
0.19-0.38 ms per stage and minibatch, 0-3.9 us per tensor and 0.21-0.48 ms per message: the
machine's own noise, of the same order as the run-to-run spread of the profile it is added to.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from fxpipe.codegen import split_graph
from fxpipe.costmodel import Cluster, estimate_graph, to_profile
from fxpipe.costmodel.profiler import pinned_threads
from fxpipe.costmodel.overheads import Overheads
from fxpipe.host_memory import keep_freed_memory
from fxpipe.jsonio import write_json_atomic
from fxpipe.passes import partition
from fxpipe.passes.overhead_pricing import stage_overheads
from fxpipe.tracing import trace

from ..replica.stash import WeightStash
from ..schedules.kinds import make_schedule
from ..timeline import TimelineEvent, minibatch_window, wait_breakdown
from .launch import run_distributed

log = logging.getLogger(__name__)

WIDTH, LAYERS, BATCH = 256, 4, 64
SMALL, SMALLS = 4, 48  # the many-tensor variant: 48 more layers of two 4-element tensors
MINIBATCHES = 160  # the middle half is measured
CACHE_FILE = "overheads.json"


def probe_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The probe's loss (module level: the spawned ranks unpickle it)."""
    return F.mse_loss(out, target)


def probe_optimizer(params: list[torch.Tensor]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.01, momentum=0.9)


class _Small(nn.Module):
    """``x + (x[:, :SMALL] @ w)`` padded: two parameter tensors and next to no compute."""

    def __init__(self, g: torch.Generator) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(SMALL, SMALL, generator=g) * 0.01)
        self.b = nn.Parameter(torch.zeros(SMALL))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.pad(x[:, :SMALL] @ self.w + self.b, (0, x.shape[1] - SMALL))


def probe_model(small: int = 0) -> nn.Module:
    """The probe (see the module doc); ``small`` more layers of two tiny parameter tensors
    each, for the cost per parameter tensor."""
    g = torch.Generator().manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(LAYERS):
        lin = nn.Linear(WIDTH, WIDTH)
        with torch.no_grad():
            lin.weight.copy_(torch.randn(WIDTH, WIDTH, generator=g) / WIDTH ** 0.5)
        layers += [lin, nn.Tanh()]
    layers += [_Small(g) for _ in range(small)]
    return nn.Sequential(*layers)


def host_seconds(timeline: dict[int, list[TimelineEvent]], lo: int, hi: int) -> list[float]:
    """Per rank (one per stage), seconds per minibatch over minibatches ``lo..hi-1`` that the
    rank was not waiting for its peer's compute: its forward, backward and update as run, its
    sends' posting, its idle time and its receive waits for the transfer itself."""
    wins = minibatch_window(timeline, lo, hi)
    waits = wait_breakdown(wins)
    n = hi - lo
    out = []
    for r in sorted(wins):
        busy = sum(e.duration for e in wins[r]
                   if e.category in ("forward", "backward", "optimizer", "send", "idle"))
        out.append((busy + waits[r]["transfer"] + waits[r]["late"]) / n)
    return out


def _eager_step(small: int, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """Median seconds of a plain training step (forward, loss, backward, SGD step) of the probe
    with ``small`` tiny layers, one thread."""
    model = probe_model(small)
    opt = probe_optimizer(list(model.parameters()))
    times = []
    with pinned_threads(1):
        for i, (x, y) in enumerate(batches[:60]):
            t0 = time.perf_counter()
            probe_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if i >= 10:
                times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _run(stages: int, batches: list[tuple[torch.Tensor, torch.Tensor]], small: int = 0
         ) -> list[float]:
    """Per stage of the probe (with ``small`` tiny layers) on ``stages`` ranks, the seconds per
    minibatch it ran (:func:`host_seconds`), less the stash's copy where it stashed (priced
    per model, from the profile's ``stash_copy_s``)."""
    traced = trace(probe_model(small), (batches[0][0],))
    # estimated, not measured: only the cut (the halves are alike) and the stash's copy are read
    estimate_graph(traced.gm, traced.flat_inputs, "cpu")
    profile = to_profile(traced.gm, batch_size=BATCH, device="cpu (estimated)")
    plan = partition(profile, Cluster(workers=stages), stages=stages, straight=True)
    specs = split_graph(traced.gm, plan.stage_of())
    copies = stage_overheads(profile, [profile.names.index(st.nodes[0]) for st in plan.stages],
                             plan.replicas, [st.in_flight for st in plan.stages],
                             plan.memory_rule,
                             Overheads(stash_copy_s=profile.meta.get("stash_copy_s", 0.0)))
    sched = make_schedule("pipedream", [1] * stages, len(batches))
    res = run_distributed(specs, [1] * stages, sched, probe_loss, probe_optimizer, batches,
                          timeout_s=60.0)
    ran = host_seconds(res.timeline, len(batches) // 4, 3 * len(batches) // 4)
    return [t - c for t, c in zip(ran, copies)]


def _updates(tensors: int, held: bool, steps: int = 120) -> float:
    """Median seconds of a stash update of ``tensors`` 4-element parameters (SGD), with the
    current version still read by a minibatch in flight (``held``: a copy-on-write) or not."""
    params = {f"p{i}": torch.zeros(4, requires_grad=True) for i in range(tensors)}
    stash = WeightStash(params, probe_optimizer)
    grads: dict[str, torch.Tensor | None] = {n: torch.ones(4) for n in params}
    times = []
    for k in range(steps):
        if held:
            stash.acquire(k, None)
        t0 = time.perf_counter()
        stash.update(grads)
        times.append(time.perf_counter() - t0)
        if held:
            stash.release(k)
    return statistics.median(times[steps // 4:])


def stash_per_tensor(tensors: int = 128) -> float:
    """Seconds per parameter tensor that a copy-on-write update adds to a plain one, beyond
    copying the bytes (4-element tensors: next to none)."""
    return max(_updates(tensors, True) - _updates(tensors, False), 0.0) / tensors


def measure_overheads(minibatches: int = MINIBATCHES) -> Overheads:
    """Run the probe (one rank, one rank with many tensors, two ranks) and the plain steps,
    and derive the overheads (see the module doc); ``stash_copy_s`` is left 0 (the profile
    measures it, per model)."""
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(BATCH, WIDTH, generator=g), torch.randn(BATCH, WIDTH, generator=g))
               for _ in range(minibatches)]
    t0 = time.perf_counter()
    keep_freed_memory()  # the plain steps run as the profile times them, and the ranks run
    with torch.random.fork_rng(devices=[]):
        one, many, two = _run(1, batches)[0], _run(1, batches, SMALLS)[0], _run(2, batches)
        # the yardstick: the same steps as plain PyTorch runs them (what the profile's
        # whole-step calibration holds the node times to), measured here, not the probe's
        # profile, whose own error would land in the overheads
        eager_one, eager_many = _eager_step(0, batches), _eager_step(SMALLS, batches)
    per_tensor = max((many - one) - (eager_many - eager_one), 0.0) / (2 * SMALLS)
    action = max(one - eager_one - 2 * LAYERS * per_tensor, 0.0)
    # at two stages each holds two of the probe's (identical) layers, half the step, and one
    # value crosses the cut
    message = max(statistics.fmean(two) - eager_one / 2 - action - LAYERS * per_tensor,
                  0.0) / 2
    # a tied all-reduce is posted and waited for like a send and a receive: two messages
    ov = Overheads(action_s=action, message_s=message, tensor_s=per_tensor,
                   stash_tensor_s=stash_per_tensor(), tie_s=2 * message,
                   source=f"measured on {platform.node() or 'this machine'} "
                          f"(fxpipe.runtime.execution.overhead_probe)")
    log.info("runtime overheads: %.3f ms per stage and minibatch, %.1f us per parameter tensor "
             "(%.1f us more where the stash copies), %.3f ms per message (probe, %.1f s)",
             action * 1e3, per_tensor * 1e6, ov.stash_tensor_s * 1e6, message * 1e3,
             time.perf_counter() - t0)
    return ov


# the launcher's variables a probe must not inherit (it is a job of its own, on this machine)
_JOB_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                  "MASTER_ADDR", "MASTER_PORT")


def measure_in_subprocess(timeout_s: float = 300.0) -> Overheads:
    """:func:`measure_overheads` in a fresh interpreter (``python -m`` this module).

    Why not in this process: the probe launches ranks with multiprocessing's spawn, which runs
    the parent's main script again in every child; a user's script that calls
    ``fxpipe.compile`` at its top level (the README's pattern, under torchrun) would start
    compiling, and training, inside the probe's ranks. A fresh interpreter's main script is this
    module. Raises ``RuntimeError`` with the child's last lines when it fails."""
    env = {k: v for k, v in os.environ.items()
           if k not in _JOB_VARIABLES and not k.startswith("TORCHELASTIC_")}
    res = subprocess.run([sys.executable, "-m", __name__, "--json"], capture_output=True,
                         text=True, timeout=timeout_s, env=env)
    lines = res.stdout.strip().splitlines()
    if res.returncode != 0 or not lines:
        tail = "\n".join((res.stderr or res.stdout).strip().splitlines()[-5:])
        raise RuntimeError(f"the probe exited with {res.returncode}: {tail}")
    return Overheads.from_dict(json.loads(lines[-1]))


def cache_dir() -> Path:
    env = os.environ.get("FXPIPE_CACHE_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "fxpipe"


def machine_key() -> str:
    """What the overheads depend on: the host, its cores, torch, Python, fxpipe."""
    from importlib.metadata import PackageNotFoundError, version
    try:
        ours = version("fxpipe")
    except PackageNotFoundError:
        ours = "unknown"
    return (f"{platform.node()}|{os.cpu_count()} cpus|torch {torch.__version__}|"
            f"python {sys.version_info[0]}.{sys.version_info[1]}|fxpipe {ours}")


def machine_overheads(refresh: bool = False) -> Overheads:
    """This machine's overheads: from the cache, else (or with ``refresh``) measured by the
    probe and cached. An unreadable cache is measured over; a cache that cannot be written
    only costs the next process the probe again; a probe that fails (no local port, no
    processes) is a warning and no overheads, not cached, so the next compile tries again."""
    path = cache_dir() / CACHE_FILE
    key = machine_key()
    cached: dict[str, Any] = {}
    try:
        cached = json.loads(path.read_text())
        if not isinstance(cached, dict):
            cached = {}
    except (OSError, ValueError):
        cached = {}
    if not refresh and isinstance(cached.get(key), dict):
        try:
            return Overheads.from_dict(cached[key])
        except Exception as e:  # noqa: BLE001 - a hand-edited cache: measure again
            log.warning("ignoring the cached overheads in %s (%s)", path, e)
    try:
        ov = measure_in_subprocess()
    except Exception as e:  # noqa: BLE001 - a probe that cannot run must not stop a compile
        log.warning("could not measure the runtime's overheads (%s: %s); the plan leaves them "
                    "out (FXPIPE_OVERHEADS=off says so quietly)", type(e).__name__, e)
        return Overheads(source=f"not measured: the probe failed ({type(e).__name__})")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, {**cached, key: ov.to_dict()})
    except OSError as e:
        log.warning("could not cache the runtime overheads in %s (%s)", path, e)
    return ov


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m fxpipe.runtime.execution.overhead_probe [--json]``: measure and print."""
    ap = argparse.ArgumentParser(description="measure the runtime's overheads on this machine")
    ap.add_argument("--json", action="store_true", help="print them as one JSON line")
    args = ap.parse_args(argv)
    if not args.json:
        logging.basicConfig(level=logging.INFO, format="%(message)s")
    ov = measure_overheads()
    print(json.dumps(ov.to_dict()) if args.json else ov)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
