"""``schedule="auto"``: the schedule (and mitigation) with the best predicted time to a target.

    predicted time to a loss level = (minibatches to reach it) x (seconds per minibatch)

* **Seconds per minibatch** of each candidate: the plan simulator (:mod:`fxpipe.runtime.plansim`)
  runs the candidate's schedule on the plan's cluster and costs (mitigations cost what their
  schedule costs: their extra element-wise work is not modelled). Without a plan (a Trainer
  built from bare stages) a unit-cost simulation (forward 1, backward 2, no network) stands in.
* **Minibatches to the level**: a pilot. Every candidate trains a copy of the user's own model,
  from the same weights, on the same first ``pilot`` minibatches (default 200, at most
  ``max_fraction`` = 1/4 of the run's minibatches; from as many epochs of the loader as that
  takes: the loader must be re-iterable), on the reference
  executor (the distributed runtime's single-process oracle; CPU, in this process, every rank
  alike). The training losses are smoothed (trailing mean over ``pilot // 8`` minibatches); the
  level is where the synchronous baseline (``1f1b-flush``) ends the pilot; a candidate's count is
  the first minibatch whose smoothed loss reaches the level. One that does not within the pilot
  is not chosen: extrapolating its progress (an earlier rule) picked stale schedules that were
  fast early and then stalled short of the target (bench/ablation: 4 of 24 rows, one seed).
* **The choice**: the smallest predicted time, except that an asynchronous candidate must beat
  the best synchronous one (``1f1b-flush``, ``gpipe``, ``zb-h1``, ``zb-h2``) by ``margin``
  (default 5%): a short pilot sees the start of training only, and staleness costs more later (measured in BENCHMARKS.md,
  section ``statistical-efficiency``), so a near tie goes to the schedule without staleness.

Cost: ``len(candidates)`` x ``pilot`` minibatch steps of the whole model in one process (gpipe
and the zero-bubble kinds reuse flush's curve: the same minibatch-SGD updates). Opt out with an
explicit schedule, or ``auto_options={"pilot": 0}``, which picks the synchronous baseline without a pilot (as does a run with fewer
than ``min_pilot`` minibatches). LocalSGD is not a candidate: the distributed executor does not
run it.
"""
from __future__ import annotations

import copy
import logging
import math
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping, Sequence, TYPE_CHECKING

import torch

from fxpipe.errors import FxpipeError

from .errors import RuntimeConfigError
from .schedule import make_schedule
from .schedule_spec import parse_schedule

if TYPE_CHECKING:
    from .step_options import StepOptions

log = logging.getLogger(__name__)

SYNCHRONOUS = ("1f1b-flush", "gpipe", "zb-h1", "zb-h2")
SAME_AS_FLUSH = ("gpipe", "zb-h1", "zb-h2")  # minibatch SGD, flush's arithmetic: its pilot curve
SAFE = ("the synchronous schedule is never statistically worse, so it is the safe choice "
        "without a measurement")
DEFAULT_CANDIDATES = ("1f1b-flush", "gpipe", "zb-h1", "zb-h2", "pipedream", "pipedream+lr_scale",
                      "pipedream+predict+momentum")
"""Trained in the pilot: flush (whose curve gpipe and the zero-bubble kinds share), pipedream,
and the two mitigations that came out best in bench/ablation's goal table (lr_scale,
predict+momentum). Each trained candidate costs one pilot of whole-model steps, so the default
list is short; pass ``auto_options={"candidates": (...)}`` for others (2bw, +dc, ...)."""


@dataclass(frozen=True)
class AutoOptions:
    """How ``auto`` decides (see the module doc). ``plan``/``profile``: the compiled model's
    (``CompiledModel.trainer`` passes them); ``report``: called with the :class:`Decision`."""

    pilot: int = 200
    min_pilot: int = 40
    max_fraction: float = 0.25
    candidates: tuple[str, ...] = DEFAULT_CANDIDATES
    margin: float = 0.05
    plan: Any = None
    profile: Any = None
    report: Callable[[Decision], None] | None = None

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
        return opts


