"""``schedule="auto"``: pick the schedule with the least predicted time to a target loss.

Predicted time = (minibatches to the pilot's loss level, :mod:`.auto_pilot`) x (seconds per
minibatch from the plan simulator, or unit costs without a plan). gpipe and the zero-bubble
kinds reuse flush's curve; an asynchronous pick must beat the best synchronous one by ``margin``."""
from __future__ import annotations

import math
import time
from dataclasses import MISSING, dataclass, fields, replace
from typing import Any, Callable, Iterable, Mapping, Sequence, TYPE_CHECKING

from ..errors import RuntimeConfigError
from ..schedules.kinds import make_schedule
from ..schedules.spec import parse_schedule
from .auto_data import PilotData
from .auto_level import (STRETCH, Level, can_stop, equal_time, pilot_lengths, smooth,
                         to_level)
from .auto_pilot import budget, pilot, probe, split_for

if TYPE_CHECKING:
    from ..replica.step_options import StepOptions


SYNCHRONOUS = ("1f1b-flush", "gpipe", "zb-h1", "zb-h2")
SAME_AS_FLUSH = ("gpipe", "zb-h1", "zb-h2")  # minibatch SGD, flush's arithmetic: its pilot curve
SAFE = ("the synchronous schedule is never statistically worse, so it is the safe choice "
        "without a measurement")
ONE_STAGE = ("one worker: no pipeline, nothing stale, so a pilot has nothing to measure; it "
             "trains as plain PyTorch does, an update after every minibatch")
DATA_PARALLEL = ("one stage on {r} workers (data parallelism): no schedule makes its weights "
                 "stale, so a pilot has nothing to measure; each minibatch is cut into one share "
                 "per replica and the replicas' gradients are combined by their shares, one "
                 "update per minibatch")


def one_stage(replicas: Sequence[int]) -> Decision:
    """auto's pick for a one-stage plan: ``1f1b-flush`` with each minibatch cut into one share
    per replica, a synchronous step on the whole minibatch (pipedream's replicas would each
    take whole minibatches: twice the batch, half the updates); on one worker that is plain
    steps, a minibatch an update, the schedule the plan was priced for."""
    r = sum(replicas)
    return Decision("1f1b-flush", ONE_STAGE if r == 1 else DATA_PARALLEL.format(r=r))
DEFAULT_CANDIDATES = ("1f1b-flush", "gpipe", "zb-h1", "zb-h2", "pipedream", "pipedream+lr_scale",
                      "pipedream+predict+momentum")
"""Trained in the pilot: flush (whose curve gpipe and the zero-bubble kinds share), pipedream,
and the two mitigations that came out best in bench/ablation's goal table (lr_scale,
predict+momentum). Each trained candidate costs one pilot of whole-model steps, so the default
list is short; pass ``auto_options={"candidates": (...)}`` for others (2bw, +dc, ...)."""


WHERE = ("copies", "pipeline")
"""Where the pilot trains: copies of the whole model on the reference executor in every rank's
process (:mod:`.auto_pilot`), or the job's own pipeline, the winner continuing from its pilot
(:mod:`.auto_pipeline`)."""


