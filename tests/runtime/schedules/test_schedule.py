"""Schedules as data: literal tables from the papers' figures, validation, simulation, versions."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fxpipe.errors import ConfigError, FxpipeError
from fxpipe.runtime.schedules.schedule import (SCHEDULE_KINDS, SYNCHRONOUS_KINDS, Action,
                                               DeadlockError, Schedule, ScheduleError,
                                               execution_order, sync_sets, validate)
from fxpipe.runtime.schedules.kinds import make_schedule
from fxpipe.runtime.schedules.simulate import format_grid, simulate


def table(sched: Schedule, updates: bool = True) -> dict[tuple[int, int], str]:
    return {rank: " ".join(str(a) for a in acts if updates or a.kind != "U")
            for rank, acts in sched.actions.items()}


# --------------------------------------------------------------------------- literal tables

def test_pipedream_straight_4x8_matches_figure_8() -> None:
    """PipeDream Fig. 8 (0-based): stage s admits 4 - s forwards, then B/F, then drains;
    an explicit update follows every backward."""
    s = make_schedule("pipedream", [1, 1, 1, 1], 8)
    assert s.noam == 4 and s.windows == (4, 3, 2, 1)
    assert table(s) == {
        (0, 0): "F0 F1 F2 F3 B0 U0 F4 B1 U1 F5 B2 U2 F6 B3 U3 F7 B4 U4 B5 U5 B6 U6 B7 U7",
        (1, 0): "F0 F1 F2 B0 U0 F3 B1 U1 F4 B2 U2 F5 B3 U3 F6 B4 U4 F7 B5 U5 B6 U6 B7 U7",
        (2, 0): "F0 F1 B0 U0 F2 B1 U1 F3 B2 U2 F4 B3 U3 F5 B4 U4 F6 B5 U5 F7 B6 U6 B7 U7",
        (3, 0): "F0 B0 U0 F1 B1 U1 F2 B2 U2 F3 B3 U3 F4 B4 U4 F5 B5 U5 F6 B6 U6 F7 B7 U7",
    }


def test_pipedream_weight_versions_are_stashed() -> None:
    """Version = updates applied on the rank before the forward; the backward reuses it."""
    s = make_schedule("pipedream", [1, 1, 1, 1], 8)
    v = s.forward_versions()
    assert [v[((0, 0), k)] for k in range(8)] == [0, 0, 0, 0, 1, 2, 3, 4]
    assert [v[((1, 0), k)] for k in range(8)] == [0, 0, 0, 1, 2, 3, 4, 5]
    assert [v[((2, 0), k)] for k in range(8)] == [0, 0, 1, 2, 3, 4, 5, 6]
    assert [v[((3, 0), k)] for k in range(8)] == [0, 1, 2, 3, 4, 5, 6, 7]
    for rank, acts in s.actions.items():
        for a in acts:
            if a.kind == "B":
                assert a.version == v[(rank, a.minibatch)]
    assert [a.version for a in s.actions[(0, 0)] if a.kind == "U"] == list(range(1, 9))


def test_vertical_sync_carries_input_stage_version() -> None:
    s = make_schedule("pipedream", [1, 1, 1, 1], 8)
    assert s.input_versions() == dict(enumerate([0, 0, 0, 0, 1, 2, 3, 4]))
    vs = s.with_vertical_sync()
    validate(vs)
    for rank in vs.ranks:
        assert [a.version for a in vs.actions[rank] if a.kind == "F"] == [0, 0, 0, 0, 1, 2, 3, 4]
    with pytest.raises(ConfigError, match="vertical sync"):
        make_schedule("pipedream", [2, 1], 4).with_vertical_sync()


def test_gpipe_two_stages_four_microbatches() -> None:
    s = make_schedule("gpipe", [1, 1], 4, microbatches=4)
    assert table(s) == {(0, 0): "F0 F1 F2 F3 B0 B1 B2 B3 U0",
                        (1, 0): "F0 F1 F2 F3 B0 B1 B2 B3 U0"}
    assert format_grid(s).splitlines() == [
        "s0r0  |F0 F1 F2 F3  .  . B0 B1 B2 B3",
        "s1r0  | . F0 F1 F2 F3 B0 B1 B2 B3  .",
    ]


def test_1f1b_flush_two_stages_four_microbatches_two_batches() -> None:
    s = make_schedule("1f1b-flush", [1, 1], 8, microbatches=4)
    assert table(s) == {
        (0, 0): "F0 F1 B0 F2 B1 F3 B2 B3 U0 F4 F5 B4 F6 B5 F7 B6 B7 U1",
        (1, 0): "F0 B0 F1 B1 F2 B2 F3 B3 U0 F4 B4 F5 B5 F6 B6 F7 B7 U1",
    }
    assert all(a.version == a.minibatch // 4 for a in s.actions[(0, 0)] if a.kind != "U")


def test_replicated_2_1_round_robin() -> None:
    """2-1 plan: NOAM = ceil(3 / 2) = 2; even minibatches on replica 0, odd on replica 1; the
    replicas number their updates alike (they all-reduce U<i> together)."""
    s = make_schedule("pipedream", [2, 1], 8)
    assert s.noam == 2 and s.windows == (2, 1)
    assert table(s) == {
        (0, 0): "F0 F2 B0 U0 F4 B2 U1 F6 B4 U2 B6 U3",
        (0, 1): "F1 F3 B1 U0 F5 B3 U1 F7 B5 U2 B7 U3",
        (1, 0): "F0 B0 U0 F1 B1 U1 F2 B2 U2 F3 B3 U3 F4 B4 U4 F5 B5 U5 F6 B6 U6 F7 B7 U7",
    }
    assert s.owner(0, 5) == (0, 1) and s.owner(1, 5) == (1, 0)


def test_2bw_versions_follow_the_one_stale_rule() -> None:
    """2BW: batch b's forwards all use version max(0, b - 1), W(t+1) = W(t) - lr*grad(W(t-1))."""
    s = make_schedule("2bw", [1, 1, 1, 1], 16, microbatches=4)
    assert table(s, updates=False)[(0, 0)].startswith("F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4")
    assert " ".join(map(str, s.actions[(0, 0)][:12])) == "F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 U0"
    for rank in s.ranks:
        fv = [a.version for a in s.actions[rank] if a.kind == "F"]
        assert fv == [0] * 8 + [1] * 4 + [2] * 4
        assert len({a.version for a in s.actions[rank] if a.kind == "U"}) == 4
    # at most two versions live on a rank at any time (the "2" in 2BW)
    for rank, acts in s.actions.items():
        live: dict[int, int] = {}
        for a in acts:
            if a.kind == "F":
                live[a.minibatch] = a.version
            elif a.kind == "B":
                del live[a.minibatch]
            assert len(set(live.values())) <= 2


