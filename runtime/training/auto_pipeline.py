"""``schedule="auto"`` decided on the job's own pipeline (``auto_options={"where": "pipeline"}``).

Each candidate is adopted in turn and trains the run's first minibatches as ``fit`` would, for
equal simulated seconds; each rank saves its replicas' end states, the winner reloads its own,
and ``fit`` goes on from there: no CPU copies, the run's own executor, ranks and devices."""
from __future__ import annotations

import functools
import logging
import math
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch

from fxpipe.errors import FxpipeError

from ..schedules.spec import parse_schedule
from ..schedules.stream import STREAM_KINDS
from .auto import (SAFE, SYNCHRONOUS, AutoOptions, Decision, Level, Row, can_stop, decide,
                   periods, pilot_lengths, require_baseline, trained)
from .auto_data import reread_error
from .auto_pilot import split_for
from .data import PartStream
from .host import Exchange, TrainingHost

log = logging.getLogger("fxpipe.runtime.training.auto")


def pilot_step(replicas: Sequence[int], microbatches: int | None) -> int:
    """The pilot's length must be whole updates and whole pipedream rounds for every candidate:
    a multiple of this (the segments' group of an ``auto`` trainer with these ``replicas`` and
    ``microbatches``)."""
    return math.lcm(math.lcm(*replicas), microbatches or 1)


