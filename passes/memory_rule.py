"""What a replica holds besides its state under a plan's schedule, in shapes the solver prices.

``P (2 + opt) + stashed(v) P + sets(v, r) A`` (recomputing: ``sets X`` plus the recomputed sets of
A), nondecreasing in v; :mod:`fxpipe.runtime.pricing.memory` says which kind has which rule.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from fxpipe.errors import ConfigError, PlanFormatError

VERSIONS = ("window", "one", "none")
"""Stashed weight versions besides the live one: v - 1 (PipeDream), 1 (2BW's shadow), 0."""
RECOMPUTED = ("one", "held", "listed")
"""Full activation sets a recomputing replica holds: one while it recomputes (the backward
frees it), or as many as its held sets (zero-bubble's B recomputes and W still needs the graph,
so a recomputed set lives from B until W; the held count bounds the minibatches between them),
or as ``listed_full`` says per stage (read off an order whose Ws follow their Bs closely)."""
HELD = ("window", "window-batch", "batch", "listed")
"""Activation sets held: the window v; min(v, ceil(m / r)) (1F1B with a flush: a replica gets
ceil(m / r) of an update's m microbatches); ceil(m / r) (all of an update's, GPipe); or as
``listed`` per stage of a straight pipeline of equal replicas, whose stage s has window S - s
(read off a generated schedule whose orders no window shape describes: the placed kinds)."""


@dataclass(frozen=True)
class MemoryRule:
    """The shape of a schedule's memory (see docs/design-notes.mdstring). ``microbatches``: m per
    update for the held shapes that count them (None: the cluster's workers, the runtime's
    default m); ``split``: each minibatch cut into that many microbatches; ``limit``: at most
    this many sets per replica whatever the shape (zero-bubble H2's bound; None: no bound);
    ``recomputed``: a recomputing replica's full sets, one or every held one (:data:`RECOMPUTED`);
    ``listed``: the sets each stage holds, first stage first, for ``held="listed"``;
    ``listed_full``: the full sets each stage keeps recomputing, for ``recomputed="listed"``."""

    schedule: str = "pipedream"
    versions: str = "window"
    held: str = "window"
    microbatches: int | None = None
    split: int = 1
    limit: int | None = None
    recomputed: str = "one"
    listed: tuple[int, ...] = ()
    listed_full: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if (self.versions not in VERSIONS or self.held not in HELD
                or self.recomputed not in RECOMPUTED):
            raise ConfigError(f"memory rule versions={self.versions!r}, held={self.held!r}, "
                              f"recomputed={self.recomputed!r}",
                              f"versions: one of {VERSIONS}; held: one of {HELD}; recomputed: "
                              f"one of {RECOMPUTED}")
        for name in ("microbatches", "limit"):
            x = getattr(self, name)
            if x is not None and (isinstance(x, bool) or not isinstance(x, int) or x < 1):
                raise ConfigError(f"memory rule {name}={x!r}", "use an integer >= 1 or None")
        if isinstance(self.split, bool) or not isinstance(self.split, int) or self.split < 1:
            raise ConfigError(f"memory rule split={self.split!r}", "use an integer >= 1")
        for name, shape in (("listed", self.held), ("listed_full", self.recomputed)):
            xs = tuple(getattr(self, name))
            object.__setattr__(self, name, xs)  # a JSON list reads as a list
            if (shape == "listed") != bool(xs) or any(
                    isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in xs):
                raise ConfigError(f"memory rule {name}={xs!r} with {shape!r}",
                                  f"'listed' takes one count >= 0 per stage in {name}, and "
                                  "only it")

    @property
    def unit(self) -> float:
        """Activations of one set, as a fraction of the profiled minibatch's."""
        return 1.0 / self.split

    def stashed(self, v: int) -> float:
        """Weight versions kept besides the live one by a replica with window ``v``."""
        if self.versions == "window":
            return float(v - 1)
        return 1.0 if self.versions == "one" else 0.0

    def count(self, v: int, r: int, workers: int) -> int:
        """Sets (minibatches or microbatches) a replica with window ``v`` of a stage with ``r``
        replicas holds at once, on a cluster of ``workers``."""
        if self.held == "listed":  # stage S - v of the straight pipeline (v beyond: the first)
            n = self.listed[max(len(self.listed) - v, 0)]
            return min(n, self.limit) if self.limit is not None else n
        per_replica = math.ceil((self.microbatches or workers) / r)
        n = {"window": v, "window-batch": min(v, per_replica), "batch": per_replica}[self.held]
        return min(n, self.limit) if self.limit is not None else n

    def sets(self, v: int, r: int, workers: int) -> float:
        """:meth:`count` in units of the profiled minibatch's activations."""
        c = self.count(v, r, workers)
        return float(c) if self.split == 1 else c * self.unit

    def recomputed_sets(self, v: int, r: int, workers: int) -> float:
        """Full activation sets a recomputing replica holds at once, in units of the profiled
        minibatch's (see :data:`RECOMPUTED`)."""
        if self.recomputed == "listed":
            return self.listed_full[max(len(self.listed_full) - v, 0)] * self.unit
        return self.unit if self.recomputed == "one" else self.sets(v, r, workers)

    def label(self) -> str:
        """``1f1b-flush (m=8)``: what plan summaries say the memory is for."""
        extra = [f"m={self.microbatches}"] if self.microbatches else []
        extra += ([f"sets held per stage {'-'.join(map(str, self.listed))}"] if self.listed
                  else [])
        extra += [f"split={self.split}"] if self.split > 1 else []
        return self.schedule + (f" ({', '.join(extra)})" if extra else "")

    def to_dict(self) -> dict[str, Any]:
        """The fields; ``recomputed`` only when it is not the default, so a plan that does not
        need it still loads in fxpipe versions from before it existed."""
        d = asdict(self)
        if d["recomputed"] == "one":
            del d["recomputed"]
        for name in ("listed", "listed_full"):
            if not d[name]:
                del d[name]
            else:
                d[name] = list(d[name])
        return d

    @classmethod
    def from_dict(cls, d: Any, where: str = "<dict>") -> MemoryRule:
        if not isinstance(d, dict) or not set(d) <= {f for f in cls.__dataclass_fields__}:
            raise PlanFormatError(f"{where}: field 'memory_rule' must be an object with fields "
                                  f"{sorted(cls.__dataclass_fields__)}, got {d!r}",
                                  "re-plan, or delete the field (PipeDream's rule)")
        try:
            return cls(**d)
        except (ConfigError, TypeError) as err:
            raise PlanFormatError(f"{where}: field 'memory_rule': {err}") from None


PIPEDREAM = MemoryRule()
"""PipeDream's rule, ``(2 + opt) P + (v - 1) P + v A``: the planner's default."""
