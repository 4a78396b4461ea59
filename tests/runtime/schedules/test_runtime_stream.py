"""A stretch of an asynchronous schedule, a window at a time (issue 27): the windows are the
stretch's one schedule cut up, each executable without a later one, and its messages are posted
early enough for transfers to overlap compute, in an order NCCL accepts."""
from __future__ import annotations

import itertools
import random

import pytest

from fxpipe.errors import ConfigError
from fxpipe.runtime.schedules.commplan import MODEL, StageLinks, StretchPlanner
from fxpipe.runtime.schedules.ncclcheck import check_logs, plan_logs
from fxpipe.runtime.schedules.kinds import make_schedule
from fxpipe.runtime.schedules.order import OrderWalker
from fxpipe.runtime.schedules.schedule import Action, execution_order
from fxpipe.runtime.schedules.stream import ScheduleStream, Window

SHAPES = [[1], [2], [1, 1], [2, 1], [1, 2], [2, 2], [3, 1, 2], [1, 1, 1, 1], [1] * 8, [3, 2],
          [1, 3], [1, 3, 1], [2, 3, 1], [1, 1, 4]]


def chain(stages: int) -> list[StageLinks]:
    out = []
    for s in range(stages):
        ins, src = (("x",), (MODEL,)) if s == 0 else ((f"h{s - 1}",), (s - 1,))
        outs, cons = ((f"h{s}",), ((s + 1,),)) if s < stages - 1 else (("y",), ((MODEL,),))
        out.append(StageLinks(ins, src, outs, cons))
    return out


def index_of(links: list[StageLinks]) -> dict[str, int]:
    return {f"h{s}": s for s in range(len(links) - 1)}


def always(name: str, k: int) -> bool:
    return True


def cut_up(kind: str, reps: list[int], n: int, sizes: list[int], m: int | None = None,
           vsync: bool = False) -> list[Window]:
    """The windows of a stretch of ``n`` minibatches, of the given sizes, then the final one."""
    stream = ScheduleStream(kind, reps, microbatches=m, vertical_sync=vsync)
    out, pos = [], 0
    for size in sizes:
        out.append(stream.window(size))
        pos += size
    out.append(stream.window(n - pos, final=True))
    return out


def random_sizes(rng: random.Random, n: int) -> list[int]:
    sizes, pos = [], 0
    while True:
        step = rng.randint(1, 12)
        if pos + step >= n:
            return sizes
        sizes.append(step)
        pos += step


# ----------------------------------------------------------------------------- the windows
def test_windows_of_a_two_stage_stretch_literally() -> None:
    """pipedream on 2 stages, 6 minibatches read 2 at a time: each rank's list cut after its
    last forward of a window's minibatches (stage 0 admits 2, stage 1 one)."""
    ws = cut_up("pipedream", [1, 1], 6, [2, 2])
    text = [{r: " ".join(str(a) for a in w.actions[r]) for r in w.ranks} for w in ws]
    assert text == [{(0, 0): "F0 F1", (1, 0): "F0 B0 U0 F1"},
                    {(0, 0): "B0 U0 F2 B1 U1 F3", (1, 0): "B1 U1 F2 B2 U2 F3"},
                    {(0, 0): "B2 U2 F4 B3 U3 F5 B4 U4 B5 U5", (1, 0): "B3 U3 F4 B4 U4 F5 B5 U5"}]
    assert [(w.start, w.stop, w.final) for w in ws] == [(0, 2, False), (2, 4, False),
                                                         (4, 6, True)]
    assert [a.version for a in ws[1].actions[(0, 0)]] == [0, 1, 1, 0, 2, 2]  # B1: F1's
    assert ws[0].ahead[(0, 0)][:2] == (Action("B", 0, 0), Action("U", 0, 1))
    assert ws[2].ahead == {}


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["pipedream", "2bw"])
def test_windows_concatenate_to_the_stretch_and_run_alone(kind: str) -> None:
    """For every shape, vertical sync, batch size and random cuts: the windows' actions, rank
    by rank, are make_schedule's for the whole stretch, and each window runs to its end given
    the earlier ones (nothing waits for a later window)."""
    rng = random.Random(0)
    checked = 0
    for reps in SHAPES:
        for vsync in (False, True) if len(set(reps)) == 1 else (False,):
            for m in ([None] if kind == "pipedream" else [sum(reps), 2 * sum(reps) + 1]):
                for n in range(0, 40, 3):
                    sizes = random_sizes(rng, n)
                    ws = cut_up(kind, reps, n, sizes, m, vsync)
                    full = make_schedule(kind, reps, n, microbatches=m)
                    full = full.with_vertical_sync() if vsync else full
                    walker = OrderWalker(reps)
                    for w in ws:
                        walker.extend(w.actions)
                        assert not walker.stuck, (reps, n, sizes)
                        assert sorted(r for r, _ in w.order) == sorted(
                            r for r in w.ranks for _ in w.actions[r])
                    for r in full.ranks:
                        got = tuple(itertools.chain(*(w.actions[r] for w in ws)))
                        assert got == full.actions[r], (reps, vsync, m, n, sizes, r)
                    checked += 1
    assert checked == (280 if kind == "pipedream" else 560)


