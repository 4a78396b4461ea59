"""NCCL safety without a GPU: the global message order (commplan) and the checker that replays
recorded host calls under NCCL's rules (order-matched p2p, one stream per rank, a send completes
only when its receive runs, a host blocks on its waits).

The checker is shown to reject (1) hand-written logs with each kind of fault, (2) the order the
executor used before this plan (receives pre-posted two actions ahead, reconstructed from that
code: the GPU deadlock of the issue) and (3) a plausible mistake in the plan itself; and to
accept the plan for every schedule kind on chains and skip connections with up to 4 stages.
Every distributed run of the test suite (rt_spawn.run_jobs) is checked from its real logs too.
"""
from __future__ import annotations

import itertools

import pytest

from fxpipe.runtime.schedules.commplan import (MODEL, CommOrderError, StageLinks, action_messages,
                                               comm_plans)
from fxpipe.runtime.schedules.ncclcheck import check_logs, plan_logs
from fxpipe.runtime.schedules.schedule import Schedule
from fxpipe.runtime.schedules.kinds import make_schedule


def chain(stages: int, skip: bool = False) -> list[StageLinks]:
    """A linear pipeline; ``skip``: stage 0 also feeds the last stage (like SkipMLP's h1)."""
    out = []
    for s in range(stages):
        ins, src = (("x",), (MODEL,)) if s == 0 else ((f"h{s - 1}",), (s - 1,))
        outs, cons = ((f"h{s}",), ((s + 1,),)) if s < stages - 1 else (("y",), ((MODEL,),))
        out.append(StageLinks(ins, src, outs, cons))
    if skip and stages >= 3:
        out[0] = StageLinks(("x",), (MODEL,), ("h0", "k"), ((1,), (stages - 1,)))
        last = out[-1]
        out[-1] = StageLinks(last.inputs + ("k",), last.sources + (0,), last.outputs,
                             last.consumers)
    return out


def index_of(links: list[StageLinks]) -> dict[str, int]:
    vals = [n for st in links for n, c in zip(st.outputs, st.consumers)
            if any(x != MODEL for x in c)]
    return {n: i for i, n in enumerate(vals)}


def always(name: str, k: int) -> bool:
    return True


def replica_allreduces(sched: Schedule):
    """The executor's collectives at U: one all-reduce over the stage's replicas."""
    gid = {r: i for i, r in enumerate(sched.ranks)}
    seq: dict[tuple[int, int], int] = {}

    def events(rank, i, a):
        s = rank[0]
        if a.kind != "U" or sched.replicas[s] < 2:
            return []
        n = seq[rank] = seq.get(rank, -1) + 1
        members = tuple(gid[(s, j)] for j in range(sched.replicas[s]))
        return [("coll", str(s), n, members, 10), ("cwait", str(s), n)]
    return events


# ----------------------------------------------------------------------------- hand-written
def p2p(n: int, send: bool, peer: int, tag: int) -> tuple:
    return ("p2p", n, ((send, peer, tag, (4, 2), "torch.float32"),))


def test_a_gradient_receive_posted_before_the_activation_send_deadlocks() -> None:
    """The issue's first-minibatch deadlock: stage 0 pre-posts its gradient receive, then
    sends the activation; stage 1 waits for the activation before it can send the gradient.
    Gloo (tags) runs this; NCCL (order, one stream) cannot."""
    logs = {0: [p2p(0, False, 1, 1), p2p(1, True, 1, 0), ("wait", 0), ("flush",)],
            1: [p2p(0, False, 0, 0), ("wait", 0), p2p(1, True, 0, 1), ("flush",)]}
    with pytest.raises(CommOrderError, match="deadlock"):
        check_logs(logs)
    logs[0][:2] = [p2p(0, True, 1, 0), p2p(1, False, 1, 1)]  # send first: fine
    logs[0][2] = ("wait", 1)
    assert check_logs(logs) == 4


def test_messages_paired_out_of_order_are_named() -> None:
    """Two values sent in one order and received in the other: same shapes, so NCCL would
    silently swap them; the checker compares the tags of each order-matched pair."""
    logs = {0: [p2p(0, True, 1, 0), p2p(1, True, 1, 2), ("flush",)],
            1: [p2p(0, False, 0, 2), p2p(1, False, 0, 0), ("wait", 0), ("wait", 1)]}
    with pytest.raises(CommOrderError, match="rank 0 -> rank 1: send #0"):
        check_logs(logs)


def test_unmatched_and_mismatched_collectives_are_caught() -> None:
    base = {0: [("coll", "0", 0, (0, 1), 10), ("cwait", "0", 0)],
            1: [("coll", "0", 0, (0, 1), 10), ("cwait", "0", 0)]}
    assert check_logs(base) == 0
    sizes = {0: base[0], 1: [("coll", "0", 0, (0, 1), 12), ("cwait", "0", 0)]}
    with pytest.raises(CommOrderError, match="collective #0 of group 0"):
        check_logs(sizes)
    with pytest.raises(CommOrderError):
        check_logs({0: base[0], 1: [p2p(0, False, 0, 0), ("wait", 0)]})
    with pytest.raises(CommOrderError, match="1 sends but 0 receives"):
        check_logs({0: [p2p(0, True, 1, 0), ("flush",)], 1: []})


