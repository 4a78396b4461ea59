"""The partitioner's output: a :class:`Plan` of :class:`StagePlan` s, serialisable to JSON.

Later phases may read it in another process or machine, so it round-trips exactly (floats by
``repr``) and a malformed file is refused with a message naming the file and the field.
"""
from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Mapping, Sequence

from fxpipe.errors import PlanFormatError
from fxpipe.jsonio import read_json, write_json_atomic
from fxpipe.units import format_bytes, format_seconds

from .memory_rule import PIPEDREAM, MemoryRule

PLAN_FORMAT = "fxpipe.plan/1"


@dataclass(frozen=True)
class StagePlan:
    """One pipeline stage. Times are seconds per minibatch as seen by the pipeline: ``compute_s``
    is the stage's forward+backward+update time divided among its replicas, ``update_s`` the
    optimizer-step part of it (shown separately so users see what the update costs), ``sync_s``
    its weight synchronisation, ``comm_s`` the time to move ``input_bytes`` into it
    (activations forward, gradients back). ``memory_bytes`` is per replica, with ``in_flight``
    weight versions. ``recompute``: the stage recomputes its activations in the backward (it
    keeps only its inputs per in-flight minibatch); ``recompute_s`` is the extra forward this
    costs, already inside ``compute_s``."""

    index: int
    nodes: tuple[str, ...]
    replicas: int
    compute_s: float
    sync_s: float
    stage_time_s: float
    input_bytes: float
    comm_s: float
    parameter_bytes: float
    activation_bytes: float
    memory_bytes: float
    in_flight: int
    # Last with a default: plans saved before the update was modelled load with 0.0.
    update_s: float = 0.0
    # Optional too (plans saved before recomputation was planned load without it).
    recompute: bool = False
    recompute_s: float = 0.0
    # Weights, gradients and optimizer state per replica, ``P (2 + opt_state)``: the part of
    # ``memory_bytes`` no schedule changes (None in plans saved before it was recorded), so
    # memory can be priced again for the schedule that runs (runtime/pricing/memory.py).
    state_bytes: float | None = None
    # Per minibatch in flight, what a recomputing stage keeps: the bytes entering it and the
    # model inputs inside it (None: the stage does not recompute, or a plan saved before).
    kept_input_bytes: float | None = None
    # What the runtime pays per minibatch beyond the stage's nodes (its calls, its messages,
    # the stash's copy: fxpipe.costmodel.overheads; the values made from the model's inputs it
    # makes again: fxpipe.passes.made_here), already inside compute_s and stage_time_s (0 in
    # plans saved before it was priced, and where there is none of either).
    overhead_s: float = 0.0
    # The peak of live bytes per replica walked through the schedule the plan was compiled for
    # (fxpipe.runtime.pricing.memory_walk: memory_bytes plus the message buffers, working sets
    # and optimizer temporaries live during an action), what a run measures; None: not walked
    # (the planner alone, the placed kinds, plans saved before it was).
    peak_bytes: float | None = None
    # Parameters another stage owns that this stage keeps a copy of (a tied embedding's head,
    # a reused layer's later call): their weights, gradients, optimizer state and versions are
    # priced in memory_bytes and state_bytes like parameter_bytes, which counts only the
    # parameters the stage owns (0 where there are none, and in plans saved before).
    copy_bytes: float = 0.0


