"""Pipeline schedules as data: per-rank action lists that an executor only carries out. No torch.

A rank ``(stage, replica)`` runs ``F3``, ``B3``, ``W3`` (minibatch 3's weight gradients) and ``U2``
(update 2); version v, the weights after v updates, is what F reads, B and W reuse and U makes.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal, Mapping, Sequence

import networkx as nx

from fxpipe.errors import ConfigError

from .order import DeadlockError, OrderWalker, ScheduleError  # noqa: F401 (re-exported)

Rank = tuple[int, int]
ActionKind = Literal["F", "B", "W", "U"]
SCHEDULE_KINDS = ("pipedream", "1f1b-flush", "gpipe", "2bw", "zb-h1", "zb-h2")
SYNCHRONOUS_KINDS = ("1f1b-flush", "gpipe", "zb-h1", "zb-h2")  # flush every batch: minibatch SGD


@dataclass(frozen=True)
class Action:
    """One step of a rank.

    ``minibatch`` is the global minibatch (microbatch) index for F/B, and the rank's update number
    for U. ``version`` is the weight version involved (see module doc); None in hand-made
    schedules that do not care about versions.
    """

    kind: ActionKind
    minibatch: int
    version: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("F", "B", "W", "U"):
            raise ConfigError(f"unknown action kind {self.kind!r}", "use 'F', 'B', 'W' or 'U'")

    def __str__(self) -> str:
        return f"{self.kind}{self.minibatch}"

    @classmethod
    def parse(cls, text: str) -> Action:
        """``"F3"`` -> ``Action("F", 3)``: lets tests and users write schedules as text."""
        text = text.strip()
        if len(text) < 2 or text[0] not in "FBWU" or not text[1:].isdigit():
            raise ConfigError(f"cannot parse action {text!r}",
                              "write e.g. 'F3', 'B3', 'W3' or 'U0'")
        return cls(text[0], int(text[1:]))  # type: ignore[arg-type]


@dataclass(frozen=True)
class Schedule:
    """Immutable per-rank action lists plus the metadata needed to interpret them.

    ``group`` is the number of minibatches per weight update (m for the batched kinds, 1 for
    pipedream); ``windows[s]`` is the most minibatches in flight on one replica of stage s (=
    weight versions stashed under pipedream).
    """

    kind: str
    replicas: tuple[int, ...]
    num_minibatches: int
    actions: Mapping[Rank, tuple[Action, ...]] = field(hash=False)
    group: int = 1
    noam: int = 1
    windows: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        frozen = {tuple(r): tuple(a) for r, a in self.actions.items()}
        object.__setattr__(self, "actions", MappingProxyType(frozen))
        object.__setattr__(self, "replicas", tuple(self.replicas))
        object.__setattr__(self, "windows", tuple(self.windows))

    @property
    def num_stages(self) -> int:
        return len(self.replicas)

    @property
    def ranks(self) -> tuple[Rank, ...]:
        """All ranks in (stage, replica) order: the row order of grids and reports."""
        return tuple((s, j) for s, r in enumerate(self.replicas) for j in range(r))

    def owner(self, stage: int, minibatch: int) -> Rank:
        """The rank of ``stage`` that processes ``minibatch`` (round robin)."""
        return (stage, minibatch % self.replicas[stage])

    def forward_versions(self) -> dict[tuple[Rank, int], int | None]:
        """(rank, minibatch) -> weight version its forward reads: what weight stashing must keep."""
        return {(rank, a.minibatch): a.version
                for rank, acts in self.actions.items() for a in acts if a.kind == "F"}

    def input_versions(self) -> dict[int, int | None]:
        """minibatch -> version the input stage's forward used. Under vertical sync this version
        travels with the activations and every later stage uses it for that minibatch."""
        return {a.minibatch: a.version for (s, _), acts in self.actions.items() if s == 0
                for a in acts if a.kind == "F"}

    def with_vertical_sync(self) -> Schedule:
        """The same actions, F/B versions replaced by the input stage's (PipeDream vertical sync).

        Needs equal replica counts: a version number counts one stage's updates, and an update
        of a stage with r replicas covers r minibatches, so numbers differ across unequal stages.
        """
        if len(set(self.replicas)) > 1:
            raise ConfigError(f"vertical sync with replicas {list(self.replicas)}",
                              "version numbers are comparable only when every stage has the "
                              "same number of replicas")
        inv = self.input_versions()
        new = {rank: tuple(Action(a.kind, a.minibatch, inv[a.minibatch]) if a.kind != "U" else a
                           for a in acts) for rank, acts in self.actions.items()}
        return Schedule(self.kind + "+vsync", self.replicas, self.num_minibatches, new,
                        self.group, self.noam, self.windows)

    @classmethod
    def from_text(cls, replicas: list[int], table: Mapping[Rank, str],
                  num_minibatches: int | None = None, kind: str = "custom") -> Schedule:
        """Build a hand-written schedule, e.g. ``{(0, 0): "F0 F1 B0 U0 B1 U1", ...}``."""
        acts = {tuple(rank): tuple(Action.parse(t) for t in text.split())
                for rank, text in table.items()}
        if num_minibatches is None:
            num_minibatches = 1 + max((a.minibatch for aa in acts.values() for a in aa
                                       if a.kind != "U"), default=-1)
        return cls(kind, tuple(replicas), num_minibatches, acts)


def split_ranks(sched: Schedule) -> frozenset[Rank]:
    """The ranks whose backwards are split into B (input gradients) and W (weight gradients)."""
    return frozenset(rank for rank, acts in sched.actions.items()
                     if any(a.kind == "W" for a in acts))


# ----------------------------------------------------------------------------- building blocks
# (of the generators in fxpipe.runtime.schedules.kinds, zerobubble and placement)

def _one_f_one_b(mbs: list[int], window: int) -> list[Action]:
    """Admit ``window`` forwards, then strictly backward-oldest / next-forward, then drain."""
    out: list[Action] = []
    pending: deque[int] = deque()
    for i, k in enumerate(mbs):
        if i >= window:
            out.append(Action("B", pending.popleft()))
        out.append(Action("F", k))
        pending.append(k)
    out.extend(Action("B", k) for k in pending)
    return out


def _with_versions(acts: list[Action], forward_version) -> tuple[Action, ...]:
    """Stamp versions: U<i> makes i+1; B reuses its F's (stashing); F asks ``forward_version``."""
    seen: dict[int, int] = {}
    updates = 0
    out = []
    for a in acts:
        if a.kind == "U":
            updates += 1
            out.append(Action("U", a.minibatch, updates))
        elif a.kind == "F":
            seen[a.minibatch] = forward_version(a.minibatch, updates)
            out.append(Action("F", a.minibatch, seen[a.minibatch]))
        else:  # B and W use the forward's version
            out.append(Action(a.kind, a.minibatch, seen[a.minibatch]))
    return tuple(out)


