"""schedules/program.py: a rank's window lowered to its program (the posts and waits around each
action). A literal table for one small case, worked out by hand from the issuer's rule, and the
program's invariants for every kind on chains and skip connections of 2 to 4 stages."""
from __future__ import annotations

import pytest
from test_runtime_commplan import always, chain, index_of

from fxpipe.runtime.schedules.commplan import comm_plans
from fxpipe.runtime.schedules.kinds import make_schedule
from fxpipe.runtime.schedules.program import lower
from fxpipe.runtime.schedules.schedule import SCHEDULE_KINDS


def _names(msgs) -> list[str]:
    return [("send " if m.send else "recv ") + f"{m.name}@{m.minibatch}" for m in msgs]


def test_gpipe_on_two_stages_by_hand() -> None:
    """gpipe, 2 stages, 2 minibatches, unit costs: stage 1's F0 starts at t=1 and stage 0's B0 at
    t=5, each within LEAD (2 stage-minibatches of the plan's timing) of its rank's first action,
    so both channels' receives are posted before the first action; each computing action waits
    for its own receive, and each F of stage 0 (B of stage 1) posts its send right after it."""
    links = chain(2)
    sched = make_schedule("gpipe", [1, 1], 2)
    plans = comm_plans(links, sched, index_of(links), always)
    table = {}
    for rank in sched.ranks:
        p = lower(plans[rank], sched.actions[rank])
        assert p.start == () and p.end == ()
        table[rank] = [(str(st.action), _names(st.before), _names(st.waits), _names(st.after))
                       for st in p.steps]
    assert table[(0, 0)] == [
        ("F0", ["recv h0@0", "recv h0@1"], [], ["send h0@0"]),
        ("F1", [], [], ["send h0@1"]),
        ("B0", [], ["recv h0@0"], []),
        ("B1", [], ["recv h0@1"], []),
        ("U0", [], [], []),
    ]
    assert table[(1, 0)] == [
        ("F0", ["recv h0@0", "recv h0@1"], ["recv h0@0"], []),
        ("F1", [], ["recv h0@1"], []),
        ("B0", [], [], ["send h0@0"]),
        ("B1", [], [], ["send h0@1"]),
        ("U0", [], [], []),
    ]


@pytest.mark.parametrize("kind", SCHEDULE_KINDS)
@pytest.mark.parametrize("stages, skip", [(2, False), (3, False), (3, True), (4, True)])
def test_the_program_posts_each_message_once_before_its_wait(kind: str, stages: int,
                                                             skip: bool) -> None:
    links = chain(stages, skip=skip)
    sched = make_schedule(kind, [1] * stages, 4 * stages)
    plans = comm_plans(links, sched, index_of(links), always)
    for rank in sched.ranks:
        plan, program = plans[rank], lower(plans[rank], sched.actions[rank])
        posts = list(program.posts())
        assert sorted(posts, key=plan.ops.index) == list(plan.ops)  # each once...
        for d in {m.direction for m in plan.ops}:  # ...in the global order, channel by channel
            assert [m for m in posts if m.direction == d] == [m for m in plan.ops
                                                               if m.direction == d]
        seen = set(program.start)
        for step in program.steps:
            assert step.action == sched.actions[rank][step.index]
            seen.update(step.before)
            assert step.waits == tuple(plan.recvs[step.index])
            assert all(m in seen for m in step.waits), (rank, step)  # posted before waited for
            assert [m for m in step.after if m.send] == list(plan.sends[step.index])
            assert not any(m.send for m in step.before)  # a send goes only after its action
            seen.update(step.after)
        assert not any(m.send for m in (*program.start, *program.end))