def test_2bw_too_few_microbatches_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="2bw"):
        make_schedule("2bw", [1, 1, 1, 1, 1, 1], 24, microbatches=2)


@pytest.mark.parametrize("kwargs", [dict(kind="zigzag"), dict(replicas=[]),
                                    dict(replicas=[1, 0]), dict(microbatches=4),
                                    dict(noam=0), dict(kind="gpipe", noam=2)])
def test_bad_arguments(kwargs: dict) -> None:
    args = dict(kind="pipedream", replicas=[1, 1], num_minibatches=4) | kwargs
    with pytest.raises(ConfigError):
        make_schedule(args.pop("kind"), args.pop("replicas"), args.pop("num_minibatches"), **args)


def test_action_text() -> None:
    assert str(Action("F", 3)) == "F3" and Action.parse("B12") == Action("B", 12)
    with pytest.raises(ConfigError):
        Action.parse("X1")


# --------------------------------------------------------------------------- validate

def test_validate_rejects_missing_backward() -> None:
    s = Schedule.from_text([1, 1], {(0, 0): "F0 F1 B0", (1, 0): "F0 B0 F1 B1"})
    e = _refusal(s)
    assert (e.message, e.hint) == ("forward of minibatch 1 on stage 0 replica 0 lacks its "
                                   "backward", "add B<k> after F<k>")


def test_validate_rejects_backward_before_forward() -> None:
    e = _refusal(Schedule.from_text([1], {(0, 0): "B0 F0"}))
    assert (e.message, e.hint) == ("B0 on stage 0 replica 0: backward before its forward",
                                   "put F<k> before B<k> on the same rank")