@dataclass(frozen=True)
class AutoOptions:
    """How ``auto`` decides (docs/design-notes.md). ``max_cost``: the most the pilot may cost, as
    a fraction of the run's predicted training time (``None``: no limit); ``plan``/``profile``:
    the compiled model's (``CompiledModel.trainer`` passes them); ``report``: called with the
    :class:`Decision`. Memory (:mod:`~fxpipe.runtime.training.auto_memory`): the pilot's copies
    must fit in a rank's available memory less ``memory_margin`` of it, and add at most
    ``max_memory`` to what the rank's training holds (``None``: that check is off);
    ``available_bytes``: what a rank may use (default
    :func:`~fxpipe.runtime.training.auto_memory.available_bytes`; None from it: unknown).
    ``where``: :data:`WHERE` ("pipeline": no copies, so the memory checks do not apply).
    ``look_again``: on the pipeline, after an asynchronous pick has trained this many times its
    pilot's minibatches beyond the pilot, race it against flush once more from there and fall
    back to flush if it has stalled (:mod:`~fxpipe.runtime.training.auto_look`; 0: never).
    ``temporaries``: the optimizer step's temporary bytes (from ``CompiledModel.trainer``), held
    against the plan's memory cap with the rest where the trainer sizes its window
    (``noam``)."""

    pilot: int = 200
    min_pilot: int = 40
    max_fraction: float = 0.5
    max_cost: float | None = 0.25
    candidates: tuple[str, ...] = DEFAULT_CANDIDATES
    margin: float = 0.05
    plan: Any = None
    profile: Any = None
    report: Callable[[Decision], None] | None = None
    memory_margin: float | None = 0.25
    max_memory: float | None = 0.2
    available_bytes: Callable[[], int | None] | None = None
    where: str = "copies"
    look_again: float = 2.0
    temporaries: tuple[float, float] = (0.0, 0.0)

    @staticmethod
    def given(value: AutoOptions | Mapping[str, Any] | None) -> dict[str, Any]:
        """The options ``value`` sets, as a mapping (of an :class:`AutoOptions`, the fields
        that differ from their defaults), for merging over what ``compiled.trainer`` fills in."""
        if isinstance(value, AutoOptions):
            return {f.name: getattr(value, f.name) for f in fields(value)
                    if getattr(value, f.name) != (f.default if f.default is not MISSING
                                                  else f.default_factory())}  # type: ignore[misc]
        return dict(value or {})

    @classmethod
    def make(cls, value: AutoOptions | Mapping[str, Any] | None) -> AutoOptions:
        if value is None or isinstance(value, AutoOptions):
            return value or cls()
        bad = set(value) - {f for f in cls.__dataclass_fields__}
        if bad:
            raise RuntimeConfigError(f"unknown auto option {sorted(bad)[0]!r}",
                                     f"use any of {sorted(cls.__dataclass_fields__)}")
        opts = cls(**{**value, "candidates": tuple(value.get("candidates", DEFAULT_CANDIDATES))})
        for c in opts.candidates:
            parse_schedule(c)
        if not opts.look_again >= 0:
            raise RuntimeConfigError(f"auto option look_again={opts.look_again!r}",
                                     "use a number >= 0 (0: no second look)")
        if opts.where not in WHERE:
            raise RuntimeConfigError(f"auto option where={opts.where!r}",
                                     f"use one of {WHERE}")
        return opts


@dataclass(frozen=True)
class Row:
    """One candidate: seconds per minibatch, minibatches to the level, predicted time, and the
    minibatches of its pilot it was judged on (the baseline's seconds: :func:`equal_time`)."""

    schedule: str
    period_s: float
    minibatches: float
    time_s: float
    note: str = ""
    piloted: int = 0


@dataclass(frozen=True)
class Decision:
    """What auto chose and why."""

    schedule: str
    reason: str
    rows: tuple[Row, ...] = ()
    pilot_minibatches: int = 0
    pilot_seconds: float = 0.0
    level: float | None = None
    periods_from: str = ""
    pilot_ranks: int = 1
    split: int = 1  # microbatches each minibatch is cut into (auto_pilot.split_for)
    memory: str = ""  # what the pilot's copies were priced at, and against what (auto_memory)
    where: str = "copies"  # the pilot trained copies (auto_pilot) or the pipeline (auto_pipeline)
    continued: int = 0  # where="pipeline": fit went on from this minibatch of the first epoch
    later: tuple[str, ...] = ()  # what auto did after the pilot (auto_look: a second look)

    def summary(self) -> str:
        cut = (f" (each minibatch cut into {self.split} microbatches: one update per minibatch)"
               if self.split > 1 else "")
        lines = [f"schedule auto -> {self.schedule}{cut}: {self.reason}"]
        if self.rows:
            split = (f", candidates split over {self.pilot_ranks} ranks"
                     if self.pilot_ranks > 1 else "")
            on = ("this job's pipeline, the winner continuing from its pilot's end"
                  if self.where == "pipeline" else "the reference executor")
            lines.append(f"  pilot: {self.pilot_minibatches} minibatches of 1f1b-flush's "
                         f"seconds per candidate on {on} ({self.pilot_seconds:.1f} s{split}); "
                         "loss level "
                         f"{self.level:.4g}; seconds per minibatch from {self.periods_from}")
            if self.memory:
                lines.append(f"  memory: {self.memory}")
            lines.append(f"  {'candidate':<28}{'s/minibatch':>12}{'piloted':>9}"
                         f"{'to level':>10}{'predicted':>12}")
            for r in sorted(self.rows, key=lambda r: r.time_s):
                to = "never" if math.isinf(r.minibatches) else f"{r.minibatches:.0f}"
                t = "-" if math.isinf(r.time_s) else f"{r.time_s:.4g} s"
                n = f"{r.piloted}" if r.piloted else "-"
                lines.append(f"  {r.schedule:<28}{r.period_s:>12.4g}{n:>9}{to:>10}{t:>12}"
                             + (f"  ({r.note})" if r.note else ""))
        lines += [f"  then: {x}" for x in self.later]
        return "\n".join(lines)


