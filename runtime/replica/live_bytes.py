"""Measured memory of one stage replica: the peak bytes of live tensors while it trains.

``max_memory_allocated`` on CUDA; on the CPU :class:`LiveBytes`, a dispatch mode that counts each
storage once until freed. What ``measure_memory=True`` holds the planner's prediction against.
"""
from __future__ import annotations

import threading
import weakref
from typing import Any, Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


def _storage(t: torch.Tensor) -> torch.UntypedStorage | None:
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # sparse, nested: no plain storage
        return None


def reachable_storages(root: Any, skip: tuple[type, ...] = ()) -> list[torch.UntypedStorage]:
    """Every tensor storage reachable from ``root`` through containers, fxpipe objects'
    attributes, optimizers' states and tensors' gradients. Modules and Parameters are the
    user's model, not the replica's (the stage's GraphModule and the slots a call swaps the
    replica's own plain-tensor weights into): not entered; nor are instances of ``skip``."""
    seen: set[int] = set()
    found: dict[int, torch.UntypedStorage] = {}
    todo: list[Any] = [root]
    while todo:
        obj = todo.pop()
        if id(obj) in seen or isinstance(obj, (torch.nn.Module, torch.nn.Parameter, *skip)):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            st = _storage(obj)
            if st is not None and obj.device.type != "meta":
                found.setdefault(id(st), st)
            if obj.grad is not None:
                todo.append(obj.grad)
        elif isinstance(obj, dict):
            todo.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            todo.extend(obj)
        elif isinstance(obj, torch.optim.Optimizer):
            todo.extend((obj.state, obj.param_groups))
        elif type(obj).__module__.startswith("fxpipe."):
            todo.extend(getattr(obj, "__dict__", {}).values())
            todo.extend(getattr(obj, s) for s in getattr(type(obj), "__slots__", ())
                        if hasattr(obj, s))
    return list(found.values())


HELD = "held"
OTHER = "other"


class _Mode(TorchDispatchMode):
    def __init__(self, meter: LiveBytes) -> None:
        super().__init__()
        self.meter = meter

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.meter.see(t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor))
        return out


class LiveBytes:
    """A running count and high-water mark of live tensor bytes on the CPU (see the module
    doc). ``with meter:`` counts while inside; storages stay counted (until freed) between
    entries, so one meter follows a replica across segments."""

    def __init__(self, seed: Iterable[torch.UntypedStorage] = ()) -> None:
        self._lock = threading.RLock()  # weak-reference callbacks may run on another thread
        self._held: dict[int, tuple[weakref.ref, int, str]] = {}
        self.current = 0
        self.peak = 0
        self.phase = HELD
        """What runs now (set by the executor: ``F``, ``B``, ``W``, ``U``, ``comm``): each
        storage is charged to the phase that made it, so the peak can be told apart."""
        self._parts: dict[str, int] = {}
        self.peak_parts: dict[str, int] = {}
        """Bytes alive at the peak by the phase that made them (``held``: at the start)."""
        self._mode: _Mode | None = None
        for st in seed:
            self._add(st)
        self.phase = OTHER

    def _add(self, st: torch.UntypedStorage) -> None:
        key, nbytes = id(st), st.nbytes()
        with self._lock:
            held = self._held.get(key)
            if held is not None and held[0]() is st:
                if held[1] == nbytes:
                    return
                grown = nbytes - held[1]  # resized in place (an out= operator)
                self._held[key] = (held[0], nbytes, held[2])
                phase = held[2]
            else:
                phase, grown = self.phase, nbytes
                self._held[key] = (weakref.ref(st, lambda _, k=key: self._free(k)), nbytes,
                                   phase)
            self.current += grown
            self._parts[phase] = self._parts.get(phase, 0) + grown
            if self.current > self.peak:
                self.peak = self.current
                self.peak_parts = {k: v for k, v in self._parts.items() if v}

    def _free(self, key: int) -> None:
        with self._lock:
            held = self._held.pop(key, None)
            if held is not None:
                self.current -= held[1]
                self._parts[held[2]] -= held[1]

    def see(self, tensors: Iterable[torch.Tensor]) -> None:
        """Count the storages of ``tensors`` (those on the CPU) not counted yet."""
        for t in tensors:
            if t.device.type == "cpu":
                st = _storage(t)
                if st is not None:
                    self._add(st)

    def __enter__(self) -> LiveBytes:
        self._mode = _Mode(self)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        assert self._mode is not None
        self._mode.__exit__(*exc)
        self._mode = None


class PeakMemory:
    """The peak bytes of live tensors on ``device`` while a replica runs, over every ``with``
    block so far: :class:`LiveBytes` on the CPU (seeded with ``held()``, the storages the
    replica holds when measuring starts), ``torch.cuda.max_memory_allocated`` on CUDA."""

    def __init__(self, device: torch.device, held: Any) -> None:
        self.device = device
        self._held = held
        self._meter: LiveBytes | None = None
        self._before = 0  # the peak of the replicas measured before a restart
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)

    @property
    def peak(self) -> int:
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        return max(self._before, self._meter.peak if self._meter is not None else 0)

    @property
    def parts(self) -> dict[str, int]:
        """Bytes at the CPU peak by the phase that made them (:attr:`LiveBytes.peak_parts`);
        empty on CUDA and before measuring."""
        return dict(self._meter.peak_parts) if self._meter is not None else {}

    def at(self, phase: str) -> None:
        """Charge what is made from now on to ``phase`` (CPU; a no-op on CUDA)."""
        if self._meter is not None:
            self._meter.phase = phase

    def restart(self) -> None:
        """The replica was remade (``Trainer.adopt``): find what the new one holds at the next
        entry; the peak so far is kept."""
        self._before, self._meter = self.peak, None

    def __enter__(self) -> PeakMemory:
        if self.device.type != "cuda":
            if self._meter is None:
                self._meter = LiveBytes(self._held())
            self._meter.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._meter is not None and self.device.type != "cuda":
            self._meter.__exit__(*exc)
