"""Replicas' gradient all-reduce bucketed and overlapped with the backward pass (as DDP does).

Unit tests of the bucket layout and round logic need no processes; the distributed checks share
ONE spawned world of 3 ranks (rt_spawn.py), with a tiny bucket cap so that every replicated stage
has several buckets, and compare the overlapped path with the reference executor and with the
flat all-reduce (``overlap_allreduce=False``).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable

import pytest
import torch
from rt_helpers import batches, loss_fn, sgd, split, tiny_mlp
from rt_spawn import Job, run_jobs
from rt_tied import TiedLM, ce, sgd_m, token_batches

from fxpipe.runtime.execution import launch
from fxpipe.runtime.execution.buckets import BucketLayout, GradBuckets, Slot, last_backwards
from fxpipe.runtime.execution.worker import WorkerConfig
from fxpipe.runtime.execution.reference import ReferenceExecutor
from fxpipe.runtime.execution.contract import RunResult
from fxpipe.runtime.schedules.kinds import make_schedule
from fxpipe.runtime.replica.stage import StageReplica
from rt_faults import Hang

TIGHT = dict(rtol=1e-6, atol=1e-7)
TINY = 96  # bytes: stage 0 of the width-16 MLP (2 linear layers) then has 4 buckets
wide_mlp = functools.partial(tiny_mlp, width=16)


# ----------------------------------------------------------------------------- no processes
def test_layout_reverse_order_cap_and_count() -> None:
    params = {"a": torch.zeros(4), "b": torch.zeros(30), "c": torch.zeros(2), "d": torch.zeros(3)}
    lay = BucketLayout.build(params, ["a", "b", "c", "d"], cap_bytes=24)
    assert lay.buckets == (("d", "c"), ("b",), ("a",))  # b (120 B) alone: larger than the cap
    assert lay.sizes == (5, 30, 4 + 1)  # the count rides in the last bucket
    assert lay.slots["c"].offset == 3 and lay.slots["c"].bucket == 0
    empty = BucketLayout.build({}, [], count_dtype=torch.float64)
    assert empty.sizes == (1,) and empty.dtypes == (torch.float64,)


def test_last_backwards_marks_the_final_backward_of_each_round() -> None:
    assert last_backwards("FFBUFBUFBUBU") == {2: 3, 5: 6, 8: 9, 10: 11}
    assert last_backwards("FFBBUFFBBU") == {3: 4, 8: 9}  # B0 of a flush round: sums not final
    assert last_backwards("FFBUFBUBUU") == {2: 3, 5: 6, 7: 8}  # the last U has no backward


def test_buckets_launch_in_order_and_rebuild_the_flat_layout() -> None:
    params = {n: torch.randn(3) for n in "abcd"}
    lay = BucketLayout.build(params, list(params), cap_bytes=12)  # one parameter per bucket
    launched: list[int] = []
    bk = GradBuckets(lay, torch.device("cpu"), lambda i, buf: launched.append(i) or i)
    bk.start()
    bk.ready("c", params["c"])  # bucket 1: waits for bucket 0 (parameter d)
    assert launched == []
    bk.ready("d", params["d"])
    assert launched == [0, 1]
    with pytest.raises(RuntimeError, match="twice"):
        bk.ready("d", params["d"])
    bk.finish({"b": params["b"]}, count=3)  # a: no gradient -> zeros; the count; the rest
    assert launched == [0, 1, 2, 3] and bk.pending == [0, 1, 2, 3]
    want = torch.cat([torch.zeros(3), params["b"], params["c"], params["d"], torch.tensor([3.])])
    assert torch.equal(bk.flat(), want) and not bk.active


def test_only_parameters_outside_the_last_bucket_are_hooked() -> None:
    params = {n: torch.randn(3) for n in "abcd"}
    several = GradBuckets(BucketLayout.build(params, list(params), cap_bytes=24),
                          torch.device("cpu"), lambda i, buf: i)
    assert several.layout.buckets == (("d", "c"), ("b", "a"))
    assert several.early == {"c", "d"}  # a and b share the count's bucket: launched at finish
    one = GradBuckets(BucketLayout.build(params, list(params)), torch.device("cpu"),
                      lambda i, buf: i)
    assert one.early == frozenset()


def test_grads_are_the_mean_divided_once_per_bucket() -> None:
    params = {n: torch.randn(2, 3) for n in "abc"}
    sums = {n: torch.randn(2, 3) for n in "abc"}
    for count, want_div in ((4, 4.0), (2, 2.0), (1, 1.0), (0, 1.0)):
        bk = GradBuckets(BucketLayout.build(params, list(params), cap_bytes=24),
                         torch.device("cpu"), lambda i, buf: i)
        bk.start()
        bk.finish(sums, count=count)
        grads, got = bk.grads(params)
        assert got == count and not bk.active
        for n in "abc":  # bit-identical to dividing each parameter's sum on its own
            assert grads[n].shape == (2, 3) and torch.equal(grads[n], sums[n] / want_div)


def test_hooking_a_subset_reports_only_it_and_changes_nothing() -> None:
    (spec,) = split(wide_mlp(), [])
    x, y = batches(1)[0]
    seen: list[str] = []
    rep, plain = StageReplica(spec, sgd, loss_fn=loss_fn), StageReplica(spec, sgd, loss_fn=loss_fn)
    first = rep.stash.trainable[0]
    for r, hook in ((rep, lambda n, g: seen.append(n)), (plain, None)):
        r.forward(0, None, [x], y)
        r.backward(0, [], on_grad=hook, hooked={first})
    assert seen == [first]
    assert torch.equal(rep.local_gradient(), plain.local_gradient())


def test_hooks_report_each_sum_mid_backward_and_change_nothing() -> None:
    """The hook path of StageReplica.backward keeps bit-identical gradient sums."""
    (spec,) = split(wide_mlp(), [])
    data = batches(2)

    def run(hook: Callable[[str, torch.Tensor], None] | None) -> StageReplica:
        rep = StageReplica(spec, sgd, loss_fn=loss_fn)
        for k, (x, y) in enumerate(data):
            rep.forward(k, None, [x], y)
            rep.backward(k, [], on_grad=hook if k == 1 else None)
        return rep

    seen: list[tuple[str, torch.Tensor]] = []
    hooked, plain = run(lambda n, g: seen.append((n, g.clone()))), run(None)
    names = hooked.stash.trainable
    assert [n for n, _ in seen] == list(reversed(names))  # reverse order of use
    for n, g in seen:
        assert torch.equal(g, hooked.grad_sums[n]) and torch.equal(g, plain.grad_sums[n])
    assert hooked.count == plain.count == 2
    assert torch.equal(hooked.local_gradient(), plain.local_gradient())


def test_layout_starts_a_bucket_at_the_cap_and_at_each_dtype_change() -> None:
    """Reversed order y, big, h, x with a 16-byte cap: big (40 B) does not fit after y (4 B) and
    gets a bucket of its own; h is float64 and x float32 again: a bucket each. Exactly at the
    cap still fits; a parameter larger than the cap first opens no empty bucket."""
    params = {"x": torch.zeros(1), "h": torch.zeros(2, dtype=torch.float64),
              "big": torch.zeros(10), "y": torch.zeros(1)}
    lay = BucketLayout.build(params, ["x", "h", "big", "y"], cap_bytes=16)
    assert lay.buckets == (("y",), ("big",), ("h",), ("x",)) and len(lay) == 4
    assert lay.sizes == (1, 10, 2, 2)
    assert lay.dtypes == (torch.float32, torch.float32, torch.float64, torch.float32)
    assert lay.slots["h"] == Slot(2, 0, 2) and lay.names == ("x", "h", "big", "y")
    two = BucketLayout.build({"a": torch.zeros(2), "b": torch.zeros(2)}, ["a", "b"],
                             cap_bytes=16)
    assert two.buckets == (("b", "a"),) and two.slots["a"] == Slot(0, 2, 2)
    assert BucketLayout.build({"big": torch.zeros(10)}, ["big"], cap_bytes=8).sizes == (11,)


def test_default_cap_is_ddps_25_mib_counted_in_bytes() -> None:
    """DDP's bucket_cap_mb default, 25 MiB = 26214400 bytes: float32 parameters of 12 MiB and
    13 MiB share one bucket, one element more opens a second. Bytes, not elements: a 1-byte
    dtype packs by its own size (cap 2: 1 + 2 bytes do not fit). A bucket holding no bytes yet
    (a zero-size parameter) takes the next parameter whatever its size. Meta tensors: only
    sizes and dtypes matter."""
    def meta(n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.empty(n, dtype=dtype, device="meta")
    mib = 2 ** 20
    fits = {"a": meta(3 * mib), "b": meta(13 * mib // 4)}  # 12 MiB + 13 MiB of float32
    assert BucketLayout.build(fits, ["a", "b"]).buckets == (("b", "a"),)
    over = {"a": meta(3 * mib + 1), "b": meta(13 * mib // 4)}
    assert BucketLayout.build(over, ["a", "b"]).buckets == (("b",), ("a",))
    small = {"x": meta(2, torch.uint8), "y": meta(1, torch.uint8)}
    assert BucketLayout.build(small, ["x", "y"], cap_bytes=2).buckets == (("y",), ("x",))
    empty_first = {"big": meta(10), "z": meta(0)}
    assert BucketLayout.build(empty_first, ["big", "z"], cap_bytes=8).buckets == (("z", "big"),)


def test_layouts_and_slots_cannot_be_changed_once_built() -> None:
    """Every replica must keep the layout it built (the collectives match bucket by bucket)."""
    import dataclasses
    lay = BucketLayout.build({"a": torch.zeros(2)}, ["a"])
    with pytest.raises(dataclasses.FrozenInstanceError):
        lay.sizes = (1,)  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        lay.slots["a"].offset = 1  # type: ignore[misc]


def test_a_round_is_opened_once_and_closed_by_reading_it() -> None:
    params = {"a": torch.ones(2), "b": torch.ones(3, dtype=torch.float64)}
    bk = GradBuckets(BucketLayout.build(params, ["a", "b"]), torch.device("cpu"),
                     lambda i, buf: i)
    assert [b.dtype for b in bk.bufs] == [torch.float64, torch.float32]
    bk.start()
    with pytest.raises(RuntimeError) as info:
        bk.start()
    assert str(info.value) == "gradient buckets: a round is already open (missing wait at U)"
    bk.finish({"a": torch.full((2,), 6.0), "b": torch.full((3,), 3.0, dtype=torch.float64)},
              count=3)
    flat = bk.flat()  # float64: the promotion of the buckets' dtypes
    assert flat.dtype == torch.float64 and flat.tolist() == [6.0, 6.0, 3.0, 3.0, 3.0, 3.0]
    assert not bk.active
    bk.start()  # a new round reuses the buffers
    bk.finish({"a": torch.full((2,), 6.0)}, count=3)  # b got no gradient: zeros
    grads, count = bk.grads(params)
    assert count == 3.0 and grads["a"].tolist() == [2.0, 2.0] and grads["b"].tolist() == [0.0] * 3
    assert bk.bufs[-1][-1].item() == 3.0  # the count itself is not divided


def test_a_gradient_reported_twice_in_a_round_is_refused() -> None:
    """A second hook call would add the parameter's sum into its bucket twice."""
    params = {"a": torch.ones(2), "b": torch.ones(2)}
    bk = GradBuckets(BucketLayout.build(params, ["a", "b"], cap_bytes=8), torch.device("cpu"),
                     lambda i, buf: i)
    bk.start()
    bk.ready("b", torch.ones(2))
    with pytest.raises(RuntimeError) as info:
        bk.ready("b", torch.ones(2))
    assert str(info.value) == "gradient of 'b' reported twice in one round"
    assert bk.pending == [0]  # b's bucket (the first: reverse order) went out once