def test_validate_rejects_wrong_replica_and_missing_minibatch() -> None:
    e = _refusal(Schedule.from_text([2], {(0, 0): "F1 B1", (0, 1): "F0 B0"}))
    assert (e.message, e.hint) == ("F1 on stage 0 replica 0: minibatch belongs to (0, 1)",
                                   "minibatch k runs on replica k % r of each stage")
    e = _refusal(Schedule.from_text([1, 1], {(0, 0): "F0 F1 B0 B1", (1, 0): "F0 B0"}))
    assert (e.message, e.hint) == ("minibatch 1 never runs on stage 1",
                                   "every minibatch must go through every stage")


def test_validate_detects_deadlock_and_names_ranks() -> None:
    # stage 0 waits for B0 before forwarding minibatch 1; stage 1 wants F1 before B0
    s = Schedule.from_text([1, 1], {(0, 0): "F0 B0 F1 B1", (1, 0): "F0 F1 B0 B1"})
    with pytest.raises(DeadlockError) as info:
        validate(s)
    assert set(info.value.stuck) == {(0, 0), (1, 0)}
    assert "stage 0 replica 0 stuck at B0" in info.value.message
    assert "stage 1 replica 0 stuck at F1 waiting for F1 on stage 0" in info.value.message
    assert isinstance(info.value, FxpipeError)


def test_validate_checks_stashed_versions_and_update_collectives() -> None:
    s = Schedule("custom", (1,), 2, {(0, 0): (Action("F", 0, 0), Action("B", 0, 0),
                                             Action("U", 0, 1), Action("F", 1, 1),
                                             Action("B", 1, 0))})
    e = _refusal(s)
    assert (e.message, e.hint) == ("B1 on stage 0 replica 0: uses version 0, its forward used 1",
                                   "stash the forward's weights")
    e = _refusal(Schedule.from_text([2], {(0, 0): "F0 B0 U0", (0, 1): "F1 B1"}))
    assert (e.message, e.hint) == ("replicas of stage 0 make different numbers of updates "
                                   "[0, 1]", "replicas all-reduce every update together")


# --------------------------------------------------------------------------- simulate

def test_simulate_straight_pipedream_unit_times() -> None:
    """fwd = 1, bwd = 2 on 4 stages: each stage needs 3 per minibatch, so the steady-state
    period is exactly 3; makespan = 3 n + fill/drain 3 * (1 + 2)."""
    for n in (8, 40):
        tl = simulate(make_schedule("pipedream", [1] * 4, n), [1] * 4, [2] * 4)
        assert tl.makespan == 3 * n + 9
        assert tl.steady_state_period == 3.0
        assert tl.busy_fraction[(0, 0)] == pytest.approx(3 * n / (3 * n + 9))
    tl = simulate(make_schedule("pipedream", [1] * 4, 8), [1] * 4, [2] * 4)
    assert tl.times((3, 0))[:3] == [("F0", 3.0, 4.0), ("B0", 4.0, 6.0), ("U0", 6.0, 6.0)]


def test_simulate_flush_kinds_and_comm() -> None:
    # one batch costs (m + S - 1)(f + b): 7 * 3 = 21 for m = S = 4
    for kind in ("gpipe", "1f1b-flush"):
        tl = simulate(make_schedule(kind, [1] * 4, 16, microbatches=4), [1] * 4, [2] * 4)
        assert tl.makespan == 84.0 and tl.steady_state_period == 21 / 4
    tl = simulate(make_schedule("gpipe", [1, 1], 2, microbatches=2), [1, 1], [1, 1],
                  comm_time=0.5)
    assert tl.times((1, 0)) == [("F0", 1.5, 2.5), ("F1", 2.5, 3.5), ("B0", 3.5, 4.5),
                                ("B1", 4.5, 5.5), ("U0", 5.5, 5.5)]
    assert tl.makespan == 7.0
    with pytest.raises(ConfigError):
        simulate(make_schedule("gpipe", [1, 1], 2), [1, 1], [1, 1], comm_time=[1, 2])


