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
from fxpipe.runtime.schedules.proofs import SendProofs


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


@pytest.mark.parametrize("kind", ["pipedream", "2bw", "1f1b-flush", "gpipe"])
def test_proofs_follow_the_consuming_action_and_do_not_depend_on_windows(kind: str) -> None:
    rng = random.Random(kind)
    for _ in range(12):
        n_st = rng.randint(2, 4)
        reps = [rng.randint(1, 2) for _ in range(n_st)]
        links, n = chain(n_st, skip=rng.random() < 0.5), rng.randint(6, 20)
        whole = make_schedule(kind, reps, n)
        idx = index_of(links)

        def owner(s: int, k: int) -> tuple[int, int]:
            return (s, k % reps[s])

        for me in whole.actions:
            want, _ = _proofs(links, reps, [whole], me)
            # the rule, checked on the peer's whole list: the proof is sent by the peer at or
            # after the action that consumes the proven send, and is the first such message
            for r, proven in want.items():
                peer = tuple(int(x) for x in r.split(":")[0].split("."))
                acts = whole.actions[peer]
                sent_at = next(j for j, a in enumerate(acts) if any(
                    f"{me[0]}.{me[1]}:{_label(m)}" == f"{me[0]}.{me[1]}:{r.split(':')[1]}"
                    and m.peer == me
                    for m in action_messages(links, owner, peer, a, idx, ok)[1]))
                for s in proven:
                    lab = s.split(":")[1]
                    kind_ = "F" if lab.startswith("act") else "B"
                    k = int(lab[3:] if kind_ == "F" else lab[4:])
                    used = next(j for j, a in enumerate(acts) if a.kind == kind_
                                and a.minibatch == k)
                    assert used <= sent_at, (kind, me, r, s)
                    assert not any(m.peer == me for a in acts[used:sent_at] for m in
                                   action_messages(links, owner, peer, a, idx, ok)[1]), (r, s)
            if kind in ("pipedream", "2bw"):
                windows = cut_up(kind, reps, n, random_sizes(rng, n))
                assert _proofs(links, reps, windows, me)[0] == want, (kind, reps, me)