# ----------------------------------------------------------------------------- seeded bugs
def preposting_logs(links: list[StageLinks], sched: Schedule, index: dict[str, int]) -> dict:
    """The order the executor used before the global plan (read off its code): at action i
    the receives of actions i..i+2 (F/B) not posted yet, in list order, one call each; the
    action's own receives waited; its sends posted after the compute."""
    gid = {r: i for i, r in enumerate(sched.ranks)}
    nv = len(index)
    out = {}
    for rank in sched.ranks:
        acts = sched.actions[rank]
        fb = [i for i, a in enumerate(acts) if a.kind != "U"]
        log, ids, posted = [], {}, set()
        for i, a in enumerate(acts):
            for j in [j for j in fb if j >= i][:3]:
                if j in posted:
                    continue
                posted.add(j)
                for m in action_messages(links, sched.owner, rank, acts[j], index, always)[0]:
                    ids[m] = len(log)
                    log.append(p2p(len(log), False, gid[m.peer],
                                   (m.minibatch * nv + m.value) * 2 + m.direction))
            recvs, sends = action_messages(links, sched.owner, rank, a, index, always)
            log.extend(("wait", ids[m]) for m in recvs)
            for m in sends:
                log.append(p2p(len(log), True, gid[m.peer],
                               (m.minibatch * nv + m.value) * 2 + m.direction))
        out[gid[rank]] = log + [("flush",)]
    return out


@pytest.mark.parametrize("kind", ["pipedream", "1f1b-flush", "gpipe"])
def test_the_old_preposting_order_is_rejected(kind: str) -> None:
    links = chain(2)
    sched = make_schedule(kind, [1, 1], 8, microbatches=4 if kind != "pipedream" else None)
    with pytest.raises(CommOrderError, match="deadlock"):
        check_logs(preposting_logs(links, sched, index_of(links)))
    assert check_logs(plan_logs(links, sched, index_of(links), always)) == 2 * 2 * 8


def test_a_plan_ordered_by_the_receivers_actions_is_rejected(monkeypatch) -> None:
    """Mutation of the plan: order each receive by the RECEIVING action's position instead of
    the sending one's. On a skip connection (stage 0 -> stage 3) the checker catches it."""
    from fxpipe.runtime.schedules import commplan

    links = chain(4, skip=True)
    sched = make_schedule("pipedream", [1, 1, 1, 1], 12)
    check_logs(plan_logs(links, sched, index_of(links), always))
    real, original = commplan.execution_order, commplan.StretchPlanner.window

    def mutated(self, sched_, order_):
        plans = original(self, sched_, order_)
        order = real(sched_)
        pos = {(r, sched_.actions[r][i].kind, sched_.actions[r][i].minibatch): p
               for p, (r, i) in enumerate(order)}
        out = {}
        for rank, plan in plans.items():
            def key(m):
                kind = "F" if m.direction == 0 else "B"
                return (pos[(rank, kind, m.minibatch)], m.peer, m.direction, m.value)
            out[rank] = commplan.RankPlan(plan.recvs, plan.sends, tuple(sorted(plan.ops, key=key)),
                                          (), plan.starts, plan.lead)
        return out

    monkeypatch.setattr(commplan.StretchPlanner, "window", mutated)
    with pytest.raises(CommOrderError):
        check_logs(plan_logs(links, sched, index_of(links), always))


# ----------------------------------------------------------------------------- the plan
SHAPES = [(reps, skip) for n in (2, 3, 4) for reps in itertools.product((1, 2, 3), repeat=n)
          if sum(reps) <= 8 for skip in ((False, True) if n >= 3 else (False,))]


@pytest.mark.parametrize("kind", ["pipedream", "1f1b-flush", "gpipe", "2bw", "zb-h1", "zb-h2"])
def test_plan_is_nccl_safe_for_every_shape(kind: str) -> None:
    checked = 0
    for reps, skip in SHAPES:
        links = chain(len(reps), skip)
        m = None if kind == "pipedream" else max(sum(reps), 4)
        sched = make_schedule(kind, list(reps), 3 * m if m else 24, microbatches=m)
        logs = plan_logs(links, sched, index_of(links), always,
                         collectives=replica_allreduces(sched))
        assert check_logs(logs) > 0
        checked += 1
    assert checked == len(SHAPES) == 161


def test_plan_lists_each_actions_messages_in_the_global_order() -> None:
    links = chain(3, skip=True)
    sched = make_schedule("pipedream", [2, 1, 1], 8)
    plans = comm_plans(links, sched, index_of(links), always)
    for rank, plan in plans.items():
        flat = [m for msgs in (*plan.recvs, *plan.sends) for m in msgs]
        assert sorted(flat) == sorted(plan.ops) and len(set(plan.ops)) == len(plan.ops)
        for sends in plan.sends:  # an action's sends keep their relative order
            where = [plan.ops.index(m) for m in sends]
            assert where == sorted(where)
    # sender and receiver agree on where every message sits in each pair's sequence
    for a, b in itertools.permutations(sched.ranks, 2):
        sent = [(m.minibatch, m.value) for m in plans[a].ops if m.send and m.peer == b]
        got = [(m.minibatch, m.value) for m in plans[b].ops if not m.send and m.peer == a]
        assert sent == got


@pytest.mark.parametrize("kind", ["zb-h1", "zb-h2"])
def test_weight_actions_carry_no_messages(kind: str) -> None:
    """W computes weight gradients only: the zero-bubble kinds send exactly the messages of
    1f1b-flush on the same shape (one activation and one gradient per cut and minibatch)."""
    links = chain(3, skip=True)
    zb = make_schedule(kind, [1, 2, 1], 16, microbatches=8)
    flush = make_schedule("1f1b-flush", [1, 2, 1], 16, microbatches=8)
    plans = comm_plans(links, zb, index_of(links), always)
    for rank, plan in plans.items():
        for a, r, s in zip(zb.actions[rank], plan.recvs, plan.sends):
            if a.kind == "W":
                assert r == () and s == ()
    base = comm_plans(links, flush, index_of(links), always)
    assert {r: sorted(p.ops) for r, p in plans.items()} == {r: sorted(p.ops)
                                                             for r, p in base.items()}
