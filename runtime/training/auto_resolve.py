"""``schedule="auto"`` on the trainer's side: read the pilot's minibatches, split the pilot over
the ranks, agree on one decision and adopt it (the rule itself:
:mod:`fxpipe.runtime.training.auto`)."""
from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

from ..errors import RuntimeConfigError
from ..schedules.spec import parse_schedule
from .auto import ONE_STAGE, SAFE, AutoOptions, Decision, choose, price, split_for

log = logging.getLogger("fxpipe.runtime.training.auto")


def pilot_length(opts: AutoOptions, total: int | None) -> int:
    """Minibatches the pilot may read: ``pilot``, at most ``max_fraction`` of the run's
    ``total`` minibatches when the loader has a length (a pilot longer than that would cost
    more than it can save; below ``min_pilot`` there is none)."""
    n = opts.pilot if total is None else min(opts.pilot, int(opts.max_fraction * total))
    return max(n, 0)


def resolve(trainer: Any, loader: Any, resume: bool, epochs: int = 1) -> Decision:
    """Choose the schedule of ``trainer`` (built with ``schedule="auto"``) before its first
    epoch and adopt it. Every rank reads the same pilot minibatches and trains its share of the
    candidates (round robin: with as many ranks as trained candidates, the pilot takes one
    candidate's time); the curves are exchanged and rank 0's decision is broadcast. A rank
    with a smaller share waits at the exchange for at most one candidate's pilot (bounded by the
    trainer's ``data_timeout_s``). Resuming takes the schedule the checkpoint was trained with,
    without a pilot."""
    from .data import iter_parts, take

    opts: AutoOptions = trainer.auto_options
    total = epochs * len(loader) if hasattr(loader, "__len__") else None  # the run's minibatches
    decision = None
    if resume and trainer.checkpoint_dir is not None:
        found = _checkpoint_schedule(trainer) if trainer.index == 0 else None
        found = trainer.backend.broadcast(found, "auto: checkpoint schedule")
        if found is not None:
            decision = Decision(found, "the checkpoint being resumed was trained with it")
    if decision is None and len(trainer.stages) == 1:
        decision = Decision("pipedream", ONE_STAGE)
    if decision is None:
        want = pilot_length(opts, total)
        if want >= opts.min_pilot:  # priced out by the profile: the pilot's data is not read
            decision = price(opts, trainer.replicas, len(trainer.stages), want, total,
                             trainer.backend.world, trainer.microbatches)
        if decision is None and 0 < want < opts.min_pilot:
            decision = Decision("1f1b-flush", f"a pilot may read {want} minibatches of this run "
                                f"(at most {opts.max_fraction:.0%} of {epochs} x {len(loader)}), "
                                f"fewer than min_pilot={opts.min_pilot}: {SAFE}")
    if decision is None:
        batches: list[Any] = []
        for epoch in range(want if want >= opts.min_pilot else 0):  # small datasets: more epochs
            got = take(iter_parts(loader, epoch, trainer.seed, need_inputs=True,
                                  need_targets=True), want - len(batches))
            batches += got
            if not got or len(batches) >= want:
                break
        decision = choose(trainer.stages, trainer.replicas, trainer.loss_fn, trainer.optimizer,
                          batches, replace(opts, pilot=min(opts.pilot, max(want, 1))),
                          microbatches=trainer.microbatches, seed=trainer.seed,
                          step_options=trainer.options,
                          share=(trainer.backend.index, trainer.backend.world),
                          gather=trainer.backend.exchange,
                          lr_scheduler=trainer._lr_scheduler if trainer.lr_interval == "step"
                          else None,
                          run_minibatches=total)
        decision = trainer.backend.broadcast(decision, "auto: decision")  # rank 0's
    decision = replace(decision, split=split_for(decision.schedule, trainer.replicas,
                                                 trainer.microbatches))
    trainer.adopt(decision.schedule, decision.split)
    trainer.auto_decision = decision
    log.info("%s", decision.summary())
    if opts.report is not None:
        opts.report(decision)
    return decision


def _checkpoint_schedule(trainer: Any) -> str | None:
    from . import checkpoint as ckpt

    try:
        found = ckpt.find_latest(trainer.checkpoint_dir, None)
    except ckpt.CheckpointError:
        return None
    name = found.manifest.get("schedule")
    try:
        return parse_schedule(name).name if isinstance(name, str) and name != "auto" else None
    except RuntimeConfigError:
        return None
