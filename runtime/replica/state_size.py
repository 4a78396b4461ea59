"""Bytes a replica keeps per byte of its parameters, as the run keeps them: the planner's ``opt``.

:func:`state_factor` measures ``opt`` of ``P (2 + opt)`` on tiny stand-ins of the parameters;
:func:`step_temporaries` what one optimizer step allocates and frees again.
"""
from __future__ import annotations

import contextlib
import logging
import math
from typing import Callable, Iterator, Sequence

import torch

from .master import LOW_PRECISION, MASTER_DTYPE
from .mitigation import bind_optimizer

log = logging.getLogger(__name__)

FALLBACK_STATE = 2.0
"""Optimizer state per element byte when the factory will not run on stand-ins: Adam's."""


def _default_optimizer(params: list[torch.Tensor]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.01, momentum=0.9)


def state_per_byte(optimizer: Callable[..., torch.optim.Optimizer],
                   shapes: Sequence[tuple[int, torch.dtype]], stage: int = 0
                   ) -> tuple[float | None, Exception | None]:
    """Optimizer state bytes per byte of the tensors it steps (per-element state only: a step
    counter is negligible next to a real parameter), measured by building the factory (as
    stage ``stage`` builds it) on tiny tensors of these (rank, dtype) and stepping it once;
    ``(None, error)`` when the factory will not run on them."""
    tiny = [torch.zeros((math.ceil(64 ** (1 / nd)),) * nd if nd else (), dtype=dt,
                        requires_grad=True) for nd, dt in shapes]
    try:
        opt = bind_optimizer(optimizer, stage, 0)(tiny)  # a factory taking stage=/delay=
        for t in tiny:
            t.grad = torch.ones_like(t)
        opt.step()
    except Exception as err:  # noqa: BLE001 - any factory: an estimate is not worth failing for
        return None, err
    state = sum(v.numel() * v.element_size() for t in tiny for v in opt.state.get(t, {}).values()
                if isinstance(v, torch.Tensor) and v.numel() == t.numel())
    return state / max(sum(t.numel() * t.element_size() for t in tiny), 1), None


def step_temporaries(optimizer: Callable[..., torch.optim.Optimizer],
                     shapes: Sequence[tuple[int, torch.dtype]], stage: int = 0,
                     foreach_default: bool = False) -> tuple[float, float] | None:
    """What an optimizer step allocates and frees again, as ``(per_byte, per_largest)``: its
    peak temporaries are ``per_byte * P + per_largest * L`` for parameters of P bytes whose
    largest tensor has L. Why two terms: a foreach step (torch's default on CUDA) makes its
    temporaries for every tensor at once (AdamW's square roots of the second moments: about P),
    the per-tensor loop (the default on the CPU) for one tensor at a time (a few times the
    largest). A replica's peak can fall inside its update, where these sit beside everything
    it holds (issue 26: VGG-mini's last stage, whose classifier dominates its parameters).

    Measured like :func:`state_per_byte` on tiny stand-ins (same ranks and dtypes), stepped
    once to make their state and then once counted by :class:`~.live_bytes.LiveBytes`, twice:
    all of one size, and with the first 8 times larger (two equations, two unknowns). None when
    the factory will not run on them. ``foreach_default``: measure the path torch takes by
    default for CUDA tensors (foreach) rather than the CPU's, for a run planned for a GPU from
    this machine (an optimizer that names ``foreach=`` or ``fused=`` keeps its own)."""
    from .live_bytes import LiveBytes, reachable_storages  # only when measuring

    def peak(scale_first: int) -> tuple[float, float, float]:
        tiny = [torch.zeros(((math.ceil(64 ** (1 / nd)),) * nd if nd else ()), dtype=dt)
                for nd, dt in shapes]
        if tiny and tiny[0].dim():
            tiny[0] = torch.zeros((tiny[0].shape[0] * scale_first, *tiny[0].shape[1:]),
                                  dtype=tiny[0].dtype)
        for t in tiny:
            t.requires_grad_(True)
        opt = bind_optimizer(optimizer, stage, 0)(tiny)
        for t in tiny:
            t.grad = torch.ones_like(t)
        opt.step()
        # what exists before (weights, gradients, state) is held: in-place results not counted
        meter = LiveBytes(reachable_storages([tiny, opt]))
        held = meter.current
        with meter:
            opt.step()
        sizes = [t.numel() * t.element_size() for t in tiny]
        return meter.peak - held, float(sum(sizes)), float(max(sizes))

    if not shapes or not any(nd for nd, _ in shapes):
        return None
    try:
        with _foreach_everywhere(foreach_default):
            (p1, t1, l1), (p2, t2, l2) = peak(1), peak(8)
    except Exception:  # noqa: BLE001 - any factory: an estimate is not worth failing for
        return None
    det = t1 * l2 - t2 * l1
    if det == 0:
        return None
    per_byte = (p1 * l2 - p2 * l1) / det
    per_largest = (t1 * p2 - t2 * p1) / det
    return max(per_byte, 0.0), max(per_largest, 0.0)