def test_one_bucket_reads_back_flat_in_its_own_dtype() -> None:
    """A single bucket (the usual small stage): flat() is its sums then the count, float64."""
    params = {"a": torch.ones(2, dtype=torch.float64)}
    bk = GradBuckets(BucketLayout.build(params, ["a"]), torch.device("cpu"), lambda i, buf: i)
    bk.start()
    bk.finish({"a": torch.tensor([1.5, 2.5], dtype=torch.float64)}, count=2)
    flat = bk.flat()
    assert flat.dtype == torch.float64 and flat.tolist() == [1.5, 2.5, 2.0]


def test_last_backwards_edge_cases() -> None:
    assert last_backwards("") == {} and last_backwards("UU") == {} and last_backwards("FB") == {}
    assert last_backwards("FBBU") == {2: 3} and last_backwards("FBUBU") == {1: 2, 3: 4}


# ----------------------------------------------------------------------------- distributed
@dataclass(frozen=True)
class Case:
    kind: str
    n: int
    m: int | None = None
    replicas: tuple[int, ...] = (2, 1)
    overlap: bool = True
    tied: bool = False

    def parts(self) -> tuple[Any, ...]:
        """(stages, schedule, loss, optimizer, data) -- fresh each call."""
        model, cuts = (TiedLM(), [1]) if self.tied else (wide_mlp(), [4][:len(self.replicas) - 1])
        sched = make_schedule(self.kind, list(self.replicas), self.n, microbatches=self.m)
        lf, opt = (ce, sgd_m) if self.tied else (loss_fn, sgd)
        data = token_batches(self.n) if self.tied else batches(self.n)
        return split(model, cuts), sched, lf, opt, data

    def job(self) -> Job:
        stages, sched, lf, opt, data = self.parts()
        return Job(stages, list(self.replicas), sched, lf, opt, data)

    def reference(self) -> RunResult:
        stages, sched, lf, opt, data = self.parts()
        return ReferenceExecutor(stages, list(self.replicas), sched, lf, opt).run(data)


