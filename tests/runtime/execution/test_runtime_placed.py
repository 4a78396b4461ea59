"""interleaved-1f1b and zb-v in fxpipe's own runtime: processes hosting several stages.

Distributed (gloo, one spawned world of 4 processes shared by every job) == the reference
executor running the same per-rank lists == minibatch SGD (one step per batch on the batch's
concatenation, computed here without fxpipe): on 2 processes x 4 stages, 3 stages round robin on
2 processes (a value sent both to a remote stage and to a stage of its own process), a value
consumed by two stages of the same remote process (its two gradients come back with one
(minibatch, value) pair), 4 processes x 8 stages, and two copies of a placed pipeline (4
processes; each stage's two replicas all-reduce at every update)."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from rt_helpers import SkipMLP, batches, loss_fn, sgd, split, tiny_mlp
from rt_tied import TiedLM, plain_sgd_groups

from fxpipe.runtime.schedules.ncclcheck import check_logs
from fxpipe.runtime.errors import RuntimeConfigError
from fxpipe.runtime.execution.hosted import check_hostable
from fxpipe.runtime.execution.launch import PlacedJob, run_placed_jobs
from fxpipe.runtime.schedules.placement import PlacedSchedule, make_placed_schedule, validate_placed
from fxpipe.runtime.execution.reference import ReferenceExecutor
from fxpipe.runtime.schedules.schedule import Action, Schedule, ScheduleError
from fxpipe.runtime.schedules.kinds import make_schedule
from fxpipe.runtime.replica.step_options import StepOptions
from rt_faults import Die

TIGHT = dict(rtol=1e-6, atol=1e-7)


class TwoConsumers(nn.Module):
    """h1 feeds stage 1 and stage 2 (cuts [2, 4, 7]); under zb-v on 2 processes both are on
    process 1, so h1 crosses the same pair of processes twice per minibatch, each way."""

    def __init__(self, seed: int = 0, width: int = 6) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.l1, self.l2 = nn.Linear(4, width), nn.Linear(width, width)
        self.l3, self.l4 = nn.Linear(width, width), nn.Linear(width, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h1 = torch.tanh(self.l1(x))
        h2 = torch.tanh(self.l2(h1))
        h3 = torch.tanh(self.l3(h2) + h1)
        return self.l4(h3)


def deep_mlp(seed: int = 0, layers: int = 8, width: int = 6) -> nn.Module:
    torch.manual_seed(seed)
    mods: list[nn.Module] = [nn.Linear(4, width)]
    for _ in range(layers - 2):
        mods += [nn.Tanh(), nn.Linear(width, width)]
    return nn.Sequential(*mods, nn.Tanh(), nn.Linear(width, 2))


CASES = {  # model, cuts, kind, processes, stages, minibatches, per batch[, copies]
    "interleaved-2x4": (tiny_mlp, [1, 2, 3], "interleaved-1f1b", 2, 4, 8, 4),
    "zb-v-2x4": (tiny_mlp, [1, 2, 3], "zb-v", 2, 4, 8, 4),
    "interleaved-3-on-2-skip": (SkipMLP, [2, 4], "interleaved-1f1b", 2, 3, 8, 4),
    "zb-v-two-consumers": (TwoConsumers, [2, 4, 7], "zb-v", 2, 4, 6, 3),
    "interleaved-4x8": (deep_mlp, [2, 4, 6, 8, 10, 12, 14], "interleaved-1f1b", 4, 8, 8, 8),
    "zb-v-4x8": (deep_mlp, [2, 4, 6, 8, 10, 12, 14], "zb-v", 4, 8, 8, 4),
    "zb-v-2x4-replicated": (tiny_mlp, [1, 2, 3], "zb-v", 2, 4, 8, 4, 2),
    "interleaved-3-on-2-replicated": (SkipMLP, [2, 4], "interleaved-1f1b", 2, 3, 8, 4, 2),
    "dualpipev-2x4": (tiny_mlp, [1, 2, 3], "dualpipev", 2, 4, 8, 4),
    "dualpipev-two-consumers": (TwoConsumers, [2, 4, 7], "dualpipev", 2, 4, 10, 5),
    "dualpipev-4x8": (deep_mlp, [2, 4, 6, 8, 10, 12, 14], "dualpipev", 4, 8, 16, 8),
    "dualpipev-2x4-replicated": (tiny_mlp, [1, 2, 3], "dualpipev", 2, 4, 16, 8, 2),
}


def _parts(name: str):
    make, cuts, kind, P, S, n, m, *copies = CASES[name]
    placed = make_placed_schedule(kind, P, n, num_stages=S, microbatches=m,
                                  replicas=copies[0] if copies else 1)
    return make, cuts, placed, batches(n), m


@pytest.fixture(scope="module")
def distributed() -> dict[str, object]:
    jobs = []
    for name in CASES:
        make, cuts, placed, data, _ = _parts(name)
        jobs.append(PlacedJob(split(make(), cuts), placed, loss_fn, sgd, data,
                              record_comm=True))
    return dict(zip(CASES, run_placed_jobs(jobs, timeout_s=30.0, join_timeout_s=300.0)))


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", list(CASES))
def test_distributed_equals_reference_and_minibatch_sgd(name: str, distributed) -> None:
    make, cuts, placed, data, m = _parts(name)
    stages = split(make(), cuts)
    assert len(stages) == placed.schedule.num_stages
    ref = ReferenceExecutor(stages, list(placed.schedule.replicas), placed.schedule, loss_fn,
                            sgd).run(data)
    got = distributed[name]
    torch.testing.assert_close(got.losses, ref.losses, **TIGHT)
    for rank in ref.replica_params:
        torch.testing.assert_close(got.replica_params[rank], ref.replica_params[rank], **TIGHT)
    assert got.peak_bytes == ref.peak_bytes
    want = plain_sgd_groups(make(), data, m, loss_fn, sgd)
    for params in ref.replica_params.values():
        for n, p in params.items():
            torch.testing.assert_close(p, want[n], **TIGHT, msg=f"{name} {n}")
    R = placed.schedule.replicas[0]
    assert len(want) * R == sum(len(p) for p in ref.replica_params.values())
    # every process's real host calls, replayed under NCCL's rules (one stream per process)
    assert sorted(got.comm_logs) == list(range(placed.num_processes))
    assert check_logs(got.comm_logs) > 0


def test_reference_of_a_placed_kind_equals_1f1b_flush() -> None:
    """Same semantics, other order: interleaved's, zb-v's and dualpipev's reference results are
    1f1b-flush's on the same stages, to rounding."""
    data = batches(8)
    flush = make_schedule("1f1b-flush", [1] * 4, 8, microbatches=4)
    want = ReferenceExecutor(split(tiny_mlp(), [1, 2, 3]), [1] * 4, flush, loss_fn, sgd).run(data)
    for kind in ("interleaved-1f1b", "zb-v", "dualpipev"):
        placed = make_placed_schedule(kind, 2, 8, microbatches=4)
        got = ReferenceExecutor(split(tiny_mlp(), [1, 2, 3]), [1] * 4, placed.schedule, loss_fn,
                                sgd).run(data)
        torch.testing.assert_close(got.losses, want.losses, **TIGHT)
        for rank in want.replica_params:
            torch.testing.assert_close(got.replica_params[rank], want.replica_params[rank],
                                       **TIGHT)