@contextlib.contextmanager
def _foreach_everywhere(on: bool) -> Iterator[None]:
    """Within: torch's optimizers take their foreach path by default for tensors of any device
    (as they do for CUDA ones), through the private device list their default consults."""
    import torch.optim.optimizer as base

    old = getattr(base, "_get_foreach_kernels_supported_devices", None)
    if not on or old is None:
        yield
        return
    base._get_foreach_kernels_supported_devices = lambda: [*old(), "cpu"]  # type: ignore
    try:
        yield
    finally:
        base._get_foreach_kernels_supported_devices = old  # type: ignore


def stepped_dtypes(params: Sequence[torch.Tensor],
                   master_weights: bool | None = None) -> list[torch.dtype]:
    """The dtype each of ``params`` is stepped (and its gradient summed) in: float32 for a
    float16/bfloat16 parameter where the run keeps float32 masters (``master_weights``; None:
    the runtime's default, masters wherever a parameter is in low precision), else its own."""
    masters = (any(p.dtype in LOW_PRECISION for p in params) if master_weights is None
               else master_weights)
    return [MASTER_DTYPE if masters and p.dtype in LOW_PRECISION else p.dtype for p in params]


def _size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def temporaries_for(params: Sequence[torch.Tensor],
                    optimizer: Callable[..., torch.optim.Optimizer] | None,
                    device: str | None = None,
                    master_weights: bool | None = None) -> tuple[float, float]:
    """:func:`step_temporaries` for these parameters, per byte of them (stand-ins of their
    ranks, in the dtype the optimizer steps: float32 masters of float16/bfloat16 parameters
    where ``master_weights`` says so, None: the runtime's default, as :func:`state_factor`;
    a bfloat16 model stepped on float32 masters makes float32 temporaries, twice its own bytes);
    ``optimizer`` None: SGD with momentum; on torch's default path for CUDA tensors where the
    run is for a GPU (``device``, a cluster's estimated device such as "H100", or parameters
    on CUDA); none where the factory will not run on stand-ins."""
    params = [p for p in params if p.requires_grad]
    gpu = (device is not None and "cpu" not in device.lower()) or any(p.is_cuda for p in params)
    stepped = stepped_dtypes(params, master_weights)
    got = step_temporaries(optimizer or _default_optimizer,
                           [(p.dim(), dt) for p, dt in zip(params, stepped)], foreach_default=gpu)
    if got is None:
        return (0.0, 0.0)
    # the fit is per stepped byte; P and L are priced in the parameters' own bytes
    size = sum(p.numel() * p.element_size() for p in params)
    stepped_size = sum(p.numel() * _size(dt) for p, dt in zip(params, stepped))
    big = max(range(len(params)), key=lambda i: params[i].numel() * params[i].element_size())
    widen = stepped_size / size if size else 1.0
    widen_largest = _size(stepped[big]) / params[big].element_size()
    return got[0] * widen, got[1] * widen_largest


def gradient_width(params: Sequence[torch.Tensor], master_weights: bool | None = None) -> float:
    """A gradient's bytes per byte of its parameter over these trainable ``params``, as the run
    sums them: in float32 for float16/bfloat16 parameters stepped on float32 masters
    (``master_weights`` None: the runtime's default), else in the parameter's own dtype."""
    params = [p for p in params if p.requires_grad]
    own = sum(p.numel() * p.element_size() for p in params)
    wide = sum(p.numel() * _size(dt)
               for p, dt in zip(params, stepped_dtypes(params, master_weights)))
    return wide / own if own else 1.0


def state_factor(params: Sequence[torch.Tensor],
                 optimizer: Callable[..., torch.optim.Optimizer] | None = None,
                 master_weights: bool | None = None) -> float:
    """``opt`` of the planner's ``P (2 + opt)`` for these trainable ``params`` trained with
    ``optimizer`` (default: SGD with momentum) and ``master_weights`` (None: float32 masters
    for float16/bfloat16 parameters, the runtime's default; False: none): state bytes beyond
    weights and one same-dtype gradient, per parameter byte, over all of them."""
    return state_parts(params, optimizer, master_weights)[0]


def state_parts(params: Sequence[torch.Tensor],
                optimizer: Callable[..., torch.optim.Optimizer] | None = None,
                master_weights: bool | None = None) -> tuple[float, float]:
    """(:func:`state_factor`, the part of it that is the optimizer's own state): what a
    sharded replica group splits among its replicas (ZeRO-1 steps each replica's share of the
    parameters, so the moments are split; the float32 masters and the gradients are not)."""
    params = [p for p in params if p.requires_grad]
    if not params:
        return 0.0, 0.0
    optimizer = optimizer or _default_optimizer
    stepped = [(p.dim(), dt) for p, dt in zip(params, stepped_dtypes(params, master_weights))]
    per_byte, err = state_per_byte(optimizer, stepped)
    if per_byte is None:
        log.warning("optimizer state not measured (%s); assuming %s bytes per parameter byte",
                    err, FALLBACK_STATE)
        per_byte = FALLBACK_STATE
    total = own = moments = 0.0
    for p, (_, dt) in zip(params, stepped):
        n, size = p.numel(), p.element_size()
        stepped_size = _size(dt)
        own += n * size
        # weight + gradient (in the stepped dtype) + master (if any) + optimizer state
        total += n * (size + stepped_size + (stepped_size if dt != p.dtype else 0)
                      + per_byte * stepped_size)
        moments += n * per_byte * stepped_size
    return total / own - 2.0, moments / own