CASES = {
    "pipedream": Case("pipedream", 7),  # odd: replica 1's last U has no backward
    "pipedream-flat": Case("pipedream", 7, overlap=False),
    "1f1b-flush": Case("1f1b-flush", 5, 3),  # rounds of 2 and 1 minibatches per replica
    "1f1b-flush-flat": Case("1f1b-flush", 5, 3, overlap=False),
    "gpipe": Case("gpipe", 8, 4),
    "2bw": Case("2bw", 12, 4),
    "one-stage-2": Case("pipedream", 6, replicas=(2,)),
    "tied-1f1b-flush": Case("1f1b-flush", 8, 4, tied=True),
}


@pytest.fixture(scope="module")
def results() -> dict[str, RunResult]:
    """Every case in one world; each job's WorkerConfig gets its own overlap option (the
    launcher, run_rank_jobs, builds the configs in job order)."""
    opts = [dict(overlap_allreduce=c.overlap, bucket_bytes=TINY) for c in CASES.values()]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(launch, "WorkerConfig",
                   lambda *a, **kw: WorkerConfig(*a, **kw, **opts.pop(0)))
        got = run_jobs([c.job() for c in CASES.values()])
    assert not opts
    return dict(zip(CASES, got))


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", list(CASES))
def test_distributed_equals_reference(name: str, results) -> None:
    got, ref = results[name], CASES[name].reference()
    torch.testing.assert_close(got.losses, ref.losses, **TIGHT)
    for rank in ref.replica_params:
        torch.testing.assert_close(got.replica_params[rank], ref.replica_params[rank], **TIGHT)
    assert got.peak_bytes == ref.peak_bytes


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", ["pipedream", "1f1b-flush"])
def test_overlapped_and_flat_give_the_same_parameters(name: str, results) -> None:
    a, b = results[name], results[name + "-flat"]
    for rank, params in a.replica_params.items():
        for n, p in params.items():
            assert torch.equal(p, b.replica_params[rank][n]), (name, rank, n)


