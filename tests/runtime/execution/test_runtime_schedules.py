"""Every schedule, vertical sync and tied parameters, distributed (gloo, CPU) against the
reference executor, and the flush schedules against big-batch SGD.

All the runs share ONE spawned world of 4 ranks (smaller jobs leave the other ranks spare): see
rt_spawn.py. Each test below checks one job of that world.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import pytest
import torch
from rt_helpers import LR, SkipMLP, batches, loss_fn, sgd, split, tiny_mlp
from rt_spawn import Job, run_jobs
from rt_tied import TiedLM, ce, plain_sgd_groups, sgd_m, token_batches
from stale_oracles import pipedream_sgd

from fxpipe.runtime.execution.reference import ReferenceExecutor
from fxpipe.runtime.execution.contract import RunResult
from fxpipe.runtime.schedules.kinds import make_schedule

pytestmark = [pytest.mark.multiprocess]

TIGHT = dict(rtol=1e-6, atol=1e-7)


@dataclass(frozen=True)
class Case:
    make: Callable[[], torch.nn.Module]
    cuts: tuple[int, ...]
    replicas: tuple[int, ...]
    kind: str
    n: int
    m: int | None = None
    noam: int | None = None
    vsync: bool = False
    tied: bool = False

    def data(self) -> list[tuple[Any, Any]]:
        return token_batches(self.n) if self.tied else batches(self.n)

    def fns(self) -> tuple[Any, Any]:
        return (ce, sgd_m) if self.tied else (loss_fn, sgd)

    def schedule(self):
        s = make_schedule(self.kind, list(self.replicas), self.n, microbatches=self.m,
                          noam=self.noam)
        return s.with_vertical_sync() if self.vsync else s

    def job(self) -> Job:
        lf, opt = self.fns()
        return Job(split(self.make(), list(self.cuts)), list(self.replicas), self.schedule(),
                   lf, opt, self.data())

    def reference(self) -> RunResult:
        lf, opt = self.fns()
        return ReferenceExecutor(split(self.make(), list(self.cuts)), list(self.replicas),
                                 self.schedule(), lf, opt).run(self.data())


TWO = {**{f"{k}-2stage": Case(tiny_mlp, (2,), (1, 1), k, 12 if k == "2bw" else 8, 4)
          for k in ("1f1b-flush", "gpipe", "2bw")},
       # a tie of two ranks: its sum travels as two messages (Comm.tied_send), not an all-reduce
       "tied-1f1b-flush-2stage": Case(TiedLM, (1,), (1, 1), "1f1b-flush", 8, 4, tied=True)}
THREE = {
    **{f"{k}-2-1": Case(tiny_mlp, (2,), (2, 1), k, 12 if k == "2bw" else 8, 4)
       for k in ("1f1b-flush", "gpipe", "2bw")},
    "pipedream-2-1": Case(tiny_mlp, (2,), (2, 1), "pipedream", 8),
    "pipedream-3stage-skip": Case(SkipMLP, (2, 4), (1, 1, 1), "pipedream", 8),
    "pipedream-3stage-vsync": Case(tiny_mlp, (1, 3), (1, 1, 1), "pipedream", 8, vsync=True),
    "pipedream-4stage": Case(tiny_mlp, (1, 2, 3), (1, 1, 1, 1), "pipedream", 8),
    "tied-pipedream-3stage": Case(TiedLM, (1, 3), (1, 1, 1), "pipedream", 8, tied=True),
    "tied-noam1-3stage": Case(TiedLM, (1, 3), (1, 1, 1), "pipedream", 6, noam=1, tied=True),
    "tied-1f1b-flush-2-1": Case(TiedLM, (1,), (2, 1), "1f1b-flush", 8, 4, tied=True),
}


@pytest.fixture(scope="module")
def results() -> dict[str, RunResult]:
    cases = {**TWO, **THREE}
    return dict(zip(cases, run_jobs([c.job() for c in cases.values()])))


@pytest.fixture(scope="module")
def two_rank(results) -> dict[str, RunResult]:
    return {n: results[n] for n in TWO}


@pytest.fixture(scope="module")
def three_rank(results) -> dict[str, RunResult]:
    return {n: results[n] for n in THREE}


def _result(name: str, two_rank, three_rank) -> tuple[Case, RunResult]:
    return (TWO[name], two_rank[name]) if name in TWO else (THREE[name], three_rank[name])


@pytest.mark.parametrize("name", [*TWO, *THREE])
def test_distributed_equals_reference(name: str, two_rank, three_rank) -> None:
    case, got = _result(name, two_rank, three_rank)
    ref = case.reference()
    torch.testing.assert_close(got.losses, ref.losses, **TIGHT)
    for rank in ref.replica_params:
        torch.testing.assert_close(got.replica_params[rank], ref.replica_params[rank], **TIGHT)
    assert got.peak_bytes == ref.peak_bytes


@pytest.mark.parametrize("name", ["1f1b-flush-2stage", "gpipe-2stage", "1f1b-flush-2-1",
                                  "gpipe-2-1", "tied-1f1b-flush-2-1", "tied-noam1-3stage",
                                  "tied-1f1b-flush-2stage"])
def test_equals_plain_sgd(name: str, two_rank, three_rank) -> None:
    """Flush schedules accumulate m microbatch gradients = one SGD step on their concatenation
    (mean losses, equal microbatches); NOAM = 1 is plain SGD. Both executors must agree."""
    case, got = _result(name, two_rank, three_rank)
    lf, opt = case.fns()
    want = plain_sgd_groups(case.make(), case.data(), case.m or 1, lf, opt)
    for res in (got, case.reference()):
        for rank, params in res.replica_params.items():
            for n, p in params.items():
                torch.testing.assert_close(p, want[n], **TIGHT, msg=f"{name} {rank} {n}")


@pytest.mark.parametrize("name", [n for n, c in {**TWO, **THREE}.items() if c.tied])
def test_tied_copies_stay_identical(name: str, two_rank, three_rank) -> None:
    case, res = _result(name, two_rank, three_rank)
    copies = [p[n] for p in res.replica_params.values() for n in ("wte.weight", "lm_head.weight")
              if n in p]
    assert len(copies) == (3 if case.replicas == (2, 1) else 2)
    for c in copies[1:]:
        assert torch.equal(c, copies[0])


def test_vertical_sync_follows_its_rule_distributed(three_rank) -> None:
    """The distributed vertical-sync run (float32) against the rule written as plain PyTorch
    (stale_oracles.pipedream_sgd: every stage uses the version stage 0 read), to float32
    rounding; plain pipedream ends far outside that tolerance."""
    data = THREE["pipedream-3stage-vsync"].data()
    w0 = {n: p.detach().clone() for n, p in tiny_mlp().named_parameters()}
    layer_stage = (0, 1, 1, 2, 2)  # cuts (1, 3): Linear | Tanh, Linear | Tanh, Linear
    losses, want = pipedream_sgd(w0, layer_stage, (1, 1, 1), data, LR, vertical_sync=True)
    got = three_rank["pipedream-3stage-vsync"]
    torch.testing.assert_close(got.losses, losses, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got.merged_params(), want, rtol=1e-5, atol=1e-6)
    _, plain = pipedream_sgd(w0, layer_stage, (1, 1, 1), data, LR)
    assert max(float((plain[n] - want[n]).abs().max()) for n in want) > 1e-3


def test_every_job_timeline_is_sequential_per_rank(two_rank, three_rank) -> None:
    for res in [*two_rank.values(), *three_rank.values()]:
        for rank, evs in res.timeline.items():
            assert evs, rank
            for a, b in zip(evs, evs[1:]):
                assert a.end <= b.start + 1e-9, (rank, a, b)


def test_a_tie_of_two_ranks_is_summed_by_messages_posted_ahead(two_rank) -> None:
    """Under 1f1b-flush on 2 stages the tied embedding/head sum is two messages, one per
    direction on a channel of its own, not an all-reduce; each rank posts the receive of the
    other's part for update k before it waits for the gradients that its update k sums (so the
    part ready first crosses while the other rank still computes); the logs passed the NCCL
    checker in run_jobs. Distributed == reference and == plain SGD: the tests above."""
    res = two_rank["tied-1f1b-flush-2stage"]
    for rank, log_ in res.comm_logs.items():
        other = 1 - rank
        assert not [ev for ev in log_ if ev[0] == "coll" and ev[1] != "world"]
        posted = {ev[2][0][2]: i for i, ev in enumerate(log_)
                  if ev[0] == "p2p" and ev[3] == f"tied {other}->{rank}"}
        sent = {ev[2][0][2]: i for i, ev in enumerate(log_)
                if ev[0] == "p2p" and ev[3] == f"tied {rank}->{other}"}
        grads = {ev[1] for ev in log_ if ev[0] == "p2p" and ev[3] == "gradients"
                 and not ev[2][0][0]}  # stage 0's gradient receives (none on the last stage)
        assert sorted(posted) == sorted(sent) == [0, 1]  # 8 minibatches, m = 4: two updates
        for k in (0, 1):
            between = [ev for ev in log_[posted[k]:sent[k]] if ev[0] == "wait"]
            assert between, (rank, k)  # waits for the round's messages came after the post
            if rank == 0:
                assert any(ev[1] in grads for ev in between), k
