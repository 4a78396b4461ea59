"""``schedule="auto"`` on the trainer's side: from the loader to one adopted decision.

Prices the pilot in time and memory, streams its minibatches, splits the candidates over the
ranks, agrees on one decision and adopts it (the rule itself: :mod:`.auto`)."""
from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ..errors import RuntimeConfigError
from ..schedules.spec import parse_schedule
from ..schedules.stream import STREAM_KINDS
from .auto import (SAFE, STRETCH, AutoOptions, Decision, choose, periods,
                   one_stage, pilot_lengths, price, share_of, split_for, trained)
from .auto_data import PilotData, loader_length
from .auto_memory import (available_bytes, optimizer_state_factor, rank_estimate,
                          training_bytes)
from .auto_look import plan_look
from .auto_pipeline import pilot_step, pipeline_decision
from .host import TrainingHost
from .loss_split import Cut

log = logging.getLogger("fxpipe.runtime.training.auto")


def pilot_length(opts: AutoOptions, total: int | None) -> int:
    """Minibatches the baseline's pilot reads: ``pilot``, at most ``max_fraction`` of the run's
    ``total`` minibatches when the loader has a length (a pilot longer than that would cost
    more than it can save; below ``min_pilot`` there is none)."""
    n = opts.pilot if total is None else min(opts.pilot, int(opts.max_fraction * total))
    return max(n, 0)


def pilot_cap(opts: AutoOptions, total: int | None, want: int) -> int:
    """The most minibatches any candidate's pilot reads: a faster candidate trains more of
    them in the baseline's seconds (:func:`~.auto.pilot_lengths`), at most :data:`~.auto.STRETCH`
    times the baseline's ``want`` and ``max_fraction`` of the run."""
    cap = STRETCH * want
    return cap if total is None else max(want, min(cap, int(opts.max_fraction * total)))


@dataclass(frozen=True)
class Resolved:
    """What :func:`resolve` decided: the adopted ``decision`` (``fit`` starts at its
    ``continued`` minibatch of the first epoch), the epoch's accumulators there (``acc``: loss
    and weight, samples and seconds), and the first-epoch position at which to look again
    (:mod:`.auto_look`; None: no second look)."""

    decision: Decision
    acc: tuple[float, ...] = (0.0, 0.0, 0.0, 0.0)
    look_at: int | None = None


