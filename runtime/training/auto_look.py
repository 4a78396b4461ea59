"""A second look after ``schedule="auto"`` picks an asynchronous schedule on the pipeline.

Once the pick has trained ``look_again`` times its pilot more, it races ``1f1b-flush`` again from
the same drained state (:func:`carry_into`); :func:`~.auto.decide` keeps it or falls back to flush.
Why: a pilot sees the start of training only, and staleness can cost more later."""
from __future__ import annotations

import functools
import logging
import math
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

from .auto import (SYNCHRONOUS, AutoOptions, Decision, Level, can_stop, decide,
                   pilot_lengths, trained)
from .auto_pilot import split_for
from .auto_pipeline import load_state, pilot_step, run_pilot, save_state
from .host import TrainingHost

log = logging.getLogger("fxpipe.runtime.training.auto")

BASELINE = "1f1b-flush"


def plan_look(opts: AutoOptions, decision: Decision, length: int | None,
              run_minibatches: int | None, step: int) -> tuple[int | None, str]:
    """(the epoch position at which to look again, or None; a note for the decision). Looks
    only after an asynchronous pick on the pipeline, within the first epoch of a loader with a
    length (at a multiple of ``step``, :func:`~.auto_pipeline.pilot_step`), and where the
    pilot's losers plus one race of flush's pilot cost at most ``max_cost`` of the run (flush's
    seconds per minibatch, as :func:`~.auto_resolve.price_pipeline` prices the pilot)."""
    k = opts.look_again
    if not k or decision.where != "pipeline" or decision.schedule in SYNCHRONOUS:
        return None, ""
    P = decision.pilot_minibatches
    at = decision.continued + math.ceil(k * decision.continued / step) * step
    if length is None or at + 2 * P > length:
        return None, (f"no second look: the first epoch has no room for a race of {2 * P} "
                      f"minibatches after minibatch {at}")
    rows = {r.schedule: r for r in decision.rows if math.isfinite(r.period_s)}
    if opts.max_cost is not None and run_minibatches and BASELINE in rows:
        each = [rows[c].piloted * rows[c].period_s for c in trained(opts.candidates)
                if c in rows and rows[c].piloted]  # gpipe, zb-*: flush's curve, not trained
        race = P * rows[BASELINE].period_s
        run = run_minibatches * rows[BASELINE].period_s
        if sum(each) - min(each) + race > opts.max_cost * run:
            return None, (f"no second look: the pilot and a race of {P} minibatches of "
                          f"{BASELINE} would cost more than max_cost={opts.max_cost:.0%} of the "
                          "run's predicted training")
    return at, f"looks again at minibatch {at} of the first epoch"


def carry_into(trainer: TrainingHost, path: Path) -> None:
    """Load the state the pick saved at ``path`` into flush's freshly adopted replicas: its
    weights, buffers, the optimizer's per-parameter state (momenta, moments) and the LR
    scheduler's position, but flush's own hyperparameters. A mitigation gives the pick another
    optimizer configuration (lr_scale a smaller lr, nesterov a larger momentum with Nesterov's
    form, NAdam for AdamW), and ``load_state_dict`` would carry it over with the state; flush
    trains the user's recipe. The lr is flush's own initial one times the factor the pick's
    scheduler had reached (its current lr over its initial one)."""
    own: dict[Any, list[dict[str, Any]]] = {}
    bases: dict[Any, list[float]] = {}
    for rank, w in trainer.local.items():
        opt = w.stash.optimizer
        if opt is not None:
            own[rank] = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
        sch = trainer.schedulers.get(rank)
        if sch is not None and hasattr(sch, "base_lrs"):
            bases[rank] = list(sch.base_lrs)
    load_state(trainer, path)
    for rank, groups in own.items():
        opt = trainer.local[rank].stash.optimizer
        if len(opt.param_groups) != len(groups):
            raise RuntimeError(f"auto's second look: the pick's optimizer has "
                               f"{len(opt.param_groups)} parameter groups on stage {rank[0]}, "
                               f"flush's {len(groups)}: an fxpipe bug")
        for g, mine in zip(opt.param_groups, groups):
            factor = g["lr"] / g["initial_lr"] if g.get("initial_lr") else None
            params = g["params"]
            g.clear()
            g.update(mine)
            g["params"] = params
            if factor is not None and mine.get("initial_lr"):
                g["lr"] = mine["initial_lr"] * factor
    for rank, b in bases.items():
        trainer.schedulers[rank].base_lrs = b


def look_again(trainer: TrainingHost, loader: Any, epoch: int, pos: int, opts: AutoOptions,
               d: Decision) -> tuple[int, list[float], Decision]:
    """Race the running asynchronous schedule (picked by decision ``d``) against flush from
    epoch position ``pos`` (see docs/design-notes.md); returns where ``fit`` continues, the
    epoch's accumulators there, and ``d`` with the outcome noted. Every rank runs it."""
    winner = trainer.schedule_name
    per = {r.schedule: r.period_s for r in d.rows if r.schedule in (BASELINE, winner)}
    P = d.pilot_minibatches
    lengths = pilot_lengths([BASELINE, winner], per, P, 2 * P,
                            pilot_step(trainer.replicas, trainer.microbatches))
    trainer.drain(epoch)
    acc = list(trainer._acc)
    split = trainer.split
    with tempfile.TemporaryDirectory(prefix="fxpipe-auto-") as tmp:
        folder = Path(tmp)
        here = save_state(trainer, folder, "here")
        trainer.adopt(BASELINE, split_for(BASELINE, trainer.replicas, trainer.microbatches))
        carry_into(trainer, here)
        flush, _, flush_end = run_pilot(trainer, loader, lengths[BASELINE],
                                        f"auto look-again {BASELINE}", epoch=epoch, start=pos,
                                        acc=acc)
        flush_state = save_state(trainer, folder, BASELINE)
        trainer.adopt(winner, split)
        load_state(trainer, here)
        level = Level.of(flush)
        stop = functools.partial(can_stop, period=per[winner], level=level,
                                 bound_s=level.minibatches(flush) * per[BASELINE])
        mine, _, end = run_pilot(trainer, loader, lengths[winner], f"auto look-again {winner}",
                                 stop, epoch=epoch, start=pos, acc=acc,
                                 expect=flush_end[0] - pos)
        again = decide({BASELINE: flush, winner: mine}, per, margin=opts.margin)
        if again.schedule != winner:
            trainer.adopt(BASELINE, split_for(BASELINE, trainer.replicas, trainer.microbatches))
            load_state(trainer, flush_state)
            end = flush_end
    rows = {r.schedule: r for r in again.rows}
    note = (f"looked again at minibatch {pos}: {winner} "
            + ("kept" if again.schedule == winner else f"fell back to {BASELINE}")
            + f" ({winner} {rows[winner].time_s:.4g} s to {BASELINE}'s level after {len(flush)} "
            f"minibatches, {BASELINE} {rows[BASELINE].time_s:.4g} s); continues at "
            f"minibatch {end[0]}")
    log.info("auto: %s", note)
    d = replace(d, later=d.later + (note,))
    if opts.report is not None:
        opts.report(d)
    return end[0], end[1], d