@dataclass(frozen=True)
class Plan:
    """A partition of a profile onto a cluster, with its predicted costs."""

    stages: tuple[StagePlan, ...]
    cluster: dict[str, Any]
    sync: str
    time_per_minibatch: float
    noam: int
    data_parallel_time: float
    batch_size: int | None = None
    shared_parameters: dict[str, tuple[int, ...]] = field(default_factory=dict)
    model_fingerprint: str | None = None
    profile_source: str = "fxpipe"
    workers_used: int = 0
    # Weight staleness per schedule (filled by fxpipe.compile from
    # fxpipe.runtime.schedules.staleness; passes cannot compute it): schedule -> per stage
    # (own-update delay, global block-update delay, Randomized PipeDream's convention). Empty: not
    # computed (older plan files).
    staleness: dict[str, tuple[tuple[int, int], ...]] = field(default_factory=dict)
    # The schedule whose memory ``memory_bytes`` and the cap were priced with (PipeDream's rule
    # in plans saved before it was recorded).
    memory_rule: MemoryRule = PIPEDREAM
    # Where ``time_per_minibatch`` and ``data_parallel_time`` come from: "planner" (the analytic
    # bottleneck, PipeDream's schedule without a flush) or "simulated <schedule>" (the event
    # simulator's steady state under the schedule the plan was made for, bubble included).
    time_source: str = "planner"
    # Minibatches in flight the trainer admits at the input stage under pipedream where that is
    # more than ``noam`` (the fewest that hide the plan's round trips within its memory; filled
    # by fxpipe.compile from fxpipe.runtime.pricing.plansim), None where it is ``noam``. The
    # pipedream rows of ``staleness`` are for this window.
    window: int | None = None
    # One worker training the whole model alone, priced like ``time_per_minibatch`` (the
    # runtime's overheads, or simulated the same way): what a plan on fewer workers is chosen
    # against (None in plans saved before it was recorded).
    one_worker_time: float | None = None
    # "optimizer": each replicated stage's optimizer state is split over its replicas (ZeRO-1),
    # priced in its memory and its sync (see passes.partition); None: every replica keeps all
    # of it. What the trainer runs by default (its ``shard``).
    shard: str | None = None

    # --- views -------------------------------------------------------------------------
    @property
    def replicas(self) -> list[int]:
        return [s.replicas for s in self.stages]

    @property
    def recompute(self) -> list[bool]:
        """Per stage: does it recompute its activations (what the trainer runs by default)."""
        return [s.recompute for s in self.stages]

    @property
    def is_data_parallel(self) -> bool:
        """One stage holding the whole model: plain data parallelism, no pipelining."""
        return len(self.stages) == 1

    @property
    def speedup_over_data_parallel(self) -> float:
        if self.time_per_minibatch <= 0:
            return math.inf
        return self.data_parallel_time / self.time_per_minibatch

    @property
    def speedup_over_one_worker(self) -> float | None:
        if self.one_worker_time is None:
            return None
        return math.inf if self.time_per_minibatch <= 0 else (
            self.one_worker_time / self.time_per_minibatch)

    @property
    def throughput(self) -> float | None:
        """Samples per second in steady state (None when the batch size is unknown)."""
        if self.batch_size is None or self.time_per_minibatch <= 0:
            return None
        return self.batch_size / self.time_per_minibatch

    def stage_of(self) -> dict[str, int]:
        """Node name -> stage index (what codegen's split_graph takes)."""
        return {n: s.index for s in self.stages for n in s.nodes}

    def summary(self, spans: list[str] | None = None, detail: bool = False) -> str:
        """The plan on one screen: a row per stage, then its time, speedups and what it leaves
        out. ``spans``: what each stage holds, in words (default: its first and last node), e.g.
        the modules a compiled model's stages cover, which read better than an aten graph's
        node names. ``detail``: also each stage's optimizer step and overheads, what its
        memory is made of, the minibatches in flight and the staleness table."""
        rc = any(self.recompute)  # the column only when some stage recomputes
        walked = all(s.peak_bytes is not None for s in self.stages)
        head = (f"{'stage':>5}  {'nodes':<40} {'replicas':>8} {'compute':>10}"
                + (f" {'update':>10}" if detail else "") + f" {'comm':>10} {'memory':>10}"
                + (f" {'peak':>10}" if walked else "") + (f" {'recompute':>10}" if rc else ""))
        lines = [head, "-" * len(head)]
        for s in self.stages:
            span = (f"{s.nodes[0]}..{s.nodes[-1]} ({len(s.nodes)})" if len(s.nodes) > 1
                    else f"{s.nodes[0]} (1)") if s.nodes else "(empty)"
            if spans is not None:
                span = f"{spans[s.index]} ({len(s.nodes)})"
            if len(span) > 40:
                span = span[:37] + "..."
            lines.append(f"{s.index:>5}  {span:<40} {s.replicas:>8} "
                         f"{format_seconds(s.compute_s + s.sync_s):>10}"
                         + (f" {format_seconds(s.update_s):>10}" if detail else "")
                         + f" {format_seconds(s.comm_s):>10} {format_bytes(s.memory_bytes):>10}"
                         + (f" {format_bytes(s.peak_bytes or 0.0):>10}" if walked else "")
                         + (f" {format_seconds(s.recompute_s) if s.recompute else 'no':>10}"
                            if rc else ""))
        lines.append("(per minibatch: compute = forward, backward, optimizer step and weight sync "
                     "of the stage's replicas; comm = activations in and gradients back; memory "
                     "per worker" + ("; peak = the most live at once, held against the cap"
                                     if walked else "")
                     + ("; recompute = the extra forward of a stage that keeps only its inputs"
                        if rc else "") + ")")
        if detail:
            lines += self._footnotes(rc, walked)
        lines.append("")
        workers = self.cluster.get("workers")
        how = ("pipedream, by the planner's bottleneck" if self.time_source == "planner"
               else self.time_source)
        lines.append(f"time per minibatch: {format_seconds(self.time_per_minibatch)} on "
                     f"{self.workers_used} of {workers} workers ({self.sync} sync; {how})")
        lines.append("speedup: " + self._speedups())
        if self.throughput is not None:
            lines.append(f"throughput: {self.throughput:.1f} samples/s (batch {self.batch_size})")
        why = self._why()
        if why:
            lines.append(why)
        if self.shard == "optimizer":
            lines.append("optimizer state sharded (ZeRO-1): each replica of stage "
                         + ", ".join(str(s.index) for s in self.stages if s.replicas > 1)
                         + " keeps 1/r of it (in its memory) and broadcasts its share of the new "
                         "weights after each step (in its compute)")
        if self.shared_parameters:
            lines.append("parameters shared across stages: " + ", ".join(
                f"{k} {list(v)}" for k, v in sorted(self.shared_parameters.items()))
                + "".join(f"; stage {s.index} keeps a copy ({format_bytes(s.copy_bytes)}, in its "
                          "memory)" for s in self.stages if s.copy_bytes))
        if detail:
            lines.append(f"memory per worker priced for: {self.memory_rule.label()}"
                         + (f" (cap {format_bytes(self.cluster['memory'])})"
                            if self.cluster.get("memory") is not None else ""))
            lines.append(f"NOAM (minibatches in flight at the input stage): {self.noam}"
                         + (f"; under pipedream the trainer admits {self.window}, the fewest that "
                            "hide the plan's round trips (the memory column is for the NOAM: the "
                            "input stage holds a weight version and an activation set more per "
                            "minibatch beyond it)" if self.window else ""))
            if self.staleness:
                lines += ["", "weight staleness (steady state, per stage: own updates / global "
                          "block updates as in Randomized PipeDream):",
                          format_staleness(self.staleness)]
        elif self.cluster.get("memory") is not None:
            lines.append(f"memory cap: {format_bytes(self.cluster['memory'])} per worker, priced "
                         f"for {self.memory_rule.label()}")
        return "\n".join(lines)

    def _speedups(self) -> str:
        """Against data parallelism on every worker, and against one worker alone."""
        out = (f"{self.speedup_over_data_parallel:.2f}x over data parallelism on "
               f"{self.cluster.get('workers')} workers ({format_seconds(self.data_parallel_time)} "
               "per minibatch)")
        one = self.speedup_over_one_worker
        if one is not None:
            out += (f", {one:.2f}x over one worker ({format_seconds(self.one_worker_time or 0.0)})")
        return out

    def _why(self) -> str:
        """One line where the plan is not a pipeline on every worker: why not."""
        workers = self.cluster.get("workers")
        if self.workers_used < (workers or 0):
            return (f"This plan uses {self.workers_used} of the {workers} workers: none on more "
                    "is faster here (their all-reduces and messages cost more than they save); "
                    f"in a {workers}-process job the other ranks idle.")
        if self.is_data_parallel and (workers or 0) > 1:
            st = self.stages[0]
            return (f"This plan is plain data parallelism on {workers} workers: no pipeline is "
                    f"faster here (per minibatch: compute {format_seconds(st.compute_s)}, weight "
                    f"sync {format_seconds(st.sync_s)}; a pipeline pays for its messages and "
                    "its imbalance).")
        return ""

    def _footnotes(self, rc: bool, walked: bool) -> list[str]:
        out = ["(update = the optimizer step, included in compute)"]
        if any(s.overhead_s for s in self.stages):
            out.append("(compute includes the runtime's overheads per minibatch: "
                       + ", ".join(f"stage {s.index} {format_seconds(s.overhead_s)}"
                                   for s in self.stages)
                       + "; its calls, messages and stash copies, fxpipe.costmodel.overheads, "
                       "and what it makes again from the model's inputs, "
                       "fxpipe.passes.made_here)")
        if walked:
            out.append("(memory = weights, gradients, optimizer state, stashed versions and "
                       "activations held between actions, as the schedule's rule prices them; "
                       "peak = the most live at once, walked through the schedule's actions: "
                       "with the receive buffers posted ahead, sends not yet proven received, "
                       "the backward's working set and the optimizer step's temporaries; the "
                       "cap is held against the peak)")
        if rc:
            out.append("(recompute = the extra forward of activation recomputation, included in "
                       "compute; such a stage keeps only its inputs per minibatch in flight)")
        return out

    # --- serialisation -----------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["stages"] = [{**asdict(s), "nodes": list(s.nodes)} for s in self.stages]
        d["shared_parameters"] = {k: list(v) for k, v in self.shared_parameters.items()}
        d["staleness"] = {k: [list(p) for p in v] for k, v in self.staleness.items()}
        d["memory_rule"] = self.memory_rule.to_dict()
        return {"format": PLAN_FORMAT, **d}

    @classmethod
    def from_dict(cls, d: Any, origin: str = "<dict>") -> Plan:
        if not isinstance(d, dict):
            raise PlanFormatError(f"{origin}: a plan must be a JSON object")
        if d.get("format") != PLAN_FORMAT:
            raise PlanFormatError(f"{origin}: field 'format' is {d.get('format')!r}, expected "
                                  f"{PLAN_FORMAT!r}", "make plans with fxpipe.passes.partition()")
        stages_raw = _get(d, "stages", list, origin)
        stages = []
        for i, sd in enumerate(stages_raw):
            where = f"{origin}: stages[{i}]"
            if not isinstance(sd, dict):
                raise PlanFormatError(f"{where} must be an object")
            kw: dict[str, Any] = {}
            for f in fields(StagePlan):
                if f.name == "nodes":
                    nodes = _get(sd, "nodes", list, where)
                    if not all(isinstance(x, str) for x in nodes):
                        raise PlanFormatError(f"{where}: field 'nodes' must be a list of names")
                    kw["nodes"] = tuple(nodes)
                elif (f.name in ("update_s", "recompute_s", "overhead_s", "copy_bytes")
                      and f.name not in sd):
                    kw[f.name] = 0.0  # written before the update / recomputation / overheads
                elif f.name == "recompute":
                    kw[f.name] = _get(sd, f.name, bool, where) if f.name in sd else False
                elif f.name in ("state_bytes", "kept_input_bytes", "peak_bytes"):
                    kw[f.name] = _num(sd, f.name, where) if sd.get(f.name) is not None else None
                elif f.name in ("index", "replicas", "in_flight"):
                    kw[f.name] = _get(sd, f.name, int, where)
                else:
                    kw[f.name] = _num(sd, f.name, where)
            stages.append(StagePlan(**kw))
        shared = _get(d, "shared_parameters", dict, origin)
        try:
            shared_t = {str(k): tuple(int(x) for x in v) for k, v in shared.items()}
        except (TypeError, ValueError):
            raise PlanFormatError(f"{origin}: field 'shared_parameters' must map names to stage "
                                  "index lists") from None
        bs = d.get("batch_size")
        if bs is not None and (isinstance(bs, bool) or not isinstance(bs, int)):
            raise PlanFormatError(f"{origin}: field 'batch_size' must be an integer or null")
        fp = d.get("model_fingerprint")
        if fp is not None and not isinstance(fp, str):
            raise PlanFormatError(f"{origin}: field 'model_fingerprint' must be a string or null")
        return cls(stages=tuple(stages), cluster=_get(d, "cluster", dict, origin),
                   sync=_get(d, "sync", str, origin),
                   time_per_minibatch=_num(d, "time_per_minibatch", origin),
                   noam=_get(d, "noam", int, origin),
                   data_parallel_time=_num(d, "data_parallel_time", origin), batch_size=bs,
                   shared_parameters=shared_t, model_fingerprint=fp,
                   profile_source=_get(d, "profile_source", str, origin),
                   workers_used=_get(d, "workers_used", int, origin),
                   staleness=_staleness(d.get("staleness", {}), len(stages), origin),
                   memory_rule=(MemoryRule.from_dict(d["memory_rule"], origin)
                                if "memory_rule" in d else PIPEDREAM),
                   time_source=_get(d, "time_source", str, origin) if "time_source" in d
                   else "planner",
                   window=_get(d, "window", int, origin) if d.get("window") is not None
                   else None,
                   one_worker_time=(_num(d, "one_worker_time", origin)
                                    if d.get("one_worker_time") is not None else None),
                   shard=_shard(d.get("shard"), origin))

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write JSON atomically (temporary file, then rename), so readers never see half a plan."""
        write_json_atomic(path, self.to_dict())

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Plan:
        d = read_json(path, PlanFormatError, "plan", "pass a file written by Plan.save()")
        return cls.from_dict(d, origin=repr(str(path)))


def _shard(raw: Any, where: str) -> str | None:
    if raw not in (None, "optimizer"):
        raise PlanFormatError(f"{where}: field 'shard' must be null or \"optimizer\", got {raw!r}")
    return raw


def _staleness(raw: Any, num_stages: int, where: str) -> dict[str, tuple[tuple[int, int], ...]]:
    """The optional ``staleness`` field: schedule -> one [own, global] pair of non-negative
    integers per stage (absent in plans written before it existed)."""
    bad = PlanFormatError(f"{where}: field 'staleness' must map schedule names to one [own, "
                          f"global] pair of non-negative integers per stage ({num_stages})",
                          "re-plan, or delete the field: it is recomputed by fxpipe.compile")
    if not isinstance(raw, dict):
        raise bad
    out: dict[str, tuple[tuple[int, int], ...]] = {}
    for name, pairs in raw.items():
        if not isinstance(pairs, list) or len(pairs) != num_stages:
            raise bad
        for p in pairs:
            if (not isinstance(p, list) or len(p) != 2
                    or any(isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in p)):
                raise bad
        out[str(name)] = tuple((p[0], p[1]) for p in pairs)
    return out


def format_staleness(table: Mapping[str, Sequence[Sequence[int]]], max_stages: int = 8) -> str:
    """Rows of ``own/global`` per stage, one per schedule (the worst stage only for pipelines
    deeper than ``max_stages``)."""
    S = max(len(v) for v in table.values())
    wide = S <= max_stages
    cols = [f"stage {s}" for s in range(S)] if wide else ["worst stage"]
    w = max(len(k) for k in table) + 2
    lines = [f"{'schedule':<{w}}" + "".join(f"{c:>10}" for c in cols)]
    for name, pairs in table.items():
        cells = ([f"{o}/{g}" for o, g in pairs] if wide else
                 [f"{max(o for o, _ in pairs)}/{max(g for _, g in pairs)}"])
        lines.append(f"{name:<{w}}" + "".join(f"{c:>10}" for c in cells))
    return "\n".join(lines)


def _get(d: dict[str, Any], key: str, typ: type, where: str) -> Any:
    if key not in d:
        raise PlanFormatError(f"{where}: missing field {key!r}")
    v = d[key]
    if not isinstance(v, typ) or (typ is int and isinstance(v, bool)):
        raise PlanFormatError(f"{where}: field {key!r} must be {typ.__name__}, got {v!r}")
    return v


def _num(d: dict[str, Any], key: str, where: str) -> float:
    if key not in d:
        raise PlanFormatError(f"{where}: missing field {key!r}")
    v = d[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v) or v < 0:
        raise PlanFormatError(f"{where}: field {key!r} must be a non-negative number, got {v!r}")
    return float(v)
