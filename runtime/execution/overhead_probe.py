"""Measures once per machine what the runtime pays beyond plain PyTorch, and caches it.

The costs per action, tensor, message and stash (:mod:`fxpipe.costmodel.overheads`) depend on the
machine far more than on the model, so a small probe measures them once for every plan.
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from fxpipe.codegen import split_graph
from fxpipe.costmodel import Cluster, estimate_graph, to_profile
from fxpipe.costmodel.overheads import Overheads
from fxpipe.host_memory import keep_freed_memory
from fxpipe.jsonio import write_json_atomic
from fxpipe.passes import partition
from fxpipe.passes.overhead_pricing import stage_overheads
from fxpipe.tracing import trace

from ..schedules.kinds import make_schedule
from ..timeline import TimelineEvent, minibatch_window, wait_breakdown
from .contract import RunResult
from .launch import RankJob, run_rank_jobs
from .overhead_local import (BATCH, LAYERS, WIDTH, FanProbe, eager_step, fan_cut, probe_loss,
                             probe_model, probe_optimizer, replica_per_tensor,
                             stash_per_tensor)

__all__ = ["ProbeRound", "combine", "combine_value", "derive", "derive_value", "host_seconds",
           "machine_overheads", "measure_overheads", "probe_loss", "probe_model",
           "probe_optimizer", "stash_per_tensor"]

log = logging.getLogger(__name__)

MINIBATCHES = 160  # the middle half is measured
PER_TENSOR_BATCHES = 120  # replica and plain steps paired, once, for the cost per tensor
ROUNDS = 3  # of the whole probe; each quantity is the median over them (combine)
FAN = 3  # values more across the fan probe's cut (value_s)
CACHE_FILE = "overheads.json"


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


def _fan_job(batches: list[tuple[torch.Tensor, torch.Tensor]]) -> RankJob:
    """:class:`~.overhead_local.FanProbe` (``FAN`` values more across its cut) on two ranks;
    its weights and cut are the probe's, so its stash's copy is the two-rank job's."""
    traced = trace(FanProbe(FAN), (batches[0][0],))
    specs = split_graph(traced.gm, fan_cut(traced.gm))
    return RankJob(specs, [1, 1], make_schedule("pipedream", [1, 1], len(batches)), probe_loss,
                   probe_optimizer, batches)


def _probe_job(stages: int, batches: list[tuple[torch.Tensor, torch.Tensor]]
               ) -> tuple[RankJob, list[float]]:
    """The probe on ``stages`` ranks, and the stash's copy in each stage where it stashes
    (priced per model, from the profile's ``stash_copy_s``; taken out of the action's cost)."""
    traced = trace(probe_model(), (batches[0][0],))
    # estimated, not measured: only the cut (the halves are alike) and the stash's copy are read
    estimate_graph(traced.gm, traced.flat_inputs, "cpu")
    profile = to_profile(traced.gm, batch_size=BATCH, device="cpu (estimated)")
    plan = partition(profile, Cluster(workers=stages), stages=stages, straight=True)
    specs = split_graph(traced.gm, plan.stage_of())
    copies = stage_overheads(profile, [profile.names.index(st.nodes[0]) for st in plan.stages],
                             plan.replicas, [st.in_flight for st in plan.stages],
                             plan.memory_rule,
                             Overheads(stash_copy_s=profile.meta.get("stash_copy_s", 0.0)))
    job = RankJob(specs, [1] * stages, make_schedule("pipedream", [1] * stages, len(batches)),
                  probe_loss, probe_optimizer, batches)
    return job, copies


