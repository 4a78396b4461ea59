"""What ``schedule="auto"``'s pilot on copies costs in memory, priced before it copies anything.

A candidate's copy (:func:`copy_bytes`): each replica's weights, gradients, optimizer state and
stashed versions, plus activations in flight. No pilot where it would leave less than
``memory_margin`` free (:func:`available_bytes`) or add more than ``max_memory`` to training."""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from ..schedules.spec import parse_schedule
from ..schedules.staleness import own_delays

log = logging.getLogger("fxpipe.runtime.training.auto")

GRADIENT_COPIES = 3
"""Gradient-sized buffers of a replica at an update on the reference executor: the replica's
gradient sum, the flat buffer it is concatenated into, and that buffer's sum over replicas."""
FALLBACK_STATE_FACTOR = 2.0
"""Optimizer state per trainable byte when it cannot be measured: Adam's (two moments)."""


def _tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def stage_bytes(stages: Sequence[Any]) -> list[tuple[int, int, bool]]:
    """Per stage: (bytes of its parameters and buffers, bytes of its trainable parameters,
    whether all of them are on the CPU)."""
    out = []
    for st in stages:
        params = list(st.gm.parameters())
        tensors = params + list(st.gm.buffers())
        out.append((sum(_tensor_bytes(t) for t in tensors),
                    sum(_tensor_bytes(p) for p in params if p.requires_grad),
                    all(t.device.type == "cpu" for t in tensors)))
    return out


def optimizer_state_factor(optimizer: Callable[..., torch.optim.Optimizer],
                           stages: Sequence[Any]) -> float:
    """Bytes of optimizer state per trainable byte: the user's factory built, and stepped once,
    on tiny tensors shaped like one stage's trainable parameters (same count and number of
    dimensions, so a factory that groups by name or by shape accepts them); only per-element
    state counts (a step counter is negligible next to a real parameter). Falls back to
    :data:`FALLBACK_STATE_FACTOR` when the factory will not run on them."""
    from ..replica.state_size import state_per_byte

    st = next((s for s in stages if any(p.requires_grad for p in s.gm.parameters())), None)
    if st is None:
        return 0.0
    factor, err = state_per_byte(optimizer, [(p.dim(), p.dtype) for p in st.gm.parameters()
                                             if p.requires_grad], st.index)
    if factor is None:
        log.debug("auto: optimizer state not measured (%s); assuming %s bytes per byte", err,
                  FALLBACK_STATE_FACTOR)
        return FALLBACK_STATE_FACTOR
    return factor


def activation_bytes(profile: Any) -> float:
    """One minibatch's activations (what backward keeps, ``ProfileNode.held_bytes``), from the
    compiled profile; 0 without one."""
    return float(sum(n.held_bytes for n in profile.nodes)) if profile is not None else 0.0


def copy_bytes(candidate: str, sizes: Sequence[tuple[int, int, bool]], replicas: Sequence[int],
               state_factor: float, activations: float = 0.0) -> int:
    """Bytes one pilot candidate's copy holds at its peak (docs/design-notes.md)."""
    spec = parse_schedule(candidate)
    async_ = spec.kind == "pipedream"
    delays = own_delays("pipedream", list(replicas)) if async_ else [0] * len(sizes)
    m = spec.mitigation
    total = 0.0
    for (whole, trainable, on_cpu), r, d in zip(sizes, replicas, delays):
        versions = (d + 1 if d else 0) + (2 + d if m is not None and m.predict else 0) \
            + (1 if m is not None and m.dc else 0)
        total += (0 if on_cpu else whole) + r * (
            whole + trainable * (GRADIENT_COPIES + state_factor + versions))
    return int(total + activations * (len(sizes) if async_ else 1))


def rank_estimate(candidates: Sequence[str], stages: Sequence[Any], replicas: Sequence[int],
                  optimizer: Callable[..., torch.optim.Optimizer], profile: Any = None, *,
                  factor: float | None = None) -> tuple[int, str]:
    """(the most this rank's share of the pilot holds at once, what it is made of): the largest
    of its ``candidates``' copies and the probe's (pipedream; a rank with no candidate neither
    probes nor copies: 0). ``factor``: the optimizer's state per byte, when already measured."""
    if not candidates:
        return 0, "no candidate on this rank"
    sizes = stage_bytes(stages)
    factor = optimizer_state_factor(optimizer, stages) if factor is None else factor
    act = activation_bytes(profile)
    need = {c: copy_bytes(c, sizes, replicas, factor, act) for c in ("pipedream", *candidates)}
    worst = max(need, key=lambda c: need[c])
    from fxpipe.units import format_bytes

    weights = sum(w for w, _, _ in sizes)
    return need[worst], (f"{worst}'s copy: {format_bytes(weights)} of weights and buffers, "
                         f"x{GRADIENT_COPIES} gradients and x{factor:.3g} optimizer state per "
                         f"trainable byte, replicas {list(replicas)}")


def training_bytes(stages: Sequence[Any], local: Sequence[int], factor: float,
                   resident: int | None = None) -> int:
    """What this rank's training holds at its peak, for comparing the pilot with it
    (``max_memory``): its resident memory now (the model, the compiled stages, its own
    replicas: :func:`resident_bytes`) plus what training adds to it, gradients and optimizer
    state of the stage replicas it runs (``local``: their stage indices, one per replica)."""
    sizes = stage_bytes(stages)
    now = resident_bytes() if resident is None else resident
    return int((now or 0) + sum(sizes[s][1] * (GRADIENT_COPIES + factor) for s in local))


def resident_bytes() -> int | None:
    """This process's resident set now (psutil, else ``VmRSS`` of ``/proc/self/status``)."""
    try:
        import psutil  # type: ignore[import-not-found]

        return int(psutil.Process().memory_info().rss)
    except ImportError:
        pass
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _cgroup_room(root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """Bytes the cgroup still lets this process take: its limit less its usage, page cache
    that can be reclaimed (inactive file pages) not counted as used; None without a limit."""
    for limit_f, usage_f, stat_f, key in (
            ("memory.max", "memory.current", "memory.stat", "inactive_file"),
            ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes",
             "memory/memory.stat", "total_inactive_file")):
        limit, usage = _read_int(root / limit_f), _read_int(root / usage_f)
        if limit is None or usage is None or limit >= 1 << 60:  # "max" or v1's "no limit"
            continue
        cache = 0
        try:
            for line in (root / stat_f).read_text().splitlines():
                name, _, value = line.partition(" ")
                if name == key and value.strip().isdigit():
                    cache = int(value)
        except OSError:
            pass
        return max(limit - usage + cache, 0)
    return None


def host_available() -> int | None:
    """Bytes the host can still give this process (docs/design-notes.md); None where neither
    psutil nor ``/proc/meminfo`` says."""
    try:
        import psutil  # type: ignore[import-not-found]

        avail: int | None = int(psutil.virtual_memory().available)
    except ImportError:
        avail = None
        try:
            for line in Path("/proc/meminfo").read_text().splitlines():
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
        except (OSError, ValueError, IndexError):
            avail = None
    room = _cgroup_room()
    if room is not None:
        avail = room if avail is None else min(avail, room)
    return avail


def available_bytes() -> int | None:
    """This rank's share of :func:`host_available`: the ranks on one host run their pilots at
    the same time (``LOCAL_WORLD_SIZE``, which torchrun sets; 1 outside of it)."""
    avail = host_available()
    try:
        local = max(int(os.environ.get("LOCAL_WORLD_SIZE", "1")), 1)
    except ValueError:
        local = 1
    return None if avail is None else avail // local
