"""The measuring half of ``schedule="auto"``: pilot, probe and budget (the rule: :mod:`.auto`).

The pilot trains each candidate on CPU copies of the stages (reference executor); a microbatched
kind cuts each minibatch into :func:`split_for` microbatches, one update and one loss per
minibatch, as pipedream has. The probe times whole-model steps so the budget can price a pilot."""
from __future__ import annotations

import copy
import gc
import time
from typing import Any, Callable, Mapping, Sequence, TYPE_CHECKING

import torch

from fxpipe.errors import FxpipeError

from ..errors import RuntimeConfigError
from ..replica.weighted import WeightedLoss
from ..schedules.kinds import make_schedule
from ..schedules.spec import parse_schedule
from ..schedules.stream import STREAM_KINDS, ScheduleStream
from .auto_data import PilotData
from .loss_split import Cut

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


def shared_copy(stages: Sequence[Any]) -> list[Any]:
    """CPU copies of ``stages`` for the pilot that share the stages' own weights and buffers
    where they already live on the CPU: the replicas the executor builds copy them anyway
    (each :class:`~fxpipe.runtime.replica.stage.StageReplica` owns its tensors and swaps them
    into the module for every call), so a deep copy of them would be a whole model's bytes
    spent on tensors nothing reads. The modules themselves are copied (a call swaps tensors
    into their dicts; a module keeping Python state keeps it on the copy)."""
    memo: dict[int, Any] = {id(t): t for st in stages
                            for t in (*st.gm.parameters(), *st.gm.buffers())
                            if t.device.type == "cpu"}
    copies = copy.deepcopy(list(stages), memo)
    for st in copies:
        if any(t.device.type != "cpu" for t in (*st.gm.parameters(), *st.gm.buffers())):
            st.gm.to("cpu")  # its own copies (the memo shares CPU tensors only)
    return copies


def _on_a_copy(stages: Sequence[Any], replicas: Sequence[int], sched: Any,
               loss_fn: Callable[..., Any], optimizer: Callable[..., Any],
               step_options: StepOptions | None, mitigation: Any = None) -> Any:
    """A reference executor of ``sched`` on CPU copies of ``stages`` (the user's model and its
    optimizer state stay untouched: :func:`shared_copy`)."""
    from ..execution.reference import ReferenceExecutor
    from ..replica.step_options import DEFAULT

    return ReferenceExecutor(shared_copy(stages), replicas, sched, loss_fn, optimizer,
                             mitigation=mitigation, options=step_options or DEFAULT)


def pilot(stages: Sequence[Any], replicas: Sequence[int], loss_fn: Callable[..., Any],
          optimizer: Callable[..., Any], batches: Sequence[Any] | PilotData,
          candidates: Sequence[str], *, lengths: Mapping[str, int] | None = None,
          microbatches: int | None = None, seed: int = 0,
          step_options: StepOptions | None = None,
          lr_scheduler: Callable[[Any], Any] | None = None, cut: Cut | None = None,
          noams: Mapping[str, int | None] | None = None
          ) -> tuple[dict[str, list[float]], dict[str, str]]:
    """Training-loss curves of each of ``candidates`` on ``batches`` (copies of ``stages`` on
    the CPU, reference executor, same dropout seed for all, the trainer's clipping/precision/
    recomputation ``step_options``); a candidate that cannot run this model (e.g. momentum
    correction with an unsupported optimizer) is left out with a note. Every candidate given
    is trained: :func:`share_of` picks a rank's, :func:`merge` adds the kinds that reuse
    flush's curve. ``lengths``: the first minibatches each candidate trains
    (:func:`~.auto.pilot_lengths`: the same seconds for each; None: all of ``batches``).
    ``lr_scheduler``: the trainer's per-update scheduler factory, stepped after every update
    of each stage as in training (a warm-up changes what staleness costs, so a pilot at the
    base rate would measure another run). Microbatched kinds cut each minibatch
    into :func:`split_for` microbatches (docs/design-notes.md): every curve has one loss per
    minibatch. A minibatch too small to cut (an epoch's short last one: a pilot may span
    epochs, where training would end a segment with it) is left out of every candidate's
    pilot, so the curves stay aligned; a minibatch that cannot be cut at all (no batch-sized
    tensor) is an error, not a candidate left out.

    ``batches``: a list (one run over all of it, as before streaming) or a :class:`PilotData`,
    which each candidate reads again in chunks of at most a training segment: the candidate's
    executor persists across its chunks (weights, optimizer state, LR scheduler), each chunk
    a window of one stretch for an asynchronous kind (:mod:`fxpipe.runtime.schedules.stream`)
    and a complete schedule for a flushing one, as the trainer runs successive segments: no
    candidate's numbers depend on the chunks. Only one candidate's copy is alive at a time.
    ``noams``: kind -> the input stage's window the trainer runs it with (None or absent:
    PipeDream's NOAM), so a pilot trains the staleness that training will."""
    data = batches if isinstance(batches, PilotData) else PilotData.held(batches)
    if not isinstance(loss_fn, WeightedLoss):  # cut targets carry their loss scales
        loss_fn = WeightedLoss(loss_fn)
    k_cut = split_for("1f1b-flush", replicas, microbatches)
    if cut is None and k_cut > 1 and any(split_for(c, replicas, microbatches) > 1
                                         for c in candidates):
        from .trainer_cut import find_cut  # called alone (not by a trainer): test it here

        first = data.first(1)
        cut = Cut(*find_cut(stages, loss_fn, first[0])[:2], loss_fn.loss_fn) if first else None
    curves: dict[str, list[float]] = {}
    notes: dict[str, str] = {}
    rng = torch.get_rng_state()
    try:
        for c in candidates:
            torch.manual_seed(seed)
            try:
                mine = data if lengths is None else data.limited(lengths[c])
                curves[c] = _candidate(c, mine, k_cut, stages, replicas, loss_fn, optimizer,
                                       microbatches, step_options, lr_scheduler, cut,
                                       (noams or {}).get(parse_schedule(c).kind))
            except _NotRun as err:
                notes[c] = f"not run: {err.error.message}"
            gc.collect()  # this candidate's copy is gone before the next one's is made
    finally:
        torch.set_rng_state(rng)
    return curves, notes