def test_what_the_hosted_runtime_does_not_do_is_refused() -> None:
    placed = make_placed_schedule("zb-v", 1, 2, microbatches=2)
    with pytest.raises(RuntimeConfigError) as info:
        check_hostable(split(TiedLM(), [1]), placed, "cpu", StepOptions())
    assert info.value.message.startswith("zb-v with parameters tied across stages")
    stages = split(tiny_mlp(), [2])
    with pytest.raises(RuntimeConfigError, match="on device 'cuda'"):
        check_hostable(stages, placed, "cuda", StepOptions())
    with pytest.raises(RuntimeConfigError, match="global gradient clipping"):
        check_hostable(stages, placed, "cpu", StepOptions(clip_grad_norm=1.0))
    with pytest.raises(RuntimeConfigError, match="3 stages for a zb-v schedule of 2"):
        check_hostable(split(tiny_mlp(), [1, 2]), placed, "cpu", StepOptions())
    # two replicas of a stage on one process would all-reduce with themselves
    sched = Schedule.from_text([2], {(0, 0): "F0 B0 U0", (0, 1): "F1 B1 U0"}, kind="zb-v")
    with pytest.raises(ScheduleError, match="process 0 hosts several replicas of stage 0"):
        validate_placed(PlacedSchedule(sched, (((0, 0), (0, 1)),),
                                       (tuple(((0, j), a) for j in (0, 1)
                                              for a in sched.actions[(0, j)]),)))
    assert Action.parse("U0") == Action("U", 0)