# ----------------------------------------------------------------------------- the decision

def require_baseline(candidates: Iterable[str], baseline: str = "1f1b-flush") -> None:
    """auto compares every candidate with the synchronous ``baseline``: it must be one."""
    if baseline not in candidates:
        raise RuntimeConfigError(f"auto needs the baseline {baseline!r} among the candidates",
                                 f"add {baseline!r} to auto_options['candidates']")


def decide(curves: Mapping[str, Sequence[float]], periods: Mapping[str, float], *,
           baseline: str = "1f1b-flush", margin: float = 0.05,
           notes: Mapping[str, str] | None = None) -> Decision:
    """The choice from pilot loss curves (one loss per minibatch from the same first
    minibatches) and seconds per minibatch; pure, so the benchmark applies exactly what the
    trainer does. Every curve is cut to the baseline's pilot seconds (:func:`equal_time`): a
    candidate twice as fast is judged on twice the minibatches, where its curve has them."""
    require_baseline(curves, baseline)
    keep = equal_time({c: len(v) for c, v in curves.items()}, periods, baseline)
    curves = {c: list(v)[:keep[c]] for c, v in curves.items()}
    P = len(curves[baseline])
    at = Level.of(curves[baseline])
    level = at.level
    rows = []
    for name, curve in curves.items():
        n = at.minibatches(curve)
        period = periods[name]
        rows.append(Row(name, period, n, n * period, (notes or {}).get(name, ""),
                        len(curve)))
    best = min(rows, key=lambda r: r.time_s)
    sync = min((r for r in rows if r.schedule in SYNCHRONOUS), key=lambda r: r.time_s)
    if best.schedule not in SYNCHRONOUS and not best.time_s < sync.time_s * (1 - margin):
        reason = (f"the fastest asynchronous candidate, {best.schedule}, is predicted within "
                  f"{margin:.0%} of {sync.schedule} ({best.time_s:.4g} s vs {sync.time_s:.4g} s "
                  "to the pilot's loss level), so the schedule without staleness wins the tie")
        best = sync
    elif best.schedule in SYNCHRONOUS:
        reason = (f"predicted fastest to the pilot's loss level ({best.time_s:.4g} s): no "
                  "asynchronous candidate makes up its statistical inefficiency with throughput")
    else:
        eff = sync.minibatches / best.minibatches if best.minibatches else math.inf
        reason = (f"predicted {sync.time_s / best.time_s:.2f}x faster to the pilot's loss level "
                  f"than {sync.schedule}: {sync.period_s / best.period_s:.2f}x its throughput "
                  f"at {eff:.2f}x its statistical efficiency")
    return Decision(best.schedule, reason, tuple(rows), P, level=level)


# ----------------------------------------------------------------------------- measuring

def periods(candidates: Sequence[str], replicas: Sequence[int], *, plan: Any = None,
            profile: Any = None, microbatches: int | None = None) -> tuple[dict[str, float], str]:
    """Seconds per minibatch of each candidate (docs/design-notes.md), and where they came from."""
    kinds = {c: parse_schedule(c).kind for c in candidates}
    out: dict[str, float] = {}
    if plan is not None:
        from ..pricing.plansim import minibatches_for, simulate_as_trained

        n = minibatches_for(list(replicas))
        per = {k: simulate_as_trained(plan, profile, k, minibatches=n,  # the Trainer's window
                                      microbatches=microbatches).steady_state_period
               for k in set(kinds.values())}
        return {c: per[k] for c, k in kinds.items()}, "the plan simulator"
    from ..schedules.simulate import simulate

    S = len(replicas)
    for c, k in kinds.items():
        n = 8 * (microbatches or sum(replicas)) * max(replicas)
        sched = make_schedule(k, list(replicas), n, microbatches=microbatches
                              if k != "pipedream" else None)
        out[c] = simulate(sched, [1.0] * S, [2.0] * S).steady_state_period
    return out, "a unit-cost simulation (no plan: forward 1, backward 2, no network)"