def test_a_forward_may_wait_for_the_next_window_when_no_cut_fits() -> None:
    """Replicas [1, 3, 1]: stage 1 keeps 6 minibatches in flight over its replicas, stage 0 5,
    so a cut before stage 0's forward of the window's last minibatch would leave a gradient
    stage 0 waits for beyond the window: that forward moves to the next window instead of the
    window waiting for it (the data of its minibatch stays with the rank until then)."""
    ws = cut_up("pipedream", [1, 3, 1], 24, [6, 6])
    forwarded = [{a.minibatch for a in w.actions[(0, 0)] if a.kind == "F"} for w in ws]
    assert forwarded[0] == set(range(5))  # F5 comes after B0, which waits for window 2
    assert 5 in forwarded[1] and 11 not in forwarded[1]
    assert set().union(*forwarded) == set(range(24))
    assert sum(len(f) for f in forwarded) == 24


def test_a_stretch_ends_once_and_refuses_a_negative_window() -> None:
    stream = ScheduleStream("pipedream", [1, 1])
    with pytest.raises(ConfigError, match="window of -1"):
        stream.window(-1)
    stream.window(4, final=True)
    with pytest.raises(ConfigError, match="has ended"):
        stream.window(2)
    with pytest.raises(ConfigError, match="does not stream"):
        ScheduleStream("1f1b-flush", [1, 1])


def test_the_lookahead_holds_every_later_read_of_an_existing_version() -> None:
    """What a window's ``ahead`` is for: a version that exists when the window ends and that a
    later forward reads is among the reads of the window's lookahead (so the stash keeps it).
    Vertical sync on 4 stages: stage 3 reads stage 0's older versions."""
    ws = cut_up("pipedream", [1, 1, 1, 1], 40, [4] * 9, vsync=True)
    for i, w in enumerate(ws[:-1]):
        for r in w.ranks:
            made = sum(a.kind == "U" for v in ws[:i + 1] for a in v.actions[r])
            later = {a.version for v in ws[i + 1:] for a in v.actions[r] if a.kind == "F"}
            ahead = {a.version for a in w.ahead[r] if a.kind == "F"}
            assert {v for v in later if v <= made} <= ahead, (i, r)


# ----------------------------------------------------------------------------- the messages
@pytest.mark.parametrize("kind", ["pipedream", "2bw"])
def test_a_stretchs_messages_obey_ncclss_rules_across_windows(kind: str) -> None:
    """plan_logs over the windows (a receive posted in its sender's window, waited for in a
    later one) replayed under NCCL's rules, for many shapes and random windows."""
    rng = random.Random(1)
    for reps in SHAPES:
        links = chain(len(reps))
        m = None if kind == "pipedream" else sum(reps)
        ws = cut_up(kind, reps, 30, random_sizes(rng, 30), m)
        ops = check_logs(plan_logs(links, ws, index_of(links), always))
        assert ops == 2 * 2 * 30 * (len(reps) - 1)  # a send and a receive per message


def test_posting_receives_in_the_receivers_window_deadlocks(monkeypatch) -> None:
    """Seeded bug: a receive posted in the window of the action that waits for it (not its
    sender's) breaks the global order across windows; the checker catches it."""
    from fxpipe.runtime.schedules import commplan

    links = chain(3)
    ws = cut_up("pipedream", [1, 1, 1], 24, [4] * 5)
    real = commplan.StretchPlanner.window

    def late(self, sched, order):
        plans = real(self, sched, order)
        out = {}
        for rank, plan in plans.items():
            mine = set(m for recvs in plan.recvs for m in recvs)
            sends = [m for m in plan.ops if m.send]
            recvs = [m for m in plan.ops if not m.send]
            kept = [m for m in recvs if m in mine]  # posted where it is waited for, late
            extra = [m for recvs in plan.recvs for m in recvs if m not in set(recvs)]
            out[rank] = commplan.RankPlan(plan.recvs, plan.sends,
                                          tuple(extra + kept + sends))
        return out

    check_logs(plan_logs(links, ws, index_of(links), always))
    monkeypatch.setattr(commplan.StretchPlanner, "window", late)
    with pytest.raises(Exception):
        check_logs(plan_logs(links, ws, index_of(links), always))