def test_simulate_replicated_stage_halves_period() -> None:
    # stage 0 costs 2 per minibatch but has 2 replicas; stage 1 costs 1: period 1
    tl = simulate(make_schedule("pipedream", [2, 1], 40), [1, 0.5], [1, 0.5])
    assert tl.steady_state_period == pytest.approx(1.0)


# --------------------------------------------------------------------------- properties

@settings(max_examples=60, deadline=None)
@given(replicas=st.lists(st.integers(1, 3), min_size=1, max_size=4),
       n=st.integers(0, 14), kind=st.sampled_from(SCHEDULE_KINDS),
       extra_m=st.integers(0, 4), noam=st.one_of(st.none(), st.integers(1, 6)))
def test_every_generated_schedule_validates(replicas: list[int], n: int, kind: str,
                                            extra_m: int, noam: int | None) -> None:
    m = None if kind == "pipedream" else sum(replicas) + extra_m
    noam = None if kind in ("gpipe", "2bw") else noam
    s = make_schedule(kind, replicas, n, microbatches=m, noam=noam)
    validate(s)
    for rank, acts in s.actions.items():
        fwd = [a.minibatch for a in acts if a.kind == "F"]
        bwd = [a.minibatch for a in acts if a.kind == "B"]
        assert sorted(fwd) == sorted(bwd) == [k for k in range(n) if s.owner(rank[0], k) == rank]
    tl = simulate(s, [1.0] * len(replicas), [2.0] * len(replicas))
    assert all(0.0 <= b <= 1.0 for b in tl.busy_fraction.values())


# --------------------------------------------------------------------------- every refusal
def _refusal(sched: Schedule) -> ScheduleError:
    with pytest.raises(ScheduleError) as info:
        validate(sched)
    return info.value


def test_validate_names_each_broken_rule() -> None:
    e = _refusal(Schedule.from_text([1, 1], {(0, 0): "F0 B0"}))
    assert e.message == "schedule ranks [(0, 0)] != [(0, 0), (1, 0)]"
    assert e.hint == "give exactly one action list per (stage, replica)"
    e = _refusal(Schedule.from_text([1], {(0, 0): "F0 B0 U1"}))
    assert (e.message, e.hint) == ("U1 on stage 0 replica 0: expected update U0",
                                   "number a rank's updates 0, 1, 2, ...")
    e = _refusal(Schedule("custom", (1,), 1, {(0, 0): (Action("F", 0), Action("B", 0),
                                                      Action("U", 0, 2))}))
    assert e.message == "U0 on stage 0 replica 0: expected update U0"  # U0 makes version 1
    e = _refusal(Schedule.from_text([1], {(0, 0): "F0 B0 F1 B1"}, num_minibatches=1))
    assert e.message == "F1 on stage 0 replica 0: minibatch out of range"
    assert e.hint == "minibatch k runs on replica k % r of each stage"
    e = _refusal(Schedule.from_text([1], {(0, 0): "F0 F0 B0"}))
    assert (e.message, e.hint) == ("F0 on stage 0 replica 0: forward repeated",
                                   "forward each minibatch once")
    e = _refusal(Schedule.from_text([1, 1], {(0, 0): "F0 B0 W0", (1, 0): "F0 W0 B0"}))
    assert (e.message, e.hint) == ("W0 on stage 1 replica 0: weight gradients before the "
                                   "backward's input part",
                                   "put B<k> before W<k> on the same rank")
    e = _refusal(Schedule.from_text([1], {(0, 0): "F0 B0 W0 W0"}))
    assert (e.message, e.hint) == ("W0 on stage 0 replica 0: weight gradients repeated",
                                   "one W per B")
    e = _refusal(Schedule("custom", (1,), 1, {(0, 0): (Action("F", 0, 0), Action("B", 0, 0),
                                                      Action("W", 0, 1))}))
    assert (e.message, e.hint) == ("W0 on stage 0 replica 0: uses version 1, its forward used 0",
                                   "stash the forward's weights")
    e = _refusal(Schedule.from_text([1], {(0, 0): "F0 F1 B0 W0 B1"}))
    assert (e.message, e.hint) == ("backward of minibatch 1 on stage 0 replica 0 has no W, but "
                                   "others on that rank do",
                                   "a rank splits every backward into B and W, or none")
    e = _refusal(Schedule.from_text([1], {(0, 0): "F0 B0 B0"}))
    assert (e.message, e.hint) == ("B0 on stage 0 replica 0: backward repeated",
                                   "one backward per forward")
    e = _refusal(Schedule("custom", (1,), 1, {(0, 0): (Action("F", 0, 1), Action("B", 0, 1))}))
    assert (e.message, e.hint) == (
        "F0 on stage 0 replica 0: reads version 1 but only 0 updates happened",
        "a forward can only use versions already produced")
    e = _refusal(Schedule("custom", (1,), 1, {(0, 0): (Action("F", 0, -1), Action("B", 0, -1))}))
    assert "reads version -1" in e.message
    # versions may be left out (hand-written tables), and a U may carry the version it makes
    validate(Schedule("custom", (1,), 2, {(0, 0): (
        Action("F", 0), Action("B", 0), Action("U", 0, 1), Action("F", 1, 1),
        Action("B", 1, 1), Action("U", 1))}))