def trained(candidates: Sequence[str]) -> list[str]:
    """The candidates a pilot trains: all but the kinds that reuse flush's curve (when flush is
    one of them), in the order given."""
    return [c for c in candidates if not (parse_schedule(c).kind in SAME_AS_FLUSH
                                          and "1f1b-flush" in candidates)]


def share_of(candidates: Sequence[str], index: int, world: int) -> list[str]:
    """Rank ``index``'s share of the trained candidates among ``world`` ranks (round robin; the
    shares partition :func:`trained`)."""
    return trained(candidates)[index::world]


def merge(parts: Sequence[tuple[Mapping[str, list[float]], Mapping[str, str]]],
          candidates: Sequence[str]) -> tuple[dict[str, list[float]], dict[str, str]]:
    """Every rank's (curves, notes) put together in the candidates' order; gpipe and the
    zero-bubble kinds get flush's curve (the same updates, see docs/design-notes.md)."""
    got = {k: v for curves, _ in parts for k, v in curves.items()}
    notes = {k: v for _, ns in parts for k, v in ns.items()}
    curves = {}
    for c in candidates:
        if c in got:
            curves[c] = list(got[c])
        elif "1f1b-flush" in got and parse_schedule(c).kind in SAME_AS_FLUSH:
            curves[c] = list(got["1f1b-flush"])
    return curves, {c: notes[c] for c in candidates if c in notes}


Gather = Callable[[Any, str], Sequence[Any]]
"""Every rank's object, in rank order (the trainer's ``backend.exchange(obj, what)``)."""

__all__ = ["STRETCH", "AutoOptions", "Decision", "Level", "Row", "budget", "can_stop", "choose",
           "decide", "equal_time", "merge", "periods", "pilot", "pilot_lengths", "price",
           "probe", "share_of", "smooth", "split_for", "to_level", "trained"]


def price(options: AutoOptions, replicas: Sequence[int], num_stages: int,
          lengths: Mapping[str, int], run_minibatches: int | None, world: int,
          microbatches: int | None = None, *, step_s: float | None = None,
          per: Mapping[str, float] | None = None) -> Decision | None:
    """``1f1b-flush`` when a pilot of ``lengths`` minibatches per trained candidate
    (:func:`pilot_lengths`) is predicted to cost more than ``options.max_cost`` of the run's
    training time (:func:`budget`: the largest rank's share of whole-model steps), else None
    (also when the run's length or the limit is unknown). ``per``: the candidates' seconds per
    minibatch where known (flush's is simulated otherwise). ``step_s``: a whole-model step as
    :func:`probe` measured it; None prices it from the plan's profile (its stages' compute
    summed), and without a plan says nothing. Why a profile first: the probe and its exchange
    cost about half a second, a sixth of a short job, and the profile's step is the optimistic
    one (an accelerator, or one idle core, where the pilot's copies share the CPU), so a pilot
    it already prices out would not be affordable measured either."""
    if not run_minibatches or options.max_cost is None or not lengths:
        return None
    how = "measured"
    if step_s is None:
        if options.plan is None:
            return None
        step_s = sum(st.compute_s * st.replicas for st in options.plan.stages)
        how = "the profile's compute"
    flush = per or periods(("1f1b-flush",), replicas, plan=options.plan,
                           profile=options.profile, microbatches=microbatches)[0]
    shares = [share_of(options.candidates, i, world) for i in range(world)]
    steps, n = max((sum(lengths.get(c, 0) for c in sh), len(sh)) for sh in shares)
    cost, run = budget(step_s, 1, steps, run_minibatches, flush["1f1b-flush"],
                       None if options.plan is not None else 3.0 * num_stages)
    if cost <= options.max_cost * run:
        return None
    return Decision("1f1b-flush", f"a pilot would cost about {cost:.3g} s ({n} candidates, "
                    f"{steps} whole-model steps on a rank x {step_s * 1e3:.3g} ms, {how}), more "
                    f"than {options.max_cost:.0%} of the run's predicted {run:.3g} s of training: "
                    f"{SAFE}")


