"""One device policy for every rank, and host-to-device copies that do not stall the host.

The i-th process on a machine (``LOCAL_RANK``) drives GPU i (``cuda:N`` is honoured; no CUDA: the
CPU); host tensors go to a GPU from pinned memory with ``non_blocking=True``.
"""
from __future__ import annotations

import logging
import os
from typing import Any, Mapping

import torch

from ..errors import RuntimeConfigError
from .weighted import Weighted

log = logging.getLogger(__name__)


def local_rank(env: Mapping[str, str] | None = None) -> int:
    """This process's index on its machine (torchrun's ``LOCAL_RANK``; 0 when unset)."""
    env = os.environ if env is None else env
    text = env.get("LOCAL_RANK", "0")
    try:
        value = int(text)
    except ValueError:
        raise RuntimeConfigError(f"LOCAL_RANK={text!r} is not an integer",
                                 "launch with torchrun, which sets it") from None
    if value < 0:
        raise RuntimeConfigError(f"LOCAL_RANK={value}", "it must be >= 0")
    return value


def rank_device(requested: str | torch.device | None = None, *,
                env: Mapping[str, str] | None = None,
                cuda_available: bool | None = None, device_count: int | None = None
                ) -> torch.device:
    """The device of this rank (docs/design-notes.md): ``None`` -> ``cuda:LOCAL_RANK`` when CUDA
    is available, else the CPU; ``"cuda"`` -> ``cuda:LOCAL_RANK``; ``"cuda:N"`` -> GPU N;
    ``"cpu"`` -> the CPU. ``cuda_available`` / ``device_count`` are for tests."""
    avail = torch.cuda.is_available() if cuda_available is None else cuda_available
    dev = torch.device(requested) if requested is not None else torch.device(
        "cuda" if avail else "cpu")
    if dev.type != "cuda":
        return dev
    if not avail:
        raise RuntimeConfigError(f"device {str(requested)!r} but CUDA is not available",
                                 "use device='cpu' (gloo), or run on a machine with GPUs")
    count = torch.cuda.device_count() if device_count is None else device_count
    index = dev.index if dev.index is not None else local_rank(env)
    if index >= count:
        raise RuntimeConfigError(
            f"this rank wants cuda:{index} (LOCAL_RANK {local_rank(env)}) but the machine has "
            f"{count} GPU(s)", "start at most one process per GPU on each machine "
            "(torchrun --nproc-per-node <= number of GPUs)")
    return torch.device("cuda", index)


def to_device(x: Any, device: torch.device) -> Any:
    """``x`` on ``device``: a tensor, the tensors of a tuple, list or dict (a target of several
    tensors) or of a :class:`~.weighted.Weighted` target; anything else as it is. A host tensor
    bound for a GPU is copied from pinned memory without blocking the host."""
    if isinstance(x, Weighted):
        return Weighted(to_device(x.value, device), x.weight, x.count)
    if isinstance(x, (tuple, list)) and type(x) in (tuple, list):
        return type(x)(to_device(v, device) for v in x)
    if isinstance(x, dict) and type(x) is dict:
        return {k: to_device(v, device) for k, v in x.items()}
    if not isinstance(x, torch.Tensor) or x.device == device:
        return x
    if device.type == "cuda" and x.device.type == "cpu":
        return pinned(x).to(device, non_blocking=True)
    return x.to(device)


def pinned(x: Any) -> Any:
    """A page-locked copy of a host tensor (itself if already pinned); other values as they are.
    Call it where the copy can overlap other work (when a segment's minibatches are read)."""
    if isinstance(x, torch.Tensor) and x.device.type == "cpu" and not x.is_pinned():
        return x.pin_memory()
    if isinstance(x, (tuple, list)):
        return type(x)(pinned(v) for v in x)
    return x


class CudaClock:
    """:class:`~fxpipe.runtime.timeline.DeviceClock` on a CUDA device: a mark is a timing
    event recorded on the current stream; its host time is that of a reference event taken
    right after a synchronisation, plus the GPU-measured time between the two."""

    def __init__(self, device: torch.device) -> None:
        import time

        self.device = device
        torch.cuda.synchronize(device)
        self._ref = torch.cuda.Event(enable_timing=True)
        self._ref.record()
        self._ref.synchronize()
        self._host = time.perf_counter()

    def mark(self) -> Any:
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def seconds(self, mark: Any) -> float:
        mark.synchronize()
        return self._host + self._ref.elapsed_time(mark) / 1e3


def move_constants(gm: torch.nn.Module, device: torch.device) -> None:
    """Move the tensors a graph holds that are neither parameters nor buffers (a traced
    constant such as ``_tensor_constant0``) to ``device``: ``Module.to`` leaves them behind, and
    a stage whose weights are swapped in on a GPU would otherwise mix devices."""
    for mod in gm.modules():
        slots = set(mod._parameters) | set(mod._buffers)
        for name, value in list(vars(mod).items()):
            if isinstance(value, torch.Tensor) and name not in slots and value.device != device:
                setattr(mod, name, value.to(device))