# ----------------------------------------------------------------------------- validation

def _static_checks(sched: Schedule) -> None:
    """Rules checkable per rank: ownership, F before B, one B per F, versions, update counts."""
    S, n = sched.num_stages, sched.num_minibatches
    if set(sched.actions) != set(sched.ranks):
        raise ScheduleError(f"schedule ranks {sorted(sched.actions)} != {list(sched.ranks)}",
                            "give exactly one action list per (stage, replica)")
    seen_f = {s: set() for s in range(S)}
    for rank, acts in sched.actions.items():
        s = rank[0]
        fwd: dict[int, int | None] = {}
        bwd: set[int] = set()
        wgt: set[int] = set()
        updates = 0
        for a in acts:
            if a.kind == "W":
                _check_weight_action(a, rank, fwd, bwd, wgt)
                wgt.add(a.minibatch)
                continue
            where = f"{a} on stage {s} replica {rank[1]}"
            if a.kind == "U":
                if a.minibatch != updates or a.version not in (None, updates + 1):
                    raise ScheduleError(f"{where}: expected update U{updates}",
                                        "number a rank's updates 0, 1, 2, ...")
                updates += 1
                continue
            if not 0 <= a.minibatch < n or sched.owner(s, a.minibatch) != rank:
                raise ScheduleError(f"{where}: minibatch belongs to {sched.owner(s, a.minibatch)}"
                                    if 0 <= a.minibatch < n else f"{where}: minibatch out of range",
                                    "minibatch k runs on replica k % r of each stage")
            if a.kind == "F":
                if a.minibatch in fwd:
                    raise ScheduleError(f"{where}: forward repeated", "forward each minibatch once")
                if a.version is not None and not 0 <= a.version <= updates:
                    raise ScheduleError(f"{where}: reads version {a.version} but only "
                                        f"{updates} updates happened", "a forward can only use "
                                        "versions already produced")
                fwd[a.minibatch] = a.version
                seen_f[s].add(a.minibatch)
            else:
                if a.minibatch not in fwd:
                    raise ScheduleError(f"{where}: backward before its forward",
                                        "put F<k> before B<k> on the same rank")
                if a.minibatch in bwd:
                    raise ScheduleError(f"{where}: backward repeated", "one backward per forward")
                if a.version != fwd[a.minibatch]:
                    raise ScheduleError(f"{where}: uses version {a.version}, its forward used "
                                        f"{fwd[a.minibatch]}", "stash the forward's weights")
                bwd.add(a.minibatch)
        lacking = sorted(set(fwd) - bwd)
        if lacking:
            raise ScheduleError(f"forward of minibatch {lacking[0]} on stage {s} replica "
                                f"{rank[1]} lacks its backward", "add B<k> after F<k>")
        unsplit = sorted(bwd - wgt) if wgt else []
        if unsplit:
            raise ScheduleError(f"backward of minibatch {unsplit[0]} on stage {s} replica "
                                f"{rank[1]} has no W, but others on that rank do",
                                "a rank splits every backward into B and W, or none")
    for s in range(S):
        missing = sorted(set(range(n)) - seen_f[s])
        if missing:
            raise ScheduleError(f"minibatch {missing[0]} never runs on stage {s}",
                                "every minibatch must go through every stage")
        counts = {sum(a.kind == "U" for a in sched.actions[(s, j)])
                  for j in range(sched.replicas[s])}
        if len(counts) > 1:
            raise ScheduleError(f"replicas of stage {s} make different numbers of updates "
                                f"{sorted(counts)}", "replicas all-reduce every update together")


