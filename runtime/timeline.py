"""What each rank did when: timeline events, their Chrome/Perfetto trace and busy fractions.

Ranks stamp spans from a start taken after a common barrier (compute spans on the device's stream
given a ``device_clock``); group one update's spans by ``args["update"]``, not by name or count.
"""
from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Protocol, Sequence

from fxpipe.errors import ConfigError

log = logging.getLogger(__name__)

CATEGORIES = ("forward", "backward", "send", "recv", "allreduce", "optimizer", "idle")
COMPUTE = frozenset({"forward", "backward", "optimizer"})
_TID = {c: i for i, c in enumerate(CATEGORIES)}
_BACKGROUND_TID = len(_TID) + 1


@dataclass(frozen=True)
class TimelineEvent:
    """One interval of one rank: ``category`` (one of CATEGORIES), ``name`` ("F3", "B3",
    "U0", "send act h", ...), seconds since the common start, and free-form ``args`` (stage,
    replica, minibatch, ...)."""

    category: str
    name: str
    start: float
    end: float
    args: Mapping[str, Any] = field(default_factory=dict)

    @property
    def duration(self) -> float:
        return self.end - self.start


class DeviceClock(Protocol):
    """Marks on a device's stream, read back as host seconds (docs/design-notes.md)."""

    def mark(self) -> Any: ...

    def seconds(self, mark: Any) -> float: ...


class Recorder:
    """Collects one rank's events. ``enabled=False`` makes :meth:`span` a no-op (no overhead
    beyond a clock read per call). ``device_clock``: time compute spans on the device."""

    def __init__(self, t0: float | None = None, *, enabled: bool = True,
                 args: Mapping[str, Any] | None = None,
                 device_clock: DeviceClock | None = None) -> None:
        self.t0 = time.perf_counter() if t0 is None else t0
        self.enabled = enabled
        self.base_args = dict(args or {})
        self.events: list[TimelineEvent] = []
        self.device_clock = device_clock
        self._marked: list[tuple[str, str, Any, Any, dict[str, Any]]] = []

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def add(self, category: str, name: str, start: float, end: float, **args: Any) -> None:
        """Record an interval measured by the caller with :meth:`now`."""
        if self.enabled:
            self.events.append(TimelineEvent(category, name, start, end,
                                             {**self.base_args, **args}))

    def span(self, category: str, name: str, **args: Any) -> _Span:
        """``with rec.span("forward", "F3", minibatch=3): ...`` records the block."""
        if self.device_clock is not None and self.enabled and category in COMPUTE:
            return _DeviceSpan(self, category, name, args)
        return _Span(self, category, name, args)

    def _resolve(self) -> None:
        """Turn the device marks into events (reading them waits for the device once)."""
        clock = self.device_clock
        for category, name, m0, m1, args in self._marked:
            assert clock is not None
            self.add(category, name, clock.seconds(m0) - self.t0, clock.seconds(m1) - self.t0,
                     **args)
        self._marked.clear()

    def finish(self, min_gap_s: float = 1e-5) -> list[TimelineEvent]:
        """The events sorted by start, with ``idle`` events for gaps longer than ``min_gap_s``."""
        self._resolve()
        evs = sorted(self.events, key=lambda e: e.start)
        out: list[TimelineEvent] = []
        for prev, nxt in zip(evs, evs[1:]):
            out.append(prev)
            if nxt.start - prev.end > min_gap_s:
                out.append(TimelineEvent("idle", "idle", prev.end, nxt.start, dict(self.base_args)))
        out.extend(evs[-1:])
        return out


class _Span:
    def __init__(self, rec: Recorder, category: str, name: str, args: dict[str, Any]) -> None:
        self.rec, self.category, self.name, self.args = rec, category, name, args
        self.start = 0.0

    def __enter__(self) -> _Span:
        self.start = self.rec.now()
        return self

    def __exit__(self, *exc: object) -> None:
        self.rec.add(self.category, self.name, self.start, self.rec.now(), **self.args)