def gradient_before_next_send(plan_ops, k: int, lead: int) -> bool:
    """On stage 0: is the receive of minibatch k's gradient ahead of the send of k + lead's
    activation, so posted before stage 0 computes forward k + lead, the action just before
    backward k (stage 0 admits lead + 1 minibatches)?"""
    ops = list(plan_ops)
    recv = next(i for i, m in enumerate(ops) if not m.send and m.minibatch == k)
    send = next(i for i, m in enumerate(ops) if m.send and m.minibatch == k + lead)
    return recv < send


@pytest.mark.parametrize("stages", [2, 4])
def test_gradients_are_received_while_the_next_forward_runs(stages: int) -> None:
    """The overlap itself, as data: on stage 0 of pipedream the receive of every gradient is
    posted before the forward that runs while that gradient is computed and sent, in the timed
    order; the greedy order (every rank runs ahead as far as it can) posted every other one
    only after that forward, so on a slow link its transfer could not overlap anything."""
    links = chain(stages)
    sched = make_schedule("pipedream", [1] * stages, 24)
    planner = StretchPlanner(links, sched.replicas, index_of(links), always)
    timed = planner.window(sched, execution_order(sched))[(0, 0)].ops
    steady = range(stages, 24 - stages)
    assert all(gradient_before_next_send(timed, k, stages - 1) for k in steady)
    greedy = greedy_ops(links, sched)
    assert not all(gradient_before_next_send(greedy, k, stages - 1) for k in steady)


def greedy_ops(links: list[StageLinks], sched) -> tuple:
    """Stage 0's messages in the order before issue 27: by the greedy execution order's
    position of the sending action (written here from that rule)."""
    from fxpipe.runtime.schedules.commplan import Msg, action_messages

    order = execution_order(sched)
    pos = {(r, sched.actions[r][i].kind, sched.actions[r][i].minibatch): p
           for p, (r, i) in enumerate(order)}
    keyed = []
    for r, i in order:
        a = sched.actions[r][i]
        for m in action_messages(links, sched.owner, r, a, index_of(links), always)[1]:
            key = (pos[(r, a.kind, a.minibatch)], m.peer, m.direction, m.minibatch)
            if r == (0, 0):
                keyed.append((key, m))
            elif m.peer == (0, 0):
                keyed.append((key, Msg(r, m.direction, m.minibatch, m.value, m.name, False)))
    return tuple(m for _, m in sorted(keyed, key=lambda t: t[0]))


@pytest.mark.parametrize("stages, noam", [(2, None), (4, None), (2, 4)])
def test_receives_are_posted_ahead_but_boundedly_on_their_own_channel(stages: int,
                                                                      noam: int | None) -> None:
    """Channels and pacing, as data (the Issuer driven as the executor drives it): on stage 0 of
    pipedream every gradient receive is up before the forward that precedes its backward (so
    its transfer overlaps that forward), and never more than a few are up at once although the
    gradient channel has no send to wait behind (a segment's worth would be memory for nothing)."""
    from fxpipe.runtime.schedules.commplan import Issuer

    links = chain(stages)
    sched = make_schedule("pipedream", [1] * stages, 40, noam=noam)
    plan = StretchPlanner(links, sched.replicas, index_of(links), always,
                          ranks=[(0, 0)]).window(sched, execution_order(sched))[(0, 0)]
    acts = sched.actions[(0, 0)]
    now = [0]
    posted_at: dict = {}
    issuer = Issuer(plan, lambda m: posted_at.setdefault(m, now[0]), lambda m: None)
    issuer.start()
    most = 0
    for i, a in enumerate(acts):
        now[0] = i
        issuer.at(i)
        waiting = {m for m in posted_at if not m.send and m.direction == 1
                   and acts.index(next(b for b in acts if b.kind == "B"
                                       and b.minibatch == m.minibatch)) >= i}
        most = max(most, len(waiting))
        for m in plan.sends[i]:
            issuer.send(m)
    issuer.finish()
    assert issuer.done
    back = {a.minibatch: i for i, a in enumerate(acts) if a.kind == "B"}
    late = [m.minibatch for m in posted_at if m.direction == 1 and not m.send
            and posted_at[m] >= back[m.minibatch] - 1]  # not before the forward before B(k)
    assert late == [] and 1 < most <= 4, (late, most)