def choose(stages: Sequence[Any], replicas: Sequence[int], loss_fn: Callable[..., Any],
           optimizer: Callable[..., Any], batches: Sequence[Any] | PilotData,
           options: AutoOptions, *, microbatches: int | None = None, seed: int = 0,
           step_options: StepOptions | None = None, share: tuple[int, int] = (0, 1),
           gather: Gather | None = None, lr_scheduler: Callable[[Any], Any] | None = None,
           run_minibatches: int | None = None,
           cut: Callable[[list[Any]], Any] | None = None,
           noams: Mapping[str, int | None] | None = None) -> Decision:
    """The whole of auto for one pipeline and the first minibatches of its data (a list, or a
    :class:`~.auto_data.PilotData` streamed from the loader: nothing is read before the pilot
    is priced). ``share``: (this rank, ranks): each rank trains its :func:`share_of` the
    candidates and ``gather`` brings every rank's curves together, so the pilot's wall time
    falls with the number of ranks (every rank then decides alike: the same curves, the same
    simulation); a rank with no share neither probes nor copies the model.
    ``run_minibatches``: the run's length; with ``options.max_cost``, a pilot predicted to cost
    more than that fraction of the run's training time (:func:`price`: by the plan's profile,
    then by a :func:`probe`) is not run. ``cut(first minibatches)``: the trainer's
    :class:`~.loss_split.Cut` (a collective: every rank calls it, just before the pilot), with
    which the microbatched candidates cut minibatches. ``noams``: the asynchronous kinds'
    windows at the input stage, as the trainer would run them (None: PipeDream's NOAM)."""
    if len(stages) == 1:
        return one_stage(replicas)
    data = batches if isinstance(batches, PilotData) else PilotData.held(batches)
    count = data.count() if options.pilot > 0 else 0
    if options.pilot <= 0 or count < max(options.min_pilot, 1):
        why = ("the pilot is disabled" if options.pilot <= 0 else
               f"only {count} minibatches for a pilot (min_pilot={options.min_pilot})")
        return Decision("1f1b-flush", f"{why}: {SAFE}")
    require_baseline(options.candidates)
    t0 = time.perf_counter()
    index, world = share
    if world > 1 and gather is None:
        raise RuntimeConfigError(f"auto's pilot split over {world} ranks without a gather",
                                 "pass gather= (every rank's object, in rank order)")
    P = min(options.pilot, count)
    mine = share_of(options.candidates, index, world)
    per, source = periods(options.candidates, replicas, plan=options.plan,
                          profile=options.profile, microbatches=microbatches)
    lengths = pilot_lengths(trained(options.candidates), per, P, count)
    args = (options, replicas, len(stages), lengths, run_minibatches, world, microbatches)
    early = price(*args, per=per)  # the plan's profile: no probe where it already prices out
    if early is not None:
        return replace(early, pilot_seconds=time.perf_counter() - t0)
    # the trainer's check of the first minibatch (and its cut), before any candidate's step
    the_cut = (cut(data.first(1)) if cut is not None and any(
        split_for(c, replicas, microbatches) > 1 for c in options.candidates) else None)
    if run_minibatches and options.max_cost is not None:
        step = (probe(stages, replicas, loss_fn, optimizer, data.first(5),
                      step_options=step_options) if mine else 0.0)
        step = max(gather(step, "auto: pilot probe")) if gather is not None else step
        early = price(*args, step_s=step, per=per)
    if early is not None:
        return replace(early, pilot_seconds=time.perf_counter() - t0)
    curves_notes = pilot(stages, replicas, loss_fn, optimizer, data, mine,
                         lengths=lengths, microbatches=microbatches, seed=seed,
                         step_options=step_options,
                         lr_scheduler=lr_scheduler, noams=noams, cut=the_cut)
    curves, notes = merge(gather(curves_notes, "auto: pilot curves") if gather is not None
                          else [curves_notes], options.candidates)
    d = decide(curves, {c: per[c] for c in curves}, margin=options.margin, notes=notes)
    rows = d.rows + tuple(Row(c, math.nan, math.inf, math.inf, n) for c, n in notes.items())
    return Decision(d.schedule, d.reason, rows, d.pilot_minibatches,
                    time.perf_counter() - t0, d.level, source,
                    min(world, len(trained(options.candidates))))