def run_pilot(trainer: TrainingHost, loader: Any, P: int, what: str,
              stop: Callable[[list[float]], bool] | None = None, *, epoch: int = 0,
              start: int = 0, acc: list[float] | None = None, expect: int = 0
              ) -> tuple[list[float], float, tuple[int, list[float]]]:
    """Train the adopted schedule on ``P`` minibatches of ``epoch`` from position ``start`` (the
    first ones of epoch 0 by default) as ``fit`` would (segments, cut, dropout seeds),
    draining at its end; returns (one training loss per minibatch, on every rank; the seconds
    it took; (the epoch position reached, the epoch's accumulators there, from ``acc``): where
    ``fit`` continues if this candidate wins). ``stop(curve so far)``: asked after every
    segment, on every rank with the same curve (one exchange per segment); True ends the pilot
    there (:func:`~.auto.can_stop`). ``expect``: minibatches an earlier pass read from
    ``start`` on: a loader that runs out before them gives less when it is iterated again (a
    stream read once), an error rather than a short pilot."""
    it = PartStream(loader, epoch, trainer.seed, need_inputs=trainer.need_inputs,
                    need_targets=trainer.need_targets, start=start)
    trainer._acc = list(acc) if acc is not None else [0.0, 0.0, 0.0, 0.0]
    seen: dict[int, list[float]] = {}  # minibatch -> [sum of weight x loss, sum of weights]
    stream = trainer.kind in STREAM_KINDS
    done, base = 0, 0  # base: microbatches before this segment (complete schedules count from 0)

    def note(losses: dict[int, float], weights: dict[int, float], off: int) -> None:
        for k, v in losses.items():
            acc = seen.setdefault((off + k) // trainer.split, [0.0, 0.0])
            acc[0] += weights[k] * v
            acc[1] += weights[k]

    t0 = time.perf_counter()
    try:
        while done < P:
            pos = start + done
            want = min(trainer._segment_at(pos), P - done)
            parts, n = trainer._lead(it, want, f"{what} segment at {pos}")
            if n < want and done + n < min(expect, P):
                raise reread_error(done + n, min(expect, P),
                                   f" from minibatch {start} of epoch {epoch}")
            if n == 0:
                break
            final = n < want or done + n >= P
            losses, weights = trainer._train_segment(parts, epoch, pos, n, final)
            note(losses, weights, 0 if stream else base)
            base += len(parts)
            done += n
            del parts
            if n < want:
                break
            if stop is not None and not final and stop(_merged(trainer.backend.exchange, seen,
                                                               what)):
                break
        # nothing in flight past the pilot (a final segment drained it already); the losses
        # of the minibatches that finish now belong to the curve
        note(*trainer.drain(epoch), 0 if stream else base)
    finally:
        it.close()
    seconds = time.perf_counter() - t0
    curve = _merged(trainer.backend.exchange, seen, what)
    seconds = max(trainer.backend.exchange(seconds, f"{what} seconds"))
    return curve, seconds, (start + done, list(trainer._acc))


def _merged(exchange: Exchange, seen: dict[int, list[float]], what: str) -> list[float]:
    """Every rank's losses so far put together (only the output stage has them): one loss per
    minibatch, in order, on every rank."""
    merged: dict[int, list[float]] = {}
    for part in exchange(seen, f"{what} losses"):
        for m, (s, w) in part.items():
            acc = merged.setdefault(m, [0.0, 0.0])
            acc[0] += s
            acc[1] += w
    return [merged[m][0] / merged[m][1] for m in sorted(merged) if merged[m][1] > 0]


def extra_copies(kind: str, mitigation: Any, in_flight: int, stashing: bool = True) -> int:
    """Copies of a stage's weights a candidate holds beyond ``1f1b-flush``'s one version, with
    ``in_flight`` minibatches in flight on the stage: pipedream's stashed versions (one per
    minibatch in flight, with stashing), 2bw's second version, weight prediction's predicted
    copy per minibatch in flight plus the last update and its clone, delay compensation's
    mean square and its product. Optimizer-only mitigations (lr_scale, momentum, nesterov)
    hold none."""
    versions = (in_flight if stashing else 1) if kind == "pipedream" else 2 if kind == "2bw" else 1
    extra = versions - 1
    if mitigation is not None and mitigation.predict:
        extra += in_flight + 2
    if mitigation is not None and mitigation.dc:
        extra += 2
    return extra


def process_peak_bytes(device: torch.device) -> int | None:
    """The most this process has held so far: ``torch.cuda.max_memory_allocated`` on a GPU, the
    resident set's high-water mark (``VmHWM``) on Linux; None where neither is known."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def candidate_memory(c: str, replicas: Sequence[int], microbatches: int | None,
                     weight_bytes: Mapping[tuple[int, int], int], *, noam: int | None = None,
                     stashing: bool = True) -> int:
    """Bytes a rank's replicas would hold under candidate ``c`` beyond flush's: per local
    replica (``weight_bytes``: (stage, replica) -> bytes of its weights), :func:`extra_copies`
    times its weight bytes, at the candidate's own peak of minibatches in flight on a pipeline of
    ``replicas`` (``noam``: the trainer's window for ``c``'s kind)."""
    from ..pricing.sim_measure import peak_in_flight
    from ..schedules.kinds import make_schedule

    spec = parse_schedule(c)
    k = split_for(c, replicas, microbatches)
    sched = make_schedule(spec.kind, list(replicas), 4 * sum(replicas) * max(k, 1),
                          microbatches=None if spec.kind == "pipedream" else
                          (k if k > 1 else microbatches), noam=noam)
    return sum(extra_copies(spec.kind, spec.mitigation, peak_in_flight(sched.actions[rank]),
                            stashing) * n for rank, n in weight_bytes.items())


def weight_bytes(trainer: TrainingHost) -> dict[tuple[int, int], int]:
    """(stage, replica) -> bytes of the current weights of each of this rank's replicas."""
    return {rank: sum(t.numel() * t.element_size() for t in w.stash.latest.values())
            for rank, w in trainer.local.items()}


def save_state(trainer: TrainingHost, folder: Path, name: str) -> Path:
    """This rank's replicas' end state (what a checkpoint holds) in its private folder."""
    path = folder / f"{name.replace('+', '_')}.pt"
    torch.save({rank: trainer._stage_state(rank, 0, 0) for rank in trainer.local}, path)
    return path


def load_state(trainer: TrainingHost, path: Path) -> None:
    """The end state back into its replicas (its own file, written by :func:`save_state`:
    not memory-mapped, since the optimizer may keep the loaded state tensors as its own)."""
    states = torch.load(path, map_location="cpu", weights_only=False)
    for rank, w in trainer.local.items():
        trainer._load_stage(rank, w, states.pop(rank))
    del states


def too_big(c: str, need: int, peak: int | None, max_memory: float, exchange: Exchange) -> str:
    """Why candidate ``c`` is not piloted ("" when it may be): on some rank, the weight copies
    it would hold beyond flush's (``need``, :func:`candidate_memory`) exceed ``max_memory`` of
    what that rank's process has peaked at so far (``peak``, flush's pilot included). The ranks
    exchange their figures, so all of them skip alike."""
    from fxpipe.units import format_bytes as fmt

    figures = exchange((need, peak), f"auto pilot {c} memory")
    for i, (need, top) in enumerate(figures):
        if top and need > max_memory * top:
            return (f"not run: it would hold about {fmt(need)} of weight copies beyond "
                    f"1f1b-flush's on rank {i} (stashed versions, prediction's or compensation's "
                    f"copies), more than max_memory={max_memory:.0%} of the {fmt(top)} that "
                    "rank has peaked at")
    return ""


def pipeline_decision(trainer: TrainingHost, loader: Any, P: int, opts: AutoOptions,
                      cap: int | None = None) -> tuple[Decision, list[float]]:
    """The decision (see docs/design-notes.md; ``fit`` continues at its ``continued`` minibatch of
    the first epoch) and the epoch's accumulators there. Every rank runs it; the candidates'
    order is the options'. ``1f1b-flush`` pilots ``P`` minibatches, every other candidate as
    many as fit in flush's seconds (:func:`~.auto.pilot_lengths`), at most ``cap``."""
    require_baseline(opts.candidates)
    order = trained(opts.candidates)
    order.sort(key=lambda c: c != "1f1b-flush")  # the baseline first: it sets the level
    per, source = periods(opts.candidates, trainer.replicas, plan=opts.plan,
                          profile=opts.profile, microbatches=trainer.microbatches)
    lengths = pilot_lengths(order, per, P, max(cap or P, P),
                            pilot_step(trainer.replicas, trainer.microbatches))
    curves: dict[str, list[float]] = {}
    notes: dict[str, str] = {}
    seconds: dict[str, float] = {}
    ends: dict[str, tuple[Path, tuple[int, list[float]]]] = {}
    best_async: tuple[float, str] | None = None
    level: Level | None = None  # flush's, once its pilot ran
    bound = math.inf  # the least predicted time so far: a later candidate stops past it
    flush_read = 0  # minibatches flush's pilot read: every later pass must find them again
    metrics_on, trainer.metrics.enabled = trainer.metrics.enabled, False  # pilots: no rows
    t0 = time.perf_counter()
    try:
        with tempfile.TemporaryDirectory(prefix="fxpipe-auto-") as tmp:
            folder = Path(tmp)
            peak: int | None = None
            for c in order:
                if c != "1f1b-flush" and opts.max_memory is not None:
                    need = candidate_memory(c, trainer.replicas, trainer.microbatches,
                                            weight_bytes(trainer),
                                            noam=trainer._noam(parse_schedule(c).kind),
                                            stashing=trainer.stashing)
                    refused = too_big(c, need, peak, opts.max_memory, trainer.backend.exchange)
                    if refused:
                        notes[c] = refused
                        log.warning("auto: %s: %s", c, refused)
                        continue
                try:
                    trainer.adopt(c, split_for(c, trainer.replicas, trainer.microbatches))
                except FxpipeError as err:  # every rank refuses alike (same optimizer, stages)
                    notes[c] = f"not run: {err.message}"
                    continue
                stop = None
                if c != "1f1b-flush" and level is not None:
                    stop = functools.partial(can_stop, period=per[c], level=level,
                                             bound_s=bound)
                curve, secs, end = run_pilot(trainer, loader, lengths[c], f"auto pilot {c}",
                                             stop, expect=flush_read)
                curves[c], seconds[c] = curve, secs
                log.info("auto: pilot of %s on the pipeline: %d minibatches in %.3g s, last "
                         "loss %.4g", c, len(curve), secs, curve[-1] if curve else math.nan)
                if c == "1f1b-flush":  # sets the level, and what every later pass must read
                    flush_read, level = end[0], Level.of(curve) if curve else None
                bound = min(bound, (level.minibatches(curve) * per[c]) if level else math.inf)
                if c == "1f1b-flush":
                    peak = process_peak_bytes(getattr(trainer.backend, "device",
                                                      torch.device("cpu")))
                    ends[c] = (save_state(trainer, folder, c), end)
                    if len(curve) < max(opts.min_pilot, 1):  # the loader ran out first
                        break
                    continue
                so_far = decide({"1f1b-flush": curves["1f1b-flush"], c: curve},
                                {"1f1b-flush": per["1f1b-flush"], c: per[c]}, margin=0.0)
                row = next(r for r in so_far.rows if r.schedule == c)
                if best_async is None or row.time_s < best_async[0]:
                    if best_async is not None:  # one asynchronous end state kept at a time
                        ends.pop(best_async[1])[0].unlink()
                    best_async = (row.time_s, c)
                    ends[c] = (save_state(trainer, folder, c), end)
            full = dict(curves)
            for c in opts.candidates:  # gpipe and the zero-bubble kinds: flush's updates
                if c not in full and parse_schedule(c).kind in SYNCHRONOUS:
                    full[c] = curves["1f1b-flush"]
            if len(curves["1f1b-flush"]) < max(opts.min_pilot, 1):
                d = Decision("1f1b-flush", f"only {len(curves['1f1b-flush'])} minibatches for "
                             f"a pilot (min_pilot={opts.min_pilot}): {SAFE}")
            else:
                d = decide(full, {c: per[c] for c in full}, margin=opts.margin, notes=notes)
            winner = d.schedule
            if winner in ends:
                path, (pos, acc) = ends[winner]
            elif parse_schedule(winner).kind in SYNCHRONOUS:
                path, (pos, acc) = ends["1f1b-flush"]
            else:  # decide() picks the fastest row: the asynchronous one kept above
                raise RuntimeError(f"auto chose {winner!r} whose pilot state was not kept "
                                   f"(kept: {sorted(ends)}): an fxpipe bug")
            trainer.adopt(winner, split_for(winner, trainer.replicas, trainer.microbatches))
            load_state(trainer, path)
    finally:
        trainer.metrics.enabled = metrics_on
    spent = time.perf_counter() - t0
    measured = ", ".join(f"{c} {s / max(len(curves[c]), 1) * 1e3:.3g} ms"
                         for c, s in seconds.items())
    rows = d.rows + tuple(Row(c, math.nan, math.inf, math.inf, n) for c, n in notes.items())
    decision = Decision(winner, d.reason, rows, d.pilot_minibatches, spent, d.level,
                        f"{source}; measured on this pipeline per minibatch: {measured}", 1,
                        split=trainer.split, where="pipeline", continued=pos)
    return decision, acc