def resolve(trainer: TrainingHost, loader: Any, resume: bool, epochs: int = 1) -> Resolved:
    """Choose the schedule of ``trainer`` (built with ``schedule="auto"``) before its first
    epoch and adopt it. Every rank reads the same pilot minibatches and trains its share of the
    candidates (round robin: with as many ranks as trained candidates, the pilot takes one
    candidate's time); the curves are exchanged and rank 0's decision is broadcast. A rank
    with a smaller share waits at the exchange for at most one candidate's pilot (bounded by the
    trainer's ``data_timeout_s``). Resuming takes the schedule the checkpoint was trained with,
    without a pilot. Before anything is read or copied, the pilot is priced in time (by the
    plan's profile) and in memory (:func:`pilot_memory`); its minibatches are then streamed
    a training segment at a time (:class:`~.auto_data.PilotData`, ``trainer.segment``)."""
    opts: AutoOptions = trainer.auto_options
    length = loader_length(loader)
    total = epochs * length if length is not None else None  # the run's minibatches
    decision = None
    memory = ""
    if resume and trainer.checkpoint_dir is not None:
        found = checkpoint_schedule(trainer.checkpoint_dir) if trainer.index == 0 else None
        found = trainer.backend.broadcast(found, "auto: checkpoint schedule")
        if found is not None:
            decision = Decision(found, "the checkpoint being resumed was trained with it")
    if decision is None and len(trainer.stages) == 1:
        decision = one_stage(trainer.replicas)
    if decision is None and isinstance(loader, Iterator):  # a generator: one pass, no pilot
        decision = Decision("1f1b-flush", f"no pilot: the loader is an iterator "
                            f"({type(loader).__name__}), which can be read once, and a pilot "
                            f"reads the first minibatches again for every candidate (pass a "
                            f"list or a DataLoader to let auto pilot): {SAFE}")
    on_pipeline = opts.where == "pipeline"
    if decision is None:
        want = pilot_length(opts, total)
        cap = pilot_cap(opts, total, want)
        if on_pipeline:  # within the first epoch, whole updates of every candidate
            step = pilot_step(trainer.replicas, trainer.microbatches)
            want = min(want, length) if length is not None else want
            want -= want % step
            cap = min(cap, length) if length is not None else cap
            cap = max(want, cap - cap % step)
        if want >= opts.min_pilot:  # priced out by the profile: the pilot's data is not read
            decision = (price_pipeline(opts, trainer.replicas, trainer.microbatches, want, total,
                                       cap) if on_pipeline else
                        price_copies(opts, trainer.replicas, trainer.microbatches,
                                     len(trainer.stages), trainer.backend.world, want, total,
                                     cap))
        if decision is None and 0 < want < opts.min_pilot:
            decision = Decision("1f1b-flush", f"a pilot may read {want} minibatches of this run "
                                f"(at most {opts.max_fraction:.0%} of {epochs} x {length}), "
                                f"fewer than min_pilot={opts.min_pilot}: {SAFE}")
        if decision is None and want >= opts.min_pilot and opts.pilot > 0 and not on_pipeline:
            decision, memory = pilot_memory(trainer, opts)
    if decision is None and on_pipeline and opts.pilot > 0 and want >= opts.min_pilot:
        decision, acc = pipeline_decision(trainer, loader, min(opts.pilot, want), opts, cap)
        look_at, note = plan_look(opts, decision, length, total,
                                  pilot_step(trainer.replicas, trainer.microbatches))
        decision = replace(decision, later=(note,)) if note else decision
        log.info("%s", decision.summary())
        if opts.report is not None:
            opts.report(decision)
        return Resolved(decision, tuple(acc), look_at)  # adopted, its pilot's end state loaded
    if decision is None:
        data = PilotData(loader, cap, chunk=trainer.segment, seed=trainer.seed,
                         expects=trainer.model_args)

        def cut(first: list[Any]) -> Cut | None:
            """The trainer's cut and loss rule, tested once (trainer_cut), for the pilot."""
            trainer._check_first(first[0] if first else None)
            return (Cut(trainer.cut_spec, trainer.loss_rule, trainer.user_loss_fn)
                    if trainer.cut_spec else None)

        decision = choose(trainer.stages, trainer.replicas, trainer.loss_fn, trainer.optimizer,
                          data, replace(opts, pilot=min(opts.pilot, max(want, 1))),
                          microbatches=trainer.microbatches, seed=trainer.seed,
                          step_options=trainer.options,
                          share=(trainer.backend.index, trainer.backend.world),
                          gather=trainer.backend.exchange,
                          lr_scheduler=trainer._lr_scheduler if trainer.lr_interval == "step"
                          else None,
                          run_minibatches=total, cut=cut,
                          noams={k: trainer._noam(k) for k in STREAM_KINDS})
        decision = replace(decision, memory=memory) if decision.rows else decision
        decision = trainer.backend.broadcast(decision, "auto: decision")  # rank 0's
    decision = replace(decision, split=split_for(decision.schedule, trainer.replicas,
                                                 trainer.microbatches))
    trainer.adopt(decision.schedule, decision.split)
    log.info("%s", decision.summary())
    if opts.report is not None:
        opts.report(decision)
    return Resolved(decision)


def price_pipeline(opts: AutoOptions, replicas: Sequence[int], microbatches: int | None,
                   pilot_len: int, run_minibatches: int | None, cap: int | None = None
                   ) -> Decision | None:
    """``1f1b-flush`` when a pilot on the pipeline would cost more than ``opts.max_cost`` of the
    run's predicted training time, else None. Its cost is every trained candidate's pilot
    (:func:`~.auto.pilot_lengths`: ``pilot_len`` minibatches of flush's seconds, at most ``cap``
    minibatches) at its simulated seconds per minibatch, less the cheapest one's (the winner's
    pilot is training the run does not repeat); the run is its minibatches at flush's (the same
    units with or without a plan)."""
    if not run_minibatches or opts.max_cost is None or pilot_len <= 0:
        return None
    names = trained(opts.candidates)
    per, source = periods(names, replicas, plan=opts.plan, profile=opts.profile,
                          microbatches=microbatches)
    lengths = pilot_lengths(names, per, pilot_len, cap or pilot_len,
                            pilot_step(replicas, microbatches))
    each = [lengths[c] * per[c] for c in names]
    cost = sum(each) - min(each)
    run = run_minibatches * per["1f1b-flush"]
    if cost <= opts.max_cost * run:
        return None
    return Decision("1f1b-flush", f"a pilot on the pipeline would cost about {cost / run:.0%} "
                    f"of the run's predicted training ({len(names)} candidates x {pilot_len} "
                    f"minibatches of 1f1b-flush's seconds, seconds per minibatch from {source}), "
                    "more than "
                    f"max_cost={opts.max_cost:.0%}: {SAFE}")


