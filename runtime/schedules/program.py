"""One rank's window lowered to a program: its actions, each with the messages posted before it,
the receives it waits for and the messages posted after it, in the order the rank makes them.

Lowering drives the :class:`~.commplan.Issuer` once (the receives due by each action's start,
the action's waits, the action, its sends and the receives queued behind them on their
channel). The executor carries the program out, the NCCL-rules checker's planned logs and the
memory walk read it: none of them drives the issuer, and a test holds every distributed run's
recorded posts and waits equal to the program's."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Sequence

from .commplan import Issuer, Msg, RankPlan
from .schedule import Action

__all__ = ["Program", "Step", "lower"]


@dataclass(frozen=True)
class Step:
    """Action ``index`` of the rank: ``before`` (receives come due by its start) are posted,
    ``waits`` (its receives) waited for, the action run, then ``after`` posted: its sends and
    the receives queued behind them on their channel."""

    index: int
    action: Action
    before: tuple[Msg, ...]
    waits: tuple[Msg, ...]
    after: tuple[Msg, ...]


@dataclass(frozen=True)
class Program:
    """``start``: posted before the first action; ``steps``: one per action; ``end``: posted
    after the last (receives waited for in the next window of a stretch)."""

    start: tuple[Msg, ...]
    steps: tuple[Step, ...]
    end: tuple[Msg, ...]

    def posts(self) -> Iterator[Msg]:
        """Every message the rank posts, in order."""
        yield from self.start
        for st in self.steps:
            yield from st.before
            yield from st.after
        yield from self.end


def lower(plan: RankPlan, actions: Sequence[Action]) -> Program:
    """The program of a rank's ``actions`` under its message ``plan``."""
    out: list[Msg] = []
    issuer = Issuer(plan, out.append, out.append)

    def taken() -> tuple[Msg, ...]:
        got = tuple(out)
        out.clear()
        return got

    issuer.start()
    start = taken()
    steps = []
    for i, a in enumerate(actions):
        issuer.at(i)
        before = taken()
        for m in plan.sends[i]:
            issuer.send(m)
        steps.append(Step(i, a, before, tuple(plan.recvs[i]), taken()))
    issuer.finish()
    assert issuer.done, "every planned message of the window is posted"
    return Program(start, tuple(steps), taken())