def _measured(res: RunResult, minibatches: int) -> list[float]:
    """Per rank of a probe run, seconds per minibatch over its middle half (host_seconds)."""
    return host_seconds(res.timeline, minibatches // 4, 3 * minibatches // 4)


@dataclass(frozen=True)
class ProbeRound:
    """One round of the probe: seconds per minibatch of the one-rank run (``one``) and of each
    stage of the two-rank run (``two``), of a plain PyTorch step of the probe (``eager_one``),
    and the seconds per parameter tensor the stage replica adds to plain steps
    (``per_tensor``, :func:`~fxpipe.runtime.execution.overhead_local.replica_per_tensor`)."""

    one: float
    two: tuple[float, ...]
    eager_one: float
    per_tensor: float
    fan_two: tuple[float, ...] = ()  # each stage of FanProbe(FAN) on two ranks, as ``two``
    eager_fan: float = 0.0           # a plain step of FanProbe(FAN)


def derive_value(r: ProbeRound) -> float | None:
    """``value_s`` of one round: what the fan run's stages pay beyond the plain two-rank run's,
    less half the fan's extra plain compute, over the ``2 * FAN`` messages more each stage
    posts or takes (clamped at 0); None where the round has no fan run."""
    if not r.fan_two:
        return None
    extra = statistics.fmean(r.fan_two) - statistics.fmean(r.two)
    return max(extra - (r.eager_fan - r.eager_one) / 2, 0.0) / (2 * FAN)


def derive(r: ProbeRound) -> tuple[float, float, float]:
    """(action_s, tensor_s, message_s) of one round (docs/design-notes.md), each clamped at 0."""
    per_tensor = max(r.per_tensor, 0.0)
    action = max(r.one - r.eager_one - 2 * LAYERS * per_tensor, 0.0)
    # at two stages each holds two of the probe's (identical) layers, half the step, and one
    # value crosses the cut
    message = max(statistics.fmean(r.two) - r.eager_one / 2 - action - LAYERS * per_tensor,
                  0.0) / 2
    return action, per_tensor, message


def combine(rounds: Sequence[ProbeRound]) -> tuple[float, float, float]:
    """The median over ``rounds`` of each of :func:`derive`'s quantities. Why: each is a small
    difference of runs of a few milliseconds per minibatch, and one disturbed launch moves it by
    its whole size; the median of three ignores one such launch."""
    if not rounds:
        raise ValueError("no probe rounds")
    got = [derive(r) for r in rounds]
    action, tensor, message = (statistics.median(g[i] for g in got) for i in range(3))
    return action, tensor, message


def combine_value(rounds: Sequence[ProbeRound]) -> float | None:
    """The median over ``rounds`` of :func:`derive_value` (None where no round has it)."""
    got = [v for v in (derive_value(r) for r in rounds) if v is not None]
    return statistics.median(got) if got else None


def measure_overheads(minibatches: int = MINIBATCHES, rounds: int = ROUNDS) -> Overheads:
    """Run the probe ``rounds`` times (each: one rank, two ranks and the fan on two ranks, all
    rounds in one world of two spawned ranks; then the plain steps in this process, and once
    the replica's steps), derive the overheads of each round and keep their medians
    (:func:`combine`; see docs/design-notes.md); ``stash_copy_s`` is left 0 (the profile measures
    it, per model)."""
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(BATCH, WIDTH, generator=g), torch.randn(BATCH, WIDTH, generator=g))
               for _ in range(minibatches)]
    t0 = time.perf_counter()
    keep_freed_memory()  # the plain steps run as the profile times them, and the ranks run
    with torch.random.fork_rng(devices=[]):
        (one_job, one_copy), (two_job, copies) = _probe_job(1, batches), _probe_job(2, batches)
        fan_job = _fan_job(batches)
        # every round's runs in one world of two ranks: a process's start costs seconds
        runs = run_rank_jobs([one_job, two_job, fan_job] * rounds, timeout_s=60.0)
        # in this process, once: the median of many interleaved pairs (no launch to disturb)
        per_tensor = replica_per_tensor(batches[:PER_TENSOR_BATCHES])
        got: list[ProbeRound] = []
        for n in range(rounds):
            one, two, fan = (_measured(r, minibatches) for r in runs[3 * n:3 * n + 3])
            two, fan = ([t - c for t, c in zip(ts, copies)] for ts in (two, fan))
            # the yardstick: the same steps as plain PyTorch runs them (what the profile's
            # whole-step calibration holds the node times to), measured here, not the probe's
            # profile, whose own error would land in the overheads
            got.append(ProbeRound(one[0] - one_copy[0], tuple(two),
                                  eager_step(probe_model(), batches),
                                  per_tensor, tuple(fan),
                                  eager_step(FanProbe(FAN), batches)))
    action, per_tensor, message = combine(got)
    # a tied all-reduce is posted and waited for like a send and a receive: two messages
    ov = Overheads(action_s=action, message_s=message, tensor_s=per_tensor,
                   stash_tensor_s=stash_per_tensor(), tie_s=2 * message,
                   value_s=combine_value(got),
                   source=f"measured on {platform.node() or 'this machine'} "
                          f"(fxpipe.runtime.execution.overhead_probe)")
    spread = [derive(r) for r in got]
    log.info("runtime overheads: %.3f ms per stage and minibatch, %.1f us per parameter tensor "
             "(%.1f us more where the stash copies), %.3f ms per message (%.3f ms per message of "
             "a value beyond a cut's first) (probe, median of %d rounds: %s; %.1f s)",
             action * 1e3, per_tensor * 1e6, ov.stash_tensor_s * 1e6, message * 1e3,
             ov.further_s * 1e3, len(got),
             ", ".join(f"{a * 1e3:.3f} ms / {t * 1e6:.1f} us / {m * 1e3:.3f} ms"
                       for a, t, m in spread), time.perf_counter() - t0)
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
    log.info("measuring the runtime's overheads on this machine, once (cached in %s; "
             "FXPIPE_OVERHEADS=off skips it)", path)
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