def price_copies(opts: AutoOptions, replicas: Sequence[int], microbatches: int | None,
                 stages: int, world: int, pilot_len: int, run_minibatches: int | None,
                 cap: int) -> Decision | None:
    """:func:`~.auto.price` from the plan's profile, before the pilot's data is read (None
    without a plan: only a probe prices a pilot then), for a pipeline of ``stages`` stages with
    ``replicas`` and ``world`` ranks."""
    if opts.plan is None or not run_minibatches or opts.max_cost is None:
        return None
    per, _ = periods(opts.candidates, replicas, plan=opts.plan, profile=opts.profile,
                     microbatches=microbatches)
    lengths = pilot_lengths(trained(opts.candidates), per, pilot_len, cap)
    return price(opts, replicas, stages, lengths, run_minibatches, world, microbatches, per=per)


def pilot_memory(trainer: TrainingHost, opts: AutoOptions) -> tuple[Decision | None, str]:
    """(``1f1b-flush`` where some rank's share of the pilot would not fit, else None; a note of
    the figures). Every rank prices its own share (:mod:`.auto_memory`: the largest copy it
    would make) against what it has (less ``opts.memory_margin``) and against what its training
    holds (times ``opts.max_memory``); the ranks exchange their figures, so that all of them
    make the same call (one that skipped the pilot while another ran it would meet it at a
    different collective). What is skipped and why is logged and becomes the reason."""
    from fxpipe.units import format_bytes as fmt

    if opts.memory_margin is None and opts.max_memory is None:
        return None, ""
    backend = trainer.backend
    mine = share_of(opts.candidates, backend.index, backend.world)
    factor = optimizer_state_factor(trainer.optimizer, trainer.stages)
    need, what = rank_estimate(mine, trainer.stages, trainer.replicas, trainer.optimizer,
                               opts.profile, factor=factor)
    have = (opts.available_bytes or available_bytes)() if opts.memory_margin is not None else None
    held = training_bytes(trainer.stages, [s for s, _ in trainer.local], factor)
    figures = backend.exchange((need, have, held, what), "auto: pilot memory")
    room = None if opts.memory_margin is None else 1.0 - opts.memory_margin
    for i, (n, h, t, w) in enumerate(figures):
        if room is not None and h is not None and n > room * h:
            why = f"more than {room:.0%} of the {fmt(h)} available to it"
        elif opts.max_memory is not None and n > opts.max_memory * t:
            why = (f"more than max_memory={opts.max_memory:.0%} of the {fmt(t)} its training "
                   "holds")
        else:
            continue
        reason = (f"no pilot: its copies of the model would take about {fmt(n)} on rank {i} "
                  f"({w}), {why}: {SAFE}")
        log.warning("auto: %s", reason)
        return Decision("1f1b-flush", reason), ""
    known = [h for _, h, _, _ in figures if h is not None]
    note = (f"the largest pilot copy on a rank about {fmt(max(n for n, _, _, _ in figures))}, "
            f"training at least {fmt(min(t for _, _, t, _ in figures))} a rank"
            + (f", at least {fmt(min(known))} available on each" if known
               else "; available memory unknown, not checked"))
    log.info("auto: pilot memory: %s", note)
    return None, note


def checkpoint_schedule(directory: str | Path) -> str | None:
    """The schedule the latest checkpoint in ``directory`` was trained with (None: no readable
    checkpoint, or none recorded)."""
    from . import checkpoint as ckpt

    try:
        found = ckpt.find_latest(directory, None)
    except ckpt.CheckpointError:
        return None
    name = found.manifest.get("schedule")
    try:
        return parse_schedule(name).name if isinstance(name, str) and name != "auto" else None
    except RuntimeConfigError:
        return None