class _DeviceSpan(_Span):
    """A compute span timed by device marks (resolved in :meth:`Recorder.finish`)."""

    def __enter__(self) -> _DeviceSpan:
        assert self.rec.device_clock is not None
        self.mark = self.rec.device_clock.mark()
        return self

    def __exit__(self, *exc: object) -> None:
        assert self.rec.device_clock is not None
        self.rec._marked.append((self.category, self.name, self.mark,
                                 self.rec.device_clock.mark(), dict(self.args)))


Timeline = Mapping[int, Sequence[TimelineEvent]]
"""global rank -> its events, sorted by start (what RunResult.timeline holds)."""


def to_chrome_trace(timeline: Timeline, names: Mapping[int, str] | None = None,
                    background: Timeline | None = None) -> dict:
    """The Trace Event Format dict (docs/design-notes.md); ``names``: rank -> process label;
    ``background``: per-rank events that overlap the rank's own (bucketed all-reduces in flight
    during a backward), drawn on a track of their own."""
    events: list[dict[str, Any]] = []
    for rank in sorted(timeline):
        label = (names or {}).get(rank, f"rank {rank}")
        events.append({"name": "process_name", "ph": "M", "pid": rank, "tid": 0,
                       "args": {"name": label}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": rank, "tid": 0,
                       "args": {"sort_index": rank}})
        for cat, tid in _TID.items():
            events.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": tid,
                           "args": {"name": cat}})
        for e in timeline[rank]:
            events.append({"name": e.name, "cat": e.category, "ph": "X", "pid": rank,
                           "tid": _TID.get(e.category, len(_TID)),
                           "ts": round(e.start * 1e6, 3), "dur": round(e.duration * 1e6, 3),
                           "args": {k: _jsonable(v) for k, v in e.args.items()}})
        bg = (background or {}).get(rank, [])
        if bg:
            events.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": _BACKGROUND_TID,
                           "args": {"name": "allreduce (overlapped)"}})
        for e in bg:
            events.append({"name": e.name, "cat": e.category, "ph": "X", "pid": rank,
                           "tid": _BACKGROUND_TID, "ts": round(e.start * 1e6, 3),
                           "dur": round(e.duration * 1e6, 3),
                           "args": {k: _jsonable(v) for k, v in e.args.items()}})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_chrome_trace(timeline: Timeline, path: str | Path,
                       names: Mapping[int, str] | None = None,
                       background: Timeline | None = None) -> Path:
    """Write the trace JSON for chrome://tracing or ui.perfetto.dev; returns the path."""
    if not timeline:
        raise ConfigError("empty timeline", "run with the timeline enabled (the default)")
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_text(json.dumps(to_chrome_trace(timeline, names, background)))
    tmp.replace(p)
    log.info("wrote trace of %d ranks to %s", len(timeline), p)
    return p