def _waits(res: RunResult, rank: int) -> list[Any]:
    return [e for e in res.timeline[rank] if e.category == "allreduce"
            and e.name.startswith("allreduce U")]


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", ["pipedream", "1f1b-flush", "one-stage-2"])
def test_first_bucket_is_launched_before_the_backward_ends(name: str, results) -> None:
    """On every replica of stage 0: before each update that follows a backward, bucket 0 was
    launched during that backward (hooks), and every bucket before the wait at U started."""
    res, checked = results[name], 0
    for rank in (0, 1):  # the two replicas of stage 0
        evs = res.timeline[rank]
        waits = _waits(res, rank)
        assert waits and all(w.args["buckets"] >= 3 for w in waits), waits
        for w in waits:
            launched, completed = w.args["launched"], w.args["completed"]
            assert all(t <= w.start for t in launched) and all(
                a <= b for a, b in zip(launched, launched[1:]))
            assert all(c <= w.end + 1e-6 for c in completed)
            prior = [e for e in evs if e.end <= w.start and (e.category == "backward" or (
                e.category == "optimizer" and not e.name.endswith("gradients")))]
            if not prior or prior[-1].category != "backward":
                continue  # a round without a backward: buckets posted at U itself
            b = prior[-1]
            assert b.start < launched[0] < b.end, (rank, b, launched)
            checked += 1
    assert checked >= 2