class _NotRun(Exception):
    """A candidate this model cannot train (its executor refused): a note, not an error."""

    def __init__(self, error: FxpipeError) -> None:
        super().__init__(error.message)
        self.error = error


def _candidate(c: str, data: PilotData, cut: int, stages: Sequence[Any],
               replicas: Sequence[int], loss_fn: Callable[..., Any],
               optimizer: Callable[..., Any], microbatches: int | None,
               step_options: StepOptions | None,
               lr_scheduler: Callable[[Any], Any] | None, how: Cut | None = None,
               noam: int | None = None) -> list[float]:
    """One candidate's curve over ``data``, chunk by chunk on one executor (see :func:`pilot`).
    Cutting errors propagate (the data is at fault, for every candidate alike); the executor's
    refusals become :class:`_NotRun`."""
    spec = parse_schedule(c)
    k = split_for(c, replicas, microbatches)
    losses: dict[int, float] = {}
    ex = None
    stream: ScheduleStream | None = None  # asynchronous kinds: one stretch over the chunks
    for chunk in data.read():
        if k > 1 and how is None:
            raise RuntimeConfigError(f"auto's pilot would cut minibatches for {c!r} without "
                                     "the trainer's cut", "report this as an fxpipe bug")
        sizes = how.sizes(chunk) if how is not None else [0] * len(chunk)
        if cut > 1 and how is not None:  # the same filter on every rank, whatever its share of the candidates
            chunk = [b for b, n in zip(chunk, sizes) if not 0 < n < cut]
            sizes = [n for n in sizes if not 0 < n < cut]
        parts = how.pieces(chunk, sizes, k) if k > 1 and how is not None else chunk
        del chunk  # the chunk's minibatches live in ``parts`` only, until the next read
        if not parts:
            continue
        try:
            mb = None if spec.kind == "pipedream" else k if k > 1 else microbatches
            if stream is None and spec.kind in STREAM_KINDS:
                stream = ScheduleStream(spec.kind, list(replicas), microbatches=mb, noam=noam)
            sched = (stream.window(len(parts)) if stream is not None
                     else make_schedule(spec.kind, list(replicas), len(parts), microbatches=mb))
            if ex is None:
                ex = _on_a_copy(stages, replicas, make_schedule(
                    spec.kind, list(replicas), 0, microbatches=mb,
                    noam=noam if spec.kind in STREAM_KINDS else None),
                                loss_fn, optimizer, step_options, spec.mitigation)
                for w in ex.workers.values():
                    if lr_scheduler is not None and w.stash.optimizer is not None:
                        w.on_update = lr_scheduler(w.stash.optimizer).step
            ex.run_window(sched, parts)  # weights carry over (and minibatches in flight)
        except FxpipeError as err:
            raise _NotRun(err) from err
        base = 0 if stream is not None else len(losses)  # a stream numbers across chunks
        losses.update((base + i, v) for i, v in ex.last_losses.items())
        del parts
    if stream is not None and ex is not None:  # the last minibatches finish, as training's do
        ex.run_window(stream.window(0, final=True), [])
        losses.update(ex.last_losses)
    flat = [losses[i] for i in sorted(losses)]  # one per microbatch, scaled: k per minibatch
    return [sum(flat[i:i + k]) / k for i in range(0, len(flat), k)]


def probe(stages: Sequence[Any], replicas: Sequence[int], loss_fn: Callable[..., Any],
          optimizer: Callable[..., Any], batches: Sequence[Any], *,
          step_options: StepOptions | None = None) -> float:
    """Seconds per minibatch of a whole-model training step in this process, as the pilot takes
    them: pipedream on a copy (CPU, reference executor) over ``batches`` (a few), timed after
    the copy is made; the first step's warm-up is part of it. The copy is gone on return."""
    rng = torch.get_rng_state()
    try:
        ex = _on_a_copy(stages, replicas, make_schedule("pipedream", list(replicas), len(batches)),
                        loss_fn, optimizer, step_options)
        t0 = time.perf_counter()
        ex.run(list(batches))
        return (time.perf_counter() - t0) / len(batches)
    finally:
        ex = None
        gc.collect()
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