def busy_fraction(timeline: Timeline, steady_state: bool = True) -> dict[int, float]:
    """Per rank: compute time (forward, backward, optimizer) / wall time of the window.

    The window is the whole span of the rank's events, or with ``steady_state`` the middle half
    of its forward/backward events (from the start of the one at a quarter to the end of the one
    at three quarters), so pipeline fill and drain do not count.
    """
    out: dict[int, float] = {}
    for rank, evs in timeline.items():
        fb = sorted((e for e in evs if e.category in ("forward", "backward")),
                    key=lambda e: e.start)
        if not evs:
            continue
        lo, hi = min(e.start for e in evs), max(e.end for e in evs)
        if steady_state and len(fb) >= 4:
            lo, hi = fb[len(fb) // 4].start, fb[math.ceil(3 * len(fb) / 4) - 1].end
        out[rank] = busy_between(evs, lo, hi, COMPUTE)
    return out


def busy_between(events: Iterable[TimelineEvent], lo: float, hi: float,
                 categories: Iterable[str] = ("forward", "backward")) -> float:
    """Fraction of [lo, hi] the events spent in ``categories`` (forward or backward compute by
    default): the one busy-fraction rule of measured and simulated timelines."""
    if hi <= lo:
        return 0.0
    cats = frozenset(categories)
    busy = sum(max(0.0, min(e.end, hi) - max(e.start, lo)) for e in events
               if e.category in cats)
    return min(1.0, busy / (hi - lo))


def of_minibatches(e: TimelineEvent, lo: int, hi: int) -> bool:
    """Is ``e`` an event of minibatch ``lo..hi-1`` (an optimizer event: of update ``lo..hi-1``)?"""
    return lo <= int(e.args.get("update" if e.category == "optimizer" else "minibatch", -1)) < hi


def minibatch_window(timeline: Timeline, lo: int, hi: int) -> dict[int, list[TimelineEvent]]:
    """Each rank's events from its first compute event of minibatches ``lo..hi-1`` to its last
    (:func:`of_minibatches`), with everything between them by time (sends, receive waits,
    idle): the steady-state window in which a rank's seconds per minibatch are counted."""
    out: dict[int, list[TimelineEvent]] = {}
    for rank, evs in timeline.items():
        tagged = [e for e in evs if e.category in COMPUTE and of_minibatches(e, lo, hi)]
        t0, t1 = min(e.start for e in tagged), max(e.end for e in tagged)
        out[rank] = [e for e in evs if e.start >= t0 and e.end <= t1]
    return out


WAITS = ("peer", "transfer", "late", "unmatched")


def wait_breakdown(timeline: Timeline) -> dict[int, dict[str, float]]:
    """Per rank, what its receive waits waited for, in seconds (issue 27): ``peer``, the peer had
    not posted the send yet (it was still computing: the pipeline's own bubble); ``late``, the
    data was ready (its send posted) before this rank posted the receive, and a transfer only
    starts once both ends have posted (gloo's rendezvous; NCCL's pairing), so the part of the
    wait that posting the receive when the data was ready would have saved; ``transfer``, the
    rest: a transfer posted in time (the link's own time); ``unmatched``, waits whose send is not
    in ``timeline``. Needs every rank's events (the senders' ``send`` spans list their messages
    as ``msgs``; a ``recv`` wait names ``src``, ``tag`` and when it was ``posted``), on clocks
    that agree (one machine, or the common start of :func:`synchronized_start`). A tag may recur
    in a later schedule: each wait takes the latest send of its message posted before it ended."""
    sent: dict[tuple[int, int, int], list[float]] = {}
    for rank, evs in timeline.items():
        for e in evs:
            if e.category == "send":
                for dst, tag in e.args.get("msgs", ()):
                    sent.setdefault((rank, int(dst), int(tag)), []).append(e.end)
    out: dict[int, dict[str, float]] = {}
    for rank, evs in timeline.items():
        acc = dict.fromkeys(WAITS, 0.0)
        for e in evs:
            if e.category != "recv" or "tag" not in e.args:
                continue
            times = [t for t in sent.get((int(e.args["src"]), rank, int(e.args["tag"])), ())
                     if t <= e.end + 1e-3]
            if not times:
                acc["unmatched"] += e.duration
                continue
            t, p = max(times), float(e.args.get("posted", e.start))
            peer = min(max(0.0, t - e.start), e.duration)
            late = min(max(0.0, p - t), e.duration - peer)
            acc["peer"] += peer
            acc["late"] += late
            acc["transfer"] += e.duration - peer - late
        out[rank] = acc
    return out


def totals(events: Iterable[TimelineEvent]) -> dict[str, float]:
    """Seconds per category (for logs and benchmark tables)."""
    out = {c: 0.0 for c in CATEGORIES}
    for e in events:
        out[e.category] = out.get(e.category, 0.0) + e.duration
    return out


def _jsonable(v: Any) -> Any:
    return v if isinstance(v, (int, float, str, bool)) or v is None else str(v)