def test_deadlock_message_for_an_update_nobody_joins() -> None:
    """Replica 0 of stage 0 updates before forwarding minibatch 2; stage 1 wants F2 before B1;
    replica 1 needs B1 before it joins U0: a cycle through the update."""
    s = Schedule.from_text([2], {(0, 0): "F0 B0 U0", (0, 1): "U0 F1 B1"})
    validate(s)  # U0 is one collective both replicas reach (0 after B0, 1 at once)
    s = Schedule.from_text([2, 1], {(0, 0): "F0 U0 F2 B0 B2", (0, 1): "F1 B1 U0",
                                    (1, 0): "F0 F2 B2 F1 B1 B0"})
    with pytest.raises(DeadlockError) as info:
        validate(s)
    assert info.value.stuck == {(0, 0): Action("U", 0), (0, 1): Action("B", 1),
                                (1, 0): Action("F", 2)}
    assert info.value.message == (
        "deadlock: stage 0 replica 0 stuck at U0 waiting for all replicas of stage 0 (and tied "
        "stages) at U0; "
        "stage 0 replica 1 stuck at B1 waiting for B1 on stage 1; "
        "stage 1 replica 0 stuck at F2 waiting for F2 on stage 0")
    assert info.value.hint == "reorder the lists so each rank's next action can become ready"


def test_schedules_are_immutable_and_parse_their_text() -> None:
    s = make_schedule("pipedream", [1, 1], 2)
    with pytest.raises(TypeError):
        s.actions[(0, 0)] = ()  # type: ignore[index]
    assert s.num_stages == 2 and s.ranks == ((0, 0), (1, 0)) and s.group == 1
    assert Schedule.from_text([1], {(0, 0): "F0 B0 F3 B3"}).num_minibatches == 4
    assert Schedule.from_text([1], {(0, 0): "U0"}).num_minibatches == 0
    with pytest.raises(ConfigError, match="unknown action kind 'X'"):
        Action("X", 0)  # type: ignore[arg-type]
    for text in ("F", "Fx", "f3", "F-1", ""):
        with pytest.raises(ConfigError, match="cannot parse action"):
            Action.parse(text)
    assert Action.parse(" U7 ") == Action("U", 7)


def test_action_and_parse_errors_say_exactly_what_and_how() -> None:
    with pytest.raises(ConfigError) as err:
        Action("X", 0)  # type: ignore[arg-type]
    assert (err.value.message, err.value.hint) == ("unknown action kind 'X'",
                                                   "use 'F', 'B', 'W' or 'U'")
    for text in ("X3", "XX", "F", "3F"):
        with pytest.raises(ConfigError) as err:
            Action.parse(text)
        assert (err.value.message, err.value.hint) == (
            f"cannot parse action {text!r}", "write e.g. 'F3', 'B3', 'W3' or 'U0'")


