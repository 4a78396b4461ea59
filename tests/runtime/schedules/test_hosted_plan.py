"""The placed kinds' message order is NCCL-safe: every process issues its remote messages in
one global order (runtime/schedules/hosted_plan.py), checked by ncclcheck.check_logs under NCCL's
rules (one stream per process, order-matched); the per-rank order it replaced deadlocks there."""
from __future__ import annotations

from dataclasses import replace

import pytest

from fxpipe.runtime.schedules.commplan import (MODEL, CommOrderError, Issuer, StageLinks,
                                               comm_plans)
from fxpipe.runtime.schedules.ncclcheck import check_logs
from fxpipe.runtime.schedules.hosted_plan import placed_plan_logs
from fxpipe.runtime.schedules.placement import make_placed_schedule


def chain(S: int, skip: bool = False) -> tuple[StageLinks, ...]:
    """S stages in a line; with ``skip`` stage 0's output also feeds the last stage."""
    out = []
    for s in range(S):
        ins, srcs = ((f"x{s - 1}",), (s - 1,)) if s else (("input",), (MODEL,))
        if skip and s == S - 1 and S > 2:
            ins, srcs = ins + ("x0",), srcs + (0,)
        cons: tuple[int, ...] = (s + 1,) if s < S - 1 else (MODEL,)
        if skip and s == 0 and S > 2:
            cons = cons + (S - 1,)
        out.append(StageLinks(ins, srcs, (f"x{s}",), (cons,)))
    return tuple(out)


def index_of(links) -> dict[str, int]:
    return {st.outputs[0]: i for i, st in enumerate(links)}


@pytest.mark.parametrize("kind, P, S, m, R, skip", [
    ("interleaved-1f1b", 2, 4, 4, 1, False), ("interleaved-1f1b", 2, 3, 4, 1, True),
    ("interleaved-1f1b", 4, 8, 8, 1, True), ("interleaved-1f1b", 2, 6, 4, 1, False),
    ("zb-v", 2, 4, 4, 1, True), ("zb-v", 4, 8, 8, 1, False), ("zb-v", 3, 6, 6, 1, True),
    ("zb-v", 2, 4, 4, 2, False), ("interleaved-1f1b", 2, 3, 4, 2, True),
])
def test_the_global_process_order_passes_the_nccl_checker(kind, P, S, m, R, skip) -> None:
    placed = make_placed_schedule(kind, P, 2 * m, num_stages=S, microbatches=m, replicas=R)
    links = chain(S, skip)
    logs = placed_plan_logs(placed, links, index_of(links), lambda n, k: True)
    assert len(logs) == P * R
    assert check_logs(logs) > 0


def per_rank_logs(placed, links) -> dict[int, list]:
    """What each process would issue if every hosted rank kept its own (commplan) order, the
    ranks interleaved by the merged list: all ranks' first receives first, then step by step."""
    index = index_of(links)
    plans = comm_plans(links, placed.schedule, index, lambda n, k: True)
    where = {r: q for q, h in enumerate(placed.hosts) for r in h}
    S = placed.schedule.num_stages
    out = {}
    for p, steps in enumerate(placed.order):
        log_: list = []
        ids: dict = {}

        def post(m, r, log_=log_, ids=ids) -> None:
            if where[m.peer] == p:
                return  # local: the mailbox
            ids[(r, m)] = len(log_)
            consumer = m.peer[0] if m.send == (m.direction == 0) else r[0]
            tag = ((m.minibatch * len(index) + m.value) * 2 + m.direction) * S + consumer
            log_.append(("p2p", len(log_), ((m.send, where[m.peer], tag, (), ""),)))

        # each rank's receives as early as its own order allows (no timing): the first version
        issuers = {r: Issuer(replace(plans[r], times=()), lambda m, r=r: post(m, r),
                             lambda m, r=r: post(m, r)) for r in placed.hosts[p]}
        for iss in issuers.values():
            iss.start()
        count = {r: 0 for r in placed.hosts[p]}
        for r, _ in steps:
            i = count[r]
            count[r] += 1
            log_.extend(("wait", ids[(r, m)]) for m in plans[r].recvs[i] if where[m.peer] != p)
            for m in plans[r].sends[i]:
                issuers[r].send(m)
        log_.append(("flush",))
        out[p] = log_
    return out


def test_per_rank_orders_interleaved_in_one_process_fail_under_nccl() -> None:
    """Interleaved on 2 processes with each hosted rank issuing in its own order (what the
    hosted runtime did first): process 0's stage 2 pre-posts its receives from stage 1 while
    stage 0 sends to stage 1, so the pair's sends and receives are not in the same order on
    both ends (NCCL would pair them wrongly, or wait forever)."""
    placed = make_placed_schedule("interleaved-1f1b", 2, 4, microbatches=4)
    with pytest.raises(CommOrderError, match="NCCL pairs them by order|deadlock under NCCL"):
        check_logs(per_rank_logs(placed, chain(4)))
