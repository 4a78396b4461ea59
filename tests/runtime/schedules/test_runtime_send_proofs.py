"""Which received message proves a send complete (runtime/schedules/proofs.py): a literal table
for two stages, the rule held against every peer's action list, and the same proofs whether a
stretch is planned whole or a window at a time."""
from __future__ import annotations

import random

import pytest
from test_runtime_commplan import chain, index_of
from test_runtime_stream import cut_up, random_sizes

from fxpipe.runtime.schedules.commplan import FORWARD, Msg, action_messages
from fxpipe.runtime.schedules.kinds import make_schedule
from fxpipe.runtime.schedules.proofs import HappensBefore, SendProofs


def ok(name: str, k: int) -> bool:
    return True


def _label(m: Msg) -> str:
    return f"{'act' if m.direction == FORWARD else 'grad'}{m.minibatch}"


def _proofs(links, reps, windows, me) -> tuple[dict[str, list[str]], int]:  # noqa: ANN001
    """Every window in turn: this rank's sends of it, then which receive proves which."""
    idx = index_of(links)

    def owner(s: int, k: int) -> tuple[int, int]:
        return (s, k % reps[s])

    p = SendProofs(links, owner, me, idx, ok)
    got: dict[str, list[str]] = {}
    for w in windows:
        sends = [m for a in w.actions[me]
                 for m in action_messages(links, owner, me, a, idx, ok)[1]]
        p.window(w.actions, sends)
        for r in list(p._proofs):
            got.setdefault(f"{r.peer[0]}.{r.peer[1]}:{_label(r)}", []).extend(
                f"{s.peer[0]}.{s.peer[1]}:{_label(s)}" for s in p.proven_by(r))
    return got, p.unproven


def test_two_stage_pipedream_literally() -> None:
    """Stage 1 runs F k B k; stage 0 runs F0 F1 B0 F2 B1 ... So the gradient of k proves stage
    0's activation k received, and stage 0's activation k + 2 (sent after its B k) proves stage
    1's gradient k; the last two gradients have no later message: the flush waits for them."""
    sched = make_schedule("pipedream", [1, 1], 6)
    got0, open0 = _proofs(chain(2), [1, 1], [sched], (0, 0))
    assert got0 == {f"1.0:grad{k}": [f"1.0:act{k}"] for k in range(6)} and open0 == 0
    got1, open1 = _proofs(chain(2), [1, 1], [sched], (1, 0))
    assert got1 == {f"0.0:act{k + 2}": [f"0.0:grad{k}"] for k in range(4)} and open1 == 2


def _happens_before(sched, links, owner, idx, ok):  # noqa: ANN001, ANN202
    """An independent happens-before of the whole schedule: (rank, i) -> every (rank, j) that
    precedes it or is it (program order, and a message's sending action before its waiter)."""
    where = {(r, a.kind, a.minibatch): i for r, acts in sched.actions.items()
             for i, a in enumerate(acts)}
    preds: dict = {}
    for r, acts in sched.actions.items():
        for i, a in enumerate(acts):
            ps = [(r, i - 1)] if i else []
            if a.kind in ("F", "B"):
                for m in action_messages(links, owner, r, a, idx, ok)[0]:
                    kind = "F" if m.direction == FORWARD else "B"
                    ps.append((m.peer, where[(m.peer, kind, m.minibatch)]))
            preds[(r, i)] = ps
    memo: dict = {}

    def before(node):  # noqa: ANN001, ANN202 - iterative DFS, memoised
        if node in memo:
            return memo[node]
        seen, todo = {node}, [node]
        while todo:
            for q in preds[todo.pop()]:
                if q not in seen:
                    seen.add(q)
                    todo.append(q)
        memo[node] = seen
        return seen
    return before, where