@dataclass(frozen=True)
class Row:
    """One candidate: seconds per minibatch, minibatches to the level, predicted time."""

    schedule: str
    period_s: float
    minibatches: float
    time_s: float
    note: str = ""


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

    def summary(self) -> str:
        lines = [f"schedule auto -> {self.schedule}: {self.reason}"]
        if self.rows:
            lines.append(f"  pilot: {self.pilot_minibatches} minibatches per candidate on the "
                         f"reference executor ({self.pilot_seconds:.1f} s in all); loss level "
                         f"{self.level:.4g}; seconds per minibatch from {self.periods_from}")
            lines.append(f"  {'candidate':<28}{'s/minibatch':>12}{'to level':>10}"
                         f"{'predicted':>12}")
            for r in sorted(self.rows, key=lambda r: r.time_s):
                to = "never" if math.isinf(r.minibatches) else f"{r.minibatches:.0f}"
                t = "-" if math.isinf(r.time_s) else f"{r.time_s:.4g} s"
                lines.append(f"  {r.schedule:<28}{r.period_s:>12.4g}{to:>10}{t:>12}"
                             + (f"  ({r.note})" if r.note else ""))
        return "\n".join(lines)


# ----------------------------------------------------------------------------- the decision

def smooth(losses: Sequence[float], window: int) -> list[float]:
    """Trailing mean over ``window`` values (fewer at the start); NaN/inf stay NaN/inf."""
    out, acc = [], 0.0
    for i, x in enumerate(losses):
        acc += x
        if i >= window:
            acc -= losses[i - window]
        out.append(acc / min(i + 1, window) if math.isfinite(acc) else math.inf)
    return out


def to_level(curve: Sequence[float], level: float, start: float, window: int) -> float:
    """Minibatches until the smoothed ``curve`` reaches ``level`` (see the module doc)."""
    sm = smooth(curve, window)
    if not sm or not all(math.isfinite(x) for x in curve):
        return math.inf
    for i in range(window - 1, len(sm)):
        if sm[i] <= level:
            return float(i + 1)
    return math.inf


