"""The order a distributed run posts and waits for its messages is the planned one: for every
rank schedule kind, each rank's recorded host calls (activations and gradients: every post, and
every wait for a receive) equal, call for call, what ``ncclcheck.plan_logs`` derives from the
schedule without running anything (the program the simulator-side checks read). One world of
spawned ranks runs every case."""
from __future__ import annotations

from typing import Any

import pytest
from rt_helpers import batches, loss_fn, sgd, split, tiny_mlp

from fxpipe.runtime.execution.launch import RankJob, run_rank_jobs
from fxpipe.runtime.execution.wire import make_wire_plan
from fxpipe.runtime.schedules.commplan import CHANNELS, links_of
from fxpipe.runtime.schedules.kinds import make_schedule
from fxpipe.runtime.schedules.ncclcheck import plan_logs
from fxpipe.runtime.schedules.schedule import SCHEDULE_KINDS

pytestmark = [pytest.mark.multiprocess]

N = 8  # minibatches
CASES = [(kind, cuts, replicas) for kind in SCHEDULE_KINDS
         for cuts, replicas in (([2], [1, 1]), ([1, 3], [1, 1, 1]))]
CASES += [("pipedream", [2], [2, 1]), ("1f1b-flush", [2], [1, 2])]


def _always(name: str, k: int) -> bool:
    return True  # every value of tiny_mlp is floating point: each has a gradient message


def calls(log_: list[tuple], channels: set[Any]) -> list[tuple]:
    """A rank's posts of activations and gradients, one per message, and its waits for each
    received one, in the order it made them: ("post", is_send, peer, tag) and
    ("wait", peer, tag)."""
    ops: dict[Any, tuple] = {}
    out: list[tuple] = []
    for ev in log_:
        if ev[0] == "p2p" and (ev[3] if len(ev) > 3 else None) in channels:
            ops[ev[1]] = ev[2]
            out.extend(("post", bool(o[0]), o[1], o[2]) for o in ev[2])
        elif ev[0] == "wait" and ev[1] in ops:
            out.extend(("wait", o[1], o[2]) for o in ops[ev[1]] if not o[0])
    return out


@pytest.fixture(scope="module")
def runs() -> list[tuple[Any, Any, Any]]:
    jobs, cases = [], []
    for kind, cuts, replicas in CASES:
        stages = split(tiny_mlp(), cuts)
        sched = make_schedule(kind, list(replicas), N)
        jobs.append(RankJob(stages, list(replicas), sched, loss_fn, sgd, batches(N),
                            record_comm=True))
        cases.append((stages, sched))
    got = run_rank_jobs(jobs, timeout_s=30.0, join_timeout_s=400.0)
    return [(stages, sched, res) for (stages, sched), res in zip(cases, got)]


@pytest.mark.parametrize("case", range(len(CASES)),
                         ids=[f"{k}-{len(r)}stages-{r}" for k, _, r in CASES])
def test_recorded_posts_and_waits_are_the_planned_ones(runs, case: int) -> None:
    stages, sched, res = runs[case]
    wire = make_wire_plan(stages, [b[0] for b in batches(N)])
    index = {n: i for i, n in enumerate(wire.values)}
    planned = plan_logs(links_of(stages), sched, index, _always)
    channels = set(CHANNELS.values())
    assert sorted(res.comm_logs) == sorted(planned)
    for rank, log_ in res.comm_logs.items():
        want = calls(planned[rank], channels)
        got = calls(log_, channels)
        assert want, (case, rank)  # every rank of a pipeline sends or receives
        assert got == want, (case, rank, next(
            (i, g, w) for i, (g, w) in enumerate(zip(got, want)) if g != w) if got[:len(want)]
            != want[:len(got)] else (len(got), len(want)))