@pytest.mark.parametrize("kind", ["pipedream", "2bw", "1f1b-flush", "gpipe"])
def test_every_proof_follows_the_consumption(kind: str) -> None:
    """The rule, checked against an independent happens-before of the whole schedule: the
    message that proves a send was sent by an action that the peer's consuming action precedes
    (the chain of receipts says the transfer was over), whole or a window at a time; and it is
    the first such message this rank waits for in the window (planned whole with one
    happens-before shared by every rank, as the memory walk shares it)."""
    rng = random.Random(kind)
    for _ in range(12):
        n_st = rng.randint(2, 4)
        reps = [rng.randint(1, 2) for _ in range(n_st)]
        links, n = chain(n_st, skip=rng.random() < 0.5), rng.randint(6, 20)
        whole = make_schedule(kind, reps, n)
        idx = index_of(links)

        def owner(s: int, k: int) -> tuple[int, int]:
            return (s, k % reps[s])

        before, where = _happens_before(whole, links, owner, idx, ok)
        shared = HappensBefore(links, owner, idx, ok, whole.actions)  # one for every rank
        for me in whole.actions:
            # planned whole, the proof of each send is the first message this rank waits for
            # whose sending action follows the send's consumption
            waits = [(m, (m.peer, where[(m.peer, "F" if m.direction == FORWARD else "B",
                                        m.minibatch)]))
                     for a in whole.actions[me]
                     for m in action_messages(links, owner, me, a, idx, ok)[0]]
            p = SendProofs(links, owner, me, idx, ok)
            sends = [m for a in whole.actions[me]
                     for m in action_messages(links, owner, me, a, idx, ok)[1]]
            p.window(whole.actions, sends, shared)
            for m in sends:
                used = (m.peer, where[(m.peer, "F" if m.direction == FORWARD else "B",
                                       m.minibatch)])
                first = next((r for r, sender in waits if used in before(sender)), None)
                got = next((r for r, v in p._proofs.items() if m in v), None)
                assert got == first, (kind, me, m)
            plans = [_proofs(links, reps, [whole], me)[0]]
            if kind in ("pipedream", "2bw"):
                plans.append(_proofs(links, reps, cut_up(kind, reps, n, random_sizes(rng, n)),
                                     me)[0])
            for got in plans:
                for r, proven in got.items():
                    peer = tuple(int(x) for x in r.split(":")[0].split("."))
                    lab = r.split(":")[1]
                    sent = where[(peer, "F" if lab.startswith("act") else "B",
                                  int(lab[3:] if lab.startswith("act") else lab[4:]))]
                    for s in proven:
                        to = tuple(int(x) for x in s.split(":")[0].split("."))
                        sl = s.split(":")[1]
                        used = where[(to, "F" if sl.startswith("act") else "B",
                                      int(sl[3:] if sl.startswith("act") else sl[4:]))]
                        assert (to, used) in before((peer, sent)), (kind, me, r, s)


def test_a_value_read_by_a_stage_that_never_replies_is_proven_through_the_others() -> None:
    """Three stages; stage 0 also sends ``k`` straight to stage 2, which carries no gradient
    back (an attention mask): stage 2 never sends to stage 0. Under 1f1b-flush (m = 3)

        stage 0: F0 F1 F2 B0 B1 B2 U0 F3 F4 F5 B3 B4 B5 U1
        stage 1: F0 F1 B0 F2 B1 B2 U0 F3 F4 B3 F5 B4 B5 U1
        stage 2: F0 B0 F1 B1 F2 B2 U0 F3 B3 F4 B4 F5 B5 U1

    stage 1's gradient of minibatch j (sent by its B j, after its F j+1 read h0 of j+1, and
    after its wait for stage 2's gradient of j, which stage 2 sent after reading k of j) proves
    k of j and h0 of j and j+1 (h0 of j+1 only when stage 1 ran F j+1 before B j). With the
    peer's own messages only, every k waited for the flush."""
    links = chain(3, skip=True)

    def no_k(name: str, k: int) -> bool:
        return name != "k"

    def owner(s: int, k: int) -> tuple[int, int]:
        return (s, 0)

    sched = make_schedule("1f1b-flush", [1, 1, 1], 6, microbatches=3)
    p = SendProofs(links, owner, (0, 0), index_of(links), no_k)
    p.window(sched.actions, [m for a in sched.actions[(0, 0)]
                             for m in action_messages(links, owner, (0, 0), a, index_of(links),
                                                      no_k)[1]])
    got = {r.minibatch: sorted((s.peer[0], s.name, s.minibatch) for s in p.proven_by(r))
           for r in list(p._proofs)}
    assert got == {0: [(1, "h0", 0), (1, "h0", 1), (2, "k", 0)],
                   1: [(1, "h0", 2), (2, "k", 1)], 2: [(2, "k", 2)],
                   3: [(1, "h0", 3), (1, "h0", 4), (2, "k", 3)],
                   4: [(1, "h0", 5), (2, "k", 4)], 5: [(2, "k", 5)]}
    assert p.unproven == 0  # nothing is left for the flush
