"""The measuring half of ``schedule="auto"`` (the rule: :mod:`fxpipe.runtime.training.auto`): the
pilot, which trains each candidate on copies of the user's stages with the reference executor, the
probe that times a few whole-model steps before a pilot is risked, and the budget that prices
the pilot against the run (:func:`fxpipe.runtime.training.auto.price` applies it).

Every candidate sees the same samples per update: pipedream updates after each minibatch, and a
microbatched kind (flush, gpipe, the zero-bubble kinds, 2bw) cuts each minibatch into
:func:`split_for` microbatches unless the user gave ``microbatches`` (the trainer then trains
exactly so: :func:`fxpipe.runtime.training.data.split_segment`). Its curve is the mean loss of each
minibatch's microbatches, one value per minibatch like pipedream's.
"""
from __future__ import annotations

import copy
import time
from typing import Any, Callable, Sequence, TYPE_CHECKING

import torch

from fxpipe.errors import FxpipeError

from ..schedules.kinds import make_schedule
from ..schedules.spec import parse_schedule
from .data import batch_size_of, split_part

if TYPE_CHECKING:
    from ..replica.step_options import StepOptions


def split_for(schedule: str, replicas: Sequence[int], microbatches: int | None) -> int:
    """Microbatches each of the loader's minibatches is cut into when auto trains ``schedule``:
    the schedule's default m = sum(replicas) for a microbatched kind, so that it updates once
    per minibatch of the loader as pipedream does (and as the ablation's flush did); 1 for
    pipedream, or when the user gave ``microbatches`` (the loader's minibatches are then the
    microbatches, as with a schedule named explicitly)."""
    if parse_schedule(schedule).kind == "pipedream" or microbatches is not None:
        return 1
    return sum(replicas)


def _on_a_copy(stages: Sequence[Any], replicas: Sequence[int], sched: Any,
               loss_fn: Callable[..., Any], optimizer: Callable[..., Any],
               step_options: StepOptions | None, mitigation: Any = None) -> Any:
    """A reference executor of ``sched`` on CPU copies of ``stages`` (the user's model and its
    optimizer state stay untouched)."""
    from ..execution.reference import ReferenceExecutor
    from ..replica.step_options import DEFAULT

    copies = copy.deepcopy(list(stages))
    for st in copies:
        st.gm.to("cpu")
    return ReferenceExecutor(copies, replicas, sched, loss_fn, optimizer, mitigation=mitigation,
                             options=step_options or DEFAULT)


def pilot(stages: Sequence[Any], replicas: Sequence[int], loss_fn: Callable[..., Any],
          optimizer: Callable[..., Any], batches: Sequence[Any], candidates: Sequence[str], *,
          microbatches: int | None = None, seed: int = 0, step_options: StepOptions | None = None,
          lr_scheduler: Callable[[Any], Any] | None = None
          ) -> tuple[dict[str, list[float]], dict[str, str]]:
    """Training-loss curves of each of ``candidates`` on ``batches`` (copies of ``stages`` on
    the CPU, reference executor, same dropout seed for all, the trainer's clipping/precision/
    recomputation ``step_options``); a candidate that cannot run this model (e.g. momentum
    correction with an unsupported optimizer) is left out with a note. Every candidate given
    is trained: :func:`share_of` picks a rank's, :func:`merge` adds the kinds that reuse
    flush's curve. ``lr_scheduler``: the trainer's per-update scheduler factory, stepped after
    every update of each stage as in training (a warm-up changes what staleness costs, so a
    pilot at the base rate would measure another run). Microbatched kinds cut each minibatch
    into :func:`split_for` microbatches (see the module doc): every curve has one loss per
    minibatch. A minibatch too small to cut (an epoch's short last one: a pilot may span
    epochs, where training would end a segment with it) is left out of every candidate's
    pilot, so the curves stay aligned; a minibatch that cannot be cut at all (no batch-sized
    tensor) is an error, not a candidate left out."""
    curves: dict[str, list[float]] = {}
    notes: dict[str, str] = {}
    cut = split_for("1f1b-flush", replicas, microbatches)  # every microbatched kind's cut
    sizes = [batch_size_of(b[0]) for b in batches]
    if cut > 1:  # the same filter on every rank, whatever its share of the candidates
        batches = [b for b, n in zip(batches, sizes) if not 0 < n < cut]
        sizes = [n for n in sizes if not 0 < n < cut]
    pieces: list[Any] | None = None  # cut once, for all the microbatched candidates
    rng = torch.get_rng_state()
    try:
        for c in candidates:
            spec = parse_schedule(c)
            torch.manual_seed(seed)
            k = split_for(c, replicas, microbatches)
            if k > 1 and pieces is None:
                pieces = [mb for b, n in zip(batches, sizes) for mb in split_part(b, k, n)]
            parts = list(pieces) if k > 1 and pieces is not None else list(batches)
            try:
                sched = make_schedule(spec.kind, list(replicas), len(parts),
                                      microbatches=None if spec.kind == "pipedream"
                                      else k if k > 1 else microbatches)
                ex = _on_a_copy(stages, replicas, sched, loss_fn, optimizer, step_options,
                                spec.mitigation)
                for w in ex.workers.values():
                    if lr_scheduler is not None and w.stash.optimizer is not None:
                        w.on_update = lr_scheduler(w.stash.optimizer).step
                losses = ex.run(parts).losses  # one per microbatch: a mean per minibatch
                curves[c] = [sum(losses[i:i + k]) / k for i in range(0, len(losses), k)]
            except FxpipeError as err:
                notes[c] = f"not run: {err.message}"
    finally:
        torch.set_rng_state(rng)
    return curves, notes


def probe(stages: Sequence[Any], replicas: Sequence[int], loss_fn: Callable[..., Any],
          optimizer: Callable[..., Any], batches: Sequence[Any], *,
          step_options: StepOptions | None = None) -> float:
    """Seconds per minibatch of a whole-model training step in this process, as the pilot takes
    them: pipedream on a copy (CPU, reference executor) over ``batches`` (a few), timed after
    the copy is made; the first step's warm-up is part of it."""
    rng = torch.get_rng_state()
    try:
        ex = _on_a_copy(stages, replicas, make_schedule("pipedream", list(replicas), len(batches)),
                        loss_fn, optimizer, step_options)
        t0 = time.perf_counter()
        ex.run(list(batches))
        return (time.perf_counter() - t0) / len(batches)
    finally:
        torch.set_rng_state(rng)


def budget(step_s: float, per_rank: int, pilot_len: int, run_minibatches: int,
           flush_period: float, whole_units: float | None = None) -> tuple[float, float]:
    """(the pilot's predicted cost, the run's predicted training time), in seconds: ``per_rank``
    candidates x ``pilot_len`` whole-model steps of ``step_s`` (:func:`probe`) against
    ``run_minibatches`` x flush's seconds per minibatch. Without a plan, ``flush_period`` is in
    the unit-cost simulation's units and ``whole_units`` is one whole-model step in them (3 per
    stage): the run is then priced at this process's measured speed, perfectly pipelined."""
    run = run_minibatches * (flush_period if whole_units is None
                             else step_s * flush_period / whole_units)
    return per_rank * pilot_len * step_s, run