def _check_weight_action(a: Action, rank: Rank, fwd: Mapping[int, int | None],
                         bwd: set[int], wgt: set[int]) -> None:
    """W<k>: after this rank's B<k>, once, with its forward's weight version."""
    where = f"{a} on stage {rank[0]} replica {rank[1]}"
    if a.minibatch not in bwd:
        raise ScheduleError(f"{where}: weight gradients before the backward's input part",
                            "put B<k> before W<k> on the same rank")
    if a.minibatch in wgt:
        raise ScheduleError(f"{where}: weight gradients repeated", "one W per B")
    if a.version != fwd[a.minibatch]:
        raise ScheduleError(f"{where}: uses version {a.version}, its forward used "
                            f"{fwd[a.minibatch]}", "stash the forward's weights")


def execution_order(sched: Schedule, sync: Sequence[Sequence[int]] = (),
                    delay: int = 0) -> list[tuple[Rank, int]]:
    """Run every rank's list in order against the data dependencies; return (rank, index) in a
    valid execution order (a topological order, which ``simulate`` times), or raise
    :class:`DeadlockError` naming each stuck rank and what it waits for. F(k) on stage s needs
    F(k) on stage s-1; B(k) needs B(k) on stage s+1 (on the last stage its own F(k)); U<i> needs
    every replica of its stage at U<i>. Stages in one ``sync`` set share tied weights: with
    ``delay`` 0 their U<i> happen together (one all-reduce); with ``delay`` d > 0, U<i> of one
    of them needs U<i-d> done on every rank of the others (it applies round i-d's sum, see
    :func:`fxpipe.runtime.execution.contract.tied_delay`). The one-window case of
    :class:`~fxpipe.runtime.schedules.order.OrderWalker`."""
    walker = OrderWalker(sched.replicas, sync, delay, split_ranks(sched))
    ran = walker.extend(sched.actions)
    walker.check_done()
    nxt = {rank: 0 for rank in sched.ranks}
    order = []
    for rank, _ in ran:
        order.append((rank, nxt[rank]))
        nxt[rank] += 1
    return order


def sync_sets(stage_sets: Sequence[Sequence[int]]) -> list[tuple[int, ...]]:
    """Merge stage sets that share a stage (tied parameters chain stages together): the
    connected components, each sorted, in sorted order (an empty set stays its own)."""
    graph: nx.Graph = nx.Graph()
    for stages in stage_sets:
        graph.add_nodes_from(stages)
        nx.add_path(graph, stages)
    empty = [()] * sum(1 for stages in stage_sets if not stages)
    return sorted(empty + [tuple(sorted(c)) for c in nx.connected_components(graph)])


def tie_delay(sched: Schedule, tie_stage_sets: Sequence[Sequence[int]]) -> int:
    """Rounds by which tied weights' updates lag their gradients under ``sched`` (0 for the
    flushing kinds and when nothing is tied): the largest difference of in-flight windows
    between the lowest and highest stage of a set. See
    ``fxpipe.runtime.execution.contract.tied_delay`` for why; pure, so the plan simulator prices the
    same delay the runtime uses."""
    if not tie_stage_sets or not sched.kind.startswith("pipedream") or not sched.windows:
        return 0
    return max(max(0, sched.windows[min(c)] - sched.windows[max(c)]) for c in tie_stage_sets)


def tie_by_messages(stages: Sequence[int], replicas: Sequence[int], delay: int) -> bool:
    """Whether a tie of ``stages`` is summed by two messages instead of an all-reduce: two
    stages of one replica each, summed at the update (``delay`` 0). The runtime sums it so
    (``fxpipe.runtime.execution.comm.Comm.tied_send``), the simulator and the memory walk
    price it so."""
    return delay == 0 and len(stages) == 2 and all(replicas[s] == 1 for s in stages)


def uneven_tied_updates(sched: Schedule, tie_stage_sets: Sequence[Sequence[int]]
                        ) -> dict[Rank, int] | None:
    """Updates per rank of the first set of stages sharing a weight whose ranks update unequally
    often under ``sched`` (None when every set is even). Their updates are one all-reduce, so
    such a plan cannot run (pipedream with unequal replica counts: a stage of r replicas
    updates once per r minibatches); the runtime refuses it and the simulator prices none."""
    for c in tie_stage_sets:
        counts = {rank: sum(a.kind == "U" for a in sched.actions[rank]) for rank in sched.ranks
                  if rank[0] in c}
        if len(set(counts.values())) > 1:
            return counts
    return None


def validate(sched: Schedule) -> None:
    """Raise :class:`ScheduleError` (or :class:`DeadlockError`) unless an in-order executor can
    carry ``sched`` out to the end with consistent weight versions."""
    _static_checks(sched)
    execution_order(sched)