@pytest.mark.multiprocess
def test_flat_path_has_no_bucket_waits(results) -> None:
    for rank in (0, 1):
        waits = [e for e in results["pipedream-flat"].timeline[rank] if e.category == "allreduce"]
        assert waits and all("buckets" not in e.args for e in waits)


@pytest.mark.multiprocess
def test_hung_replica_fails_the_bucket_wait_naming_the_group() -> None:
    """Replica 1 hangs before its first backward: replica 0 launched its buckets during B0 and
    its wait at U0 times out, naming the replica group and a peer in it."""
    from fxpipe.runtime.errors import WorkerFailedError
    from fxpipe.runtime.execution.launch import run_distributed

    sched = make_schedule("pipedream", [2], 4)
    with pytest.raises(WorkerFailedError) as info:
        run_distributed(split(wide_mlp(), []), [2], sched, loss_fn, sgd, batches(4),
                        timeout_s=2, join_timeout_s=120, hooks={1: Hang(1)})
    msg = info.value.errors[0]
    assert "bucket 0 of U0 among 2 replicas of stage 0" in msg, msg
    assert "stage 0 replica 1 (rank 1)" in msg and "timeout 2 s" in msg, msg


def test_a_lone_update_equals_the_flat_buffer_update_bit_for_bit() -> None:
    """apply_local_update (a lone replica: its sums straight to the optimizer, what both
    executors run for a stage without replicas or ties) against apply_update of the flat buffer
    with presence flags (what replicas all-reduce): the same weights and momentum, bit for bit,
    over two updates of two minibatches each (a count to divide by)."""
    (spec,) = split(wide_mlp(), [])
    data = batches(4)

    def momentum(ps: list[torch.Tensor]) -> torch.optim.Optimizer:
        return torch.optim.SGD(ps, lr=0.1, momentum=0.9)

    lone, flat = (StageReplica(spec, momentum, loss_fn=loss_fn) for _ in range(2))
    for rnd in range(2):
        for rep in (lone, flat):
            for k in (2 * rnd, 2 * rnd + 1):
                rep.forward(k, None, [data[k][0]], data[k][1])
                rep.backward(k, [])
        lone.apply_local_update()
        flat.apply_update(flat.local_gradient(flags=True), None, flags=True)
    for n in lone.stash.trainable:
        assert torch.equal(lone.stash.latest[n], flat.stash.latest[n]), n
    states = [[o.state[p]["momentum_buffer"] for p in o.param_groups[0]["params"]]
              for o in (lone.stash.optimizer, flat.stash.optimizer)]
    assert all(torch.equal(a, b) for a, b in zip(*states)) and len(states[0]) == 6