def decide(curves: Mapping[str, Sequence[float]], periods: Mapping[str, float], *,
           baseline: str = "1f1b-flush", margin: float = 0.05,
           notes: Mapping[str, str] | None = None) -> Decision:
    """The choice from pilot loss curves (same minibatches for every candidate) and seconds per
    minibatch; pure, so the benchmark applies exactly what the trainer does."""
    if baseline not in curves:
        raise RuntimeConfigError(f"auto needs the baseline {baseline!r} among the candidates",
                                 f"add {baseline!r} to auto_options['candidates']")
    P = len(curves[baseline])
    window = max(5, P // 8)
    base = smooth(curves[baseline], window)
    level, start = base[-1], base[window - 1] if P >= window else base[0]
    rows = []
    for name, curve in curves.items():
        n = to_level(curve, level, start, window)
        period = periods[name]
        rows.append(Row(name, period, n, n * period, (notes or {}).get(name, "")))
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
    """Seconds per minibatch of each candidate (see the module doc), and where they came from."""
    kinds = {c: parse_schedule(c).kind for c in candidates}
    out: dict[str, float] = {}
    if plan is not None:
        from .plansim import minibatches_for, simulate_plan

        n = minibatches_for(list(replicas))
        per = {k: simulate_plan(plan, profile, schedule=k, minibatches=n,
                                microbatches=microbatches).steady_state_period
               for k in set(kinds.values())}
        return {c: per[k] for c, k in kinds.items()}, "the plan simulator"
    from .simulate import simulate

    S = len(replicas)
    for c, k in kinds.items():
        n = 8 * (microbatches or sum(replicas)) * max(replicas)
        sched = make_schedule(k, list(replicas), n, microbatches=microbatches
                              if k != "pipedream" else None)
        out[c] = simulate(sched, [1.0] * S, [2.0] * S).steady_state_period
    return out, "a unit-cost simulation (no plan: forward 1, backward 2, no network)"


def pilot(stages: Sequence[Any], replicas: Sequence[int], loss_fn: Callable[..., Any],
          optimizer: Callable[..., Any], batches: Sequence[Any], candidates: Sequence[str], *,
          microbatches: int | None = None, seed: int = 0, step_options: StepOptions | None = None
          ) -> tuple[dict[str, list[float]], dict[str, str]]:
    """Training-loss curves of each candidate on ``batches`` (copies of ``stages`` on the CPU,
    reference executor, same dropout seed for all, the trainer's clipping/precision/
    recomputation ``step_options``); a candidate that cannot run this model (e.g. momentum
    correction with an unsupported optimizer) is left out with a note."""
    from .reference import ReferenceExecutor
    from .step_options import DEFAULT

    curves: dict[str, list[float]] = {}
    notes: dict[str, str] = {}
    rng = torch.get_rng_state()
    try:
        for c in candidates:
            spec = parse_schedule(c)
            if spec.kind in SAME_AS_FLUSH and "1f1b-flush" in curves:
                curves[c] = curves["1f1b-flush"]  # the same updates (see the module doc)
                continue
            torch.manual_seed(seed)
            copies = copy.deepcopy(list(stages))
            for st in copies:
                st.gm.to("cpu")
            try:
                sched = make_schedule(spec.kind, list(replicas), len(batches),
                                      microbatches=None if spec.kind == "pipedream"
                                      else microbatches)
                ex = ReferenceExecutor(copies, replicas, sched, loss_fn, optimizer,
                                       mitigation=spec.mitigation,
                                       options=step_options or DEFAULT)
                curves[c] = ex.run(list(batches)).losses
            except FxpipeError as err:
                notes[c] = f"not run: {err.message}"
    finally:
        torch.set_rng_state(rng)
    return curves, notes


def choose(stages: Sequence[Any], replicas: Sequence[int], loss_fn: Callable[..., Any],
           optimizer: Callable[..., Any], batches: Sequence[Any], options: AutoOptions, *,
           microbatches: int | None = None, seed: int = 0, step_options: StepOptions | None = None) -> Decision:
    """The whole of auto for one pipeline and the first minibatches of its data."""
    if options.pilot <= 0 or len(batches) < options.min_pilot:
        why = ("the pilot is disabled" if options.pilot <= 0 else
               f"only {len(batches)} minibatches for a pilot (min_pilot={options.min_pilot})")
        return Decision("1f1b-flush", f"{why}: {SAFE}")
    t0 = time.perf_counter()
    curves, notes = pilot(stages, replicas, loss_fn, optimizer, batches[:options.pilot],
                          options.candidates, microbatches=microbatches, seed=seed,
                          step_options=step_options)
    per, source = periods(list(curves), replicas, plan=options.plan, profile=options.profile,
                          microbatches=microbatches)
    d = decide(curves, per, margin=options.margin, notes=notes)
    rows = d.rows + tuple(Row(c, math.nan, math.inf, math.inf, n) for c, n in notes.items())
    return Decision(d.schedule, d.reason, rows, d.pilot_minibatches,
                    time.perf_counter() - t0, d.level, source)


# ----------------------------------------------------------------------------- the trainer's side

def pilot_length(opts: AutoOptions, loader: Any, epochs: int) -> int:
    """Minibatches the pilot may read: ``pilot``, at most ``max_fraction`` of the run's
    minibatches when the loader has a length (a pilot longer than that would cost more than it
    can save; below ``min_pilot`` there is none)."""
    n = opts.pilot
    if hasattr(loader, "__len__"):
        n = min(n, int(opts.max_fraction * epochs * len(loader)))
    return max(n, 0)


def resolve(trainer: Any, loader: Any, resume: bool, epochs: int = 1) -> Decision:
    """Choose the schedule of ``trainer`` (built with ``schedule="auto"``) before its first
    epoch and adopt it. Every rank runs the same pilot on the same minibatches (so none waits
    long at a collective), then rank 0's decision is broadcast. Resuming takes the schedule the
    checkpoint was trained with, without a pilot."""
    from .data import iter_parts, take

    opts: AutoOptions = trainer.auto_options
    decision = None
    if resume and trainer.checkpoint_dir is not None:
        found = _checkpoint_schedule(trainer) if trainer.index == 0 else None
        found = trainer.backend.broadcast(found, "auto: checkpoint schedule")
        if found is not None:
            decision = Decision(found, "the checkpoint being resumed was trained with it")
    if decision is None:
        want = pilot_length(opts, loader, epochs)
        if 0 < want < opts.min_pilot:
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
                          step_options=trainer.options)
        decision = trainer.backend.broadcast(decision, "auto: decision")  # rank 0's
    trainer.adopt(decision.schedule)
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