def test_actions_and_schedules_are_values() -> None:
    """Actions are frozen and hashable (sets of actions, dict keys); schedules hash by their
    shape (the action table is a read-only mapping, left out of the hash), equal schedules
    alike; a schedule needs its actions, and a hand-written one updates every minibatch
    (group 1) unless told otherwise."""
    import dataclasses

    a = Action("F", 3, 1)
    assert {a, Action("F", 3, 1), Action("B", 3, 1)} == {a, Action("B", 3, 1)}
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.kind = "B"  # type: ignore[misc]
    one, two = (make_schedule("1f1b-flush", [1, 1], 8, microbatches=4) for _ in range(2))
    assert one == two and hash(one) == hash(two) and len({one, two}) == 1
    with pytest.raises(TypeError):
        Schedule("custom", (1,), 1)  # type: ignore[call-arg]
    hand = Schedule.from_text([1], {(0, 0): "F0 B0 U0"})
    assert (hand.kind, hand.group, hand.noam, hand.windows) == ("custom", 1, 1, ())


def test_synchronous_kinds_are_exactly_the_kinds_without_stale_weights() -> None:
    """From the definition, not the list: a kind is synchronous (minibatch SGD) when every
    forward of batch b reads the weights after exactly b updates, on every rank."""
    sync = set()
    for kind in SCHEDULE_KINDS:
        m = None if kind == "pipedream" else 4
        s = make_schedule(kind, [2, 1, 1], 16, microbatches=m)
        if all(v == k // 4 for (_, k), v in s.forward_versions().items()):
            sync.add(kind)
    assert sync == set(SYNCHRONOUS_KINDS) == {"1f1b-flush", "gpipe", "zb-h1", "zb-h2"}


@pytest.mark.parametrize("args, message, hint", [
    (("ring", [1], 1, {}), "unknown schedule kind 'ring'", f"use one of {SCHEDULE_KINDS}"),
    (("pipedream", [1, 0], 1, {}), "bad replica vector [1, 0]", "give one count >= 1 per stage"),
    (("pipedream", [1], -1, {}), "num_minibatches=-1 is negative", "use 0 or more"),
    (("gpipe", [1], 4, {"noam": 2}), "noam=2 with kind 'gpipe'",
     "noam must be >= 1 and does not apply to gpipe"),
    (("pipedream", [1], 4, {"microbatches": 2}), "microbatches=2 with pipedream",
     "pipedream updates after every minibatch; use 2bw or 1f1b-flush"),
    (("1f1b-flush", [1], 4, {"microbatches": 0}), "microbatches=0",
     "use at least 1 microbatch per batch"),
])
def test_make_schedule_errors_say_exactly_what_and_how(args, message, hint) -> None:
    kind, replicas, n, kw = args
    with pytest.raises(ConfigError) as err:
        make_schedule(kind, replicas, n, **kw)
    assert (err.value.message, err.value.hint) == (message, hint)


def test_vertical_sync_names_itself_and_refuses_unequal_replicas_exactly() -> None:
    assert make_schedule("pipedream", [1, 1], 4).with_vertical_sync().kind == "pipedream+vsync"
    with pytest.raises(ConfigError) as err:
        make_schedule("pipedream", [2, 1], 4).with_vertical_sync()
    assert (err.value.message, err.value.hint) == (
        "vertical sync with replicas [2, 1]", "version numbers are comparable only when every "
        "stage has the same number of replicas")


def test_schedule_fields_become_tuples() -> None:
    s = Schedule("custom", [1, 1], 1, {(0, 0): [Action("F", 0)]}, windows=[2, 1])  # type: ignore
    assert s.replicas == (1, 1) and s.windows == (2, 1) and s.actions[(0, 0)] == (Action("F", 0),)
    assert hash(s) == hash(Schedule("custom", (1, 1), 1, {}, windows=(2, 1)))


def test_noam_windows_of_a_replicated_input_stage_by_hand() -> None:
    """Replicas [2, 1, 1, 1], noam 2: the input stage's 2 replicas admit 2 x 2 = 4 minibatches;
    stage s keeps what is left after the workers upstream hold theirs, at most PipeDream's
    ceil(workers from s on / r_s) = 3, 2, 1: stage 1 4 - 2 = 2, stage 2 4 - 3 = 1, stage 3
    4 - 4 = 0 -> at least 1."""
    s = make_schedule("pipedream", [2, 1, 1, 1], 8, noam=2)
    assert (s.noam, s.windows) == (2, (2, 2, 1, 1))


def test_refusals_of_generated_and_hand_written_schedules_exactly() -> None:
    with pytest.raises(ConfigError) as err:
        make_schedule("2bw", [1] * 6, 24, microbatches=2)
    assert (err.value.message, err.value.hint) == (
        "2bw cannot run replicas=[1, 1, 1, 1, 1, 1] with m=2, noam=None: F4 on stage 0 "
        "replica 0: reads version 1 but only 0 updates happened",
        "2bw needs microbatches >= the number of workers (6) to keep two weight versions")
    assert make_schedule("pipedream", [1, 1], 4, microbatches=1).group == 1  # 1 is pipedream's
    e = _refusal(Schedule.from_text([1], {(0, 0): "F0 B0 U1"}))
    assert e.hint == "number a rank's updates 0, 1, 2, ..."
    # minibatch 0 on the wrong replica: it exists, it belongs elsewhere
    e = _refusal(Schedule.from_text([2], {(0, 1): "F0 B0", (0, 0): "F1 B1"}))
    assert (e.message, e.hint) == ("F0 on stage 0 replica 1: minibatch belongs to (0, 0)",
                                   "minibatch k runs on replica k % r of each stage")


def test_noam_below_the_default_shrinks_every_window() -> None:
    """noam = 2 on 3 stages: stage 0 admits 2; stage s keeps what is left after the workers
    upstream hold theirs: ceil((2 * 1 - 1) / 1) = 1, ceil((2 - 2) / 1) = 0 -> at least 1."""
    s = make_schedule("pipedream", [1, 1, 1], 4, noam=2)
    assert s.noam == 2 and s.windows == (2, 1, 1)
    assert table(s) == {
        (0, 0): "F0 F1 B0 U0 F2 B1 U1 F3 B2 U2 B3 U3",
        (1, 0): "F0 B0 U0 F1 B1 U1 F2 B2 U2 F3 B3 U3",
        (2, 0): "F0 B0 U0 F1 B1 U1 F2 B2 U2 F3 B3 U3",
    }
    assert [a.version for a in s.actions[(0, 0)] if a.kind == "F"] == [0, 0, 1, 2]
    # 4 stages, noam 3: stage 1 keeps ceil((3 - 1) / 1) = 2 (below its default 3), stage 2
    # ceil((3 - 2) / 1) = 1, stage 3 ceil(0) -> 1
    assert make_schedule("pipedream", [1, 1, 1, 1], 8, noam=3).windows == (3, 2, 1, 1)
    # replicated [2, 2], noam 3: stage 1 would keep ceil((3 * 2 - 2) / 2) = 2, but never more
    # than its default ceil(2 / 2) = 1
    r = make_schedule("pipedream", [2, 2], 8, noam=3)
    assert r.windows == (3, 1) and r.noam == 3
    # noam above the default does not grow the later windows beyond theirs
    assert make_schedule("pipedream", [1, 1, 1], 4, noam=5).windows == (5, 2, 1)


@pytest.mark.parametrize("kwargs, message", [
    (dict(kind="zigzag"), "unknown schedule kind 'zigzag'"),
    (dict(replicas=[]), "bad replica vector []"),
    (dict(replicas=[1, True]), None),
    (dict(num_minibatches=-1), "num_minibatches=-1 is negative"),
    (dict(noam=0), "noam=0 with kind 'pipedream'"),
    (dict(kind="gpipe", noam=2), "noam=2 with kind 'gpipe'"),
    (dict(microbatches=4), "microbatches=4 with pipedream"),
    (dict(kind="gpipe", microbatches=0), "microbatches=0"),
])
def test_make_schedule_refusals(kwargs: dict, message: str | None) -> None:
    args = dict(kind="pipedream", replicas=[1, 1], num_minibatches=4) | kwargs
    kind, replicas, n = args.pop("kind"), args.pop("replicas"), args.pop("num_minibatches")
    if message is None:  # True is an int: a 1
        assert make_schedule(kind, replicas, n, **args).replicas == (1, 1)
        return
    with pytest.raises(ConfigError) as info:
        make_schedule(kind, replicas, n, **args)
    assert info.value.message == message


def test_idle_replica_still_joins_every_update() -> None:
    """3 minibatches on [2] replicas: replica 1 has none in round 1 but still makes U1 (it
    all-reduces zeros); pipedream's rounds have r minibatches, 2bw's and the flush kinds' m."""
    s = make_schedule("pipedream", [2], 3)
    assert table(s) == {(0, 0): "F0 B0 U0 F2 B2 U1", (0, 1): "F1 B1 U0 U1"}
    g = make_schedule("1f1b-flush", [2, 1], 3, microbatches=2)
    assert table(g) == {(0, 0): "F0 B0 U0 F2 B2 U1", (0, 1): "F1 B1 U0 U1",
                        (1, 0): "F0 B0 F1 B1 U0 F2 B2 U1"}
    assert g.group == 2 and make_schedule("gpipe", [1, 1], 4).group == 2  # m = workers
    b = make_schedule("2bw", [1, 1], 6, microbatches=2)
    assert [a.version for a in b.actions[(1, 0)] if a.kind == "F"] == [0, 0, 0, 0, 1, 1]
    assert make_schedule("pipedream", [1], 0).actions == {(0, 0): ()}


def test_execution_order_of_tied_updates_by_their_definition() -> None:
    """Stages 0 and 1 share tied weights (one sync set). delay 0: their U<i> are one all-reduce,
    so they run together (adjacent in the order); delay d > 0: U<i> of one stage waits for U<i-d>
    of the other (it applies round i-d's sum). The d = 1 lag binds here: without it (as at d = 2)
    stage 1 reaches U1 before stage 0's U0."""
    sched = make_schedule("pipedream", [1, 1], 4)
    pos = {}
    for d in (0, 1, 2):
        order = execution_order(sched, sync=[[0, 1]], delay=d)
        pos[d] = {(r[0], sched.actions[r][i].minibatch): n for n, (r, i) in enumerate(order)
                  if sched.actions[r][i].kind == "U"}
        for i in range(4):
            if d == 0:
                assert abs(pos[d][(0, i)] - pos[d][(1, i)]) == 1
            for s, t in ((0, 1), (1, 0)):
                if d > 0 and i - d >= 0:
                    assert pos[d][(s, i)] > pos[d][(t, i - d)], (d, s, i)
    assert pos[1][(1, 1)] > pos[1][(0, 0)] and pos[2][(1, 1)] < pos[2][(0, 0)]


def test_a_tied_stage_without_the_update_is_a_deadlock() -> None:
    """Stage 0 reaches U0, its tied partner (delay 0) has finished its list without one: a
    deadlock naming the update, not an index error."""
    s = Schedule.from_text([1, 1], {(0, 0): "F0 B0 U0", (1, 0): "F0 B0"})
    with pytest.raises(DeadlockError) as info:
        execution_order(s, sync=[[0, 1]])
    assert info.value.message == ("deadlock: stage 0 replica 0 stuck at U0 waiting for all "
                                  "replicas of stage 0 (and tied stages) at U0")
    s = Schedule.from_text([1, 1], {(0, 0): "F0 B0", (1, 0): "F0 B0 U0"})
    with pytest.raises(DeadlockError) as info:
        execution_order(s, sync=[[0, 1]])
    assert info.value.message == ("deadlock: stage 1 replica 0 stuck at U0 waiting for all "
                                  "replicas of stage 1 (and tied stages) at U0")


def test_sync_sets_are_the_connected_components_by_hand() -> None:
    """Tied parameters chain stages: sets sharing a stage merge, disjoint ones stay apart, each
    component sorted, the components in sorted order."""
    assert sync_sets([[0, 3], [1, 2], [3, 5], [2, 4]]) == [(0, 3, 5), (1, 2, 4)]
    assert sync_sets([[0, 1], [2, 3], [1, 2]]) == [(0, 1, 2, 3)]  # the last set joins two
    assert sync_sets([[0, 1], [1, 2]]) == [(0, 1, 2)]
    assert sync_sets([[4, 1]]) == [(1, 4)] and sync_sets([]) == []


def test_sync_sets_keep_each_empty_set_and_every_single_stage() -> None:
    """As the merge loop before networkx had it: an empty set is a component of its own (one per
    empty set), a single stage is its own component."""
    assert sync_sets([[0, 1], [], [2], [], [1, 3]]) == [(), (), (0, 1, 3), (2,)]
    assert sync_sets([[5]]) == [(5,)] and sync_sets([[]]) == [()]