def test_tags_between_two_processes_are_unique_when_two_hosted_stages_share_a_value() -> None:
    """Every remote message of a run, as (sender process, receiver process, tag), is distinct:
    under zb-v h1 goes from stage 0 to stages 1 and 2, both on process 1, and their gradients
    come back with the same (minibatch, value, direction): the tag must name the consumer (gloo
    matches by tag; equal tags would be paired in posting order, which differs from the order
    the gradients are summed in when a value has three consumers)."""
    from fxpipe.runtime.execution.hosted import ProcessExecutor
    from fxpipe.runtime.execution.wire import make_wire_plan

    make, cuts, placed, data, _ = _parts("zb-v-two-consumers")
    stages = split(make(), cuts)
    wire = make_wire_plan(stages, [b[0] for b in data])
    rank_of = {r: p for p, h in enumerate(placed.hosts) for r in h}
    seen: dict[tuple[int, int, int], str] = {}
    shared = 0
    for p in range(placed.num_processes):
        px = ProcessExecutor(stages, placed, p, loss_fn, sgd, wire, rank_of, 5.0, 0.0)
        for r, ex in px.executors.items():
            for m in ex.plan(placed.schedule).ops:
                if not m.send or rank_of[m.peer] == p:
                    continue
                key = (p, rank_of[m.peer], ex._tag(m))
                assert key not in seen, (seen[key], m)
                seen[key] = f"{r} {m}"
                shared += m.name == "tanh" and m.direction == 1
    assert shared == 2 * 6  # two consumers' gradients of h1 per minibatch, 6 minibatches


@pytest.mark.multiprocess
def test_run_distributed_runs_a_placed_schedule_and_a_dead_process_is_named() -> None:
    """run_distributed hands a PlacedSchedule to the hosted runtime (same numbers as the
    reference); then process 1 dies at its 5th step: process 0 times out on a receive from a
    stage process 1 hosts and says so, and the launcher reports both."""
    from fxpipe.runtime.errors import WorkerFailedError
    from fxpipe.runtime.execution.launch import run_distributed

    make, cuts, placed, data, _ = _parts("zb-v-2x4")
    stages = split(make(), cuts)
    got = run_distributed(stages, [1] * 4, placed, loss_fn, sgd, data, timeout_s=20.0,
                          join_timeout_s=120.0)
    ref = ReferenceExecutor(stages, [1] * 4, placed.schedule, loss_fn, sgd).run(data)
    torch.testing.assert_close(got.losses, ref.losses, **TIGHT)
    with pytest.raises(RuntimeConfigError, match="with its own replicas \\[1, 1, 1, 1\\]"):
        run_distributed(stages, [2] * 4, placed, loss_fn, sgd, data)
    with pytest.raises(WorkerFailedError) as info:
        run_distributed(split(make(), cuts), [1] * 4, placed, loss_fn, sgd, data, timeout_s=4.0,
                        join_timeout_s=90.0, hooks={1: Die(4)})
    assert info.value.exitcodes[1] == 17 and info.value.exitcodes[0] == 1
    assert "process 0: stage" in info.value.errors[0]
    assert "(rank 1)" in info.value.errors[0] and "failed (timeout 4 s)" in info.value.errors[0]
