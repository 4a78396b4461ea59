"""Tied parameters across stages in the reference executor: one logical parameter, whose
gradient at every update is the sum over all its uses (Megatron's embedding all-reduce)."""
from __future__ import annotations

import copy
import functools

import pytest
import torch
from rt_helpers import split
from rt_tied import TiedLM, ce, plain_sgd_groups, sgd_m, token_batches
from stale_oracles import tied_lm_pipedream_sgd

from fxpipe.runtime.errors import RuntimeConfigError
from fxpipe.runtime.execution.reference import ReferenceExecutor
from fxpipe.runtime.schedules.kinds import make_schedule
from fxpipe.runtime.schedules.simulate import simulate
from fxpipe.runtime.replica.stage import sync_components, tied_parameters
from fxpipe.runtime.training.trainer import Trainer

sgd_plain = functools.partial(torch.optim.SGD, lr=0.1)

CLOSE = dict(rtol=1e-6, atol=1e-7)


def test_tied_parameter_is_found_across_stages() -> None:
    stages = split(TiedLM(), [1, 3])
    (t,) = tied_parameters(stages)
    assert t.key == "wte.weight" and dict(t.names) == {0: "wte.weight", 2: "lm_head.weight"}


def test_noam_one_tied_equals_plain_sgd() -> None:
    data = token_batches(6)
    model = TiedLM()
    sched = make_schedule("pipedream", [1, 1, 1], 6, noam=1)
    res = ReferenceExecutor(split(copy.deepcopy(model), [1, 3]), [1, 1, 1], sched, ce,
                            sgd_m).run(data)
    want = plain_sgd_groups(model, data, 1, ce, sgd_m)
    torch.testing.assert_close(res.merged_params(), want, **CLOSE)
    assert torch.equal(res.params[0]["wte.weight"], res.params[2]["lm_head.weight"])


def test_pipelined_tied_copies_stay_identical_and_differ_from_untied() -> None:
    """3-stage pipedream, float64, against TiedLM's stale momentum SGD written out
    (stale_oracles.tied_lm_pipedream_sgd): both copies step with the sum of both uses'
    gradients, each taken at its own stage's version, applied 2 updates late (in-flight windows
    3 - 1; the last 2 rounds at the end). Two separate parameters (the untied counterfactual)
    would end measurably elsewhere, and so would the synchronous sum (delay 0)."""
    data = token_batches(8)
    sched = make_schedule("pipedream", [1, 1, 1], 8)
    model = TiedLM().double()
    w0 = {n: p.detach().clone() for n, p in model.named_parameters()}
    res = ReferenceExecutor(split(model, [1, 3]), [1, 1, 1], sched, ce, sgd_m).run(data)
    assert torch.equal(res.params[0]["wte.weight"], res.params[2]["lm_head.weight"])
    losses, want = tied_lm_pipedream_sgd(w0, data, lr=0.1, momentum=0.9)
    torch.testing.assert_close(res.losses, losses, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(res.merged_params(), want, rtol=1e-10, atol=1e-12)
    _, untied = tied_lm_pipedream_sgd(w0, data, lr=0.1, momentum=0.9, tied=False)
    _, undelayed = tied_lm_pipedream_sgd(w0, data, lr=0.1, momentum=0.9, delay=0)
    for name in ("wte.weight", "lm_head.weight"):
        assert float((untied[name] - want[name]).abs().max()) > 1e-3, name
        assert float((undelayed[name] - want[name]).abs().max()) > 1e-3, name


@pytest.mark.parametrize("kind", ["1f1b-flush", "gpipe"])
def test_flush_tied_replicated_equals_big_batch_sgd(kind: str) -> None:
    """[2, 1]: the tied weight lives on both replicas of stage 0 and on stage 1."""
    data = token_batches(8)
    model = TiedLM()
    sched = make_schedule(kind, [2, 1], 8, microbatches=4)
    res = ReferenceExecutor(split(copy.deepcopy(model), [1]), [2, 1], sched, ce, sgd_m).run(data)
    want = plain_sgd_groups(model, data, 4, ce, sgd_m)
    for rank, params in res.replica_params.items():
        for n, p in params.items():
            torch.testing.assert_close(p, want[n], **CLOSE, msg=f"{rank} {n}")


def test_tied_with_unequal_update_counts_is_rejected() -> None:
    with pytest.raises(RuntimeConfigError, match="same update cadence"):
        ReferenceExecutor(split(TiedLM(), [1]), [2, 1], make_schedule("pipedream", [2, 1], 8),
                          ce, sgd_m)


def test_pipedream_tied_sum_no_longer_locks_stage_0_and_the_last_stage() -> None:
    """4 unit-time stages (F = B = 1), wte on stage 0 and lm_head on stage 3. Untied, 1F1B
    finishes a minibatch every 2 units. A synchronous tied all-reduce at every update makes the
    last stage wait, at each update i, for stage 0's update i, which follows the backward of i
    through every stage: F3 + B3 + B2 + B1 + B0 = 5 units per minibatch. The runtime's delay
    (windows 4 - 1 = 3 rounds) removes the wait entirely."""
    from fxpipe.runtime.execution.contract import tied_delay

    stages = split(TiedLM(), [1, 2, 3])
    sched = make_schedule("pipedream", [1, 1, 1, 1], 400)
    sync = sync_components(tied_parameters(stages))
    assert sync == [(0, 3)]
    d = tied_delay(sched, tied_parameters(stages))
    assert d == 3
    unit = ([1.0] * 4, [1.0] * 4)
    assert simulate(sched, *unit).steady_state_period == 2.0
    assert simulate(sched, *unit, sync=sync, delay=0).steady_state_period == 5.0
    assert simulate(sched, *unit, sync=sync, delay=d).steady_state_period == 2.0
    # flushing kinds and NOAM = 1 keep the synchronous sum (no lag to hide; exact SGD)
    assert tied_delay(make_schedule("1f1b-flush", [1, 1, 1, 1], 8), tied_parameters(stages)) == 0
    assert tied_delay(make_schedule("pipedream", [1, 1, 1, 1], 8, noam=1),
                      tied_parameters(stages)) == 0


def test_delayed_tied_rounds_feed_every_copy_the_same_sums() -> None:
    """Plain SGD (no momentum): a copy's final value is its start minus lr times the sum of
    every round's mean tied gradient, whatever the delay, so the delayed rounds (applied d
    updates late, the last d at the segment end) must add up to the synchronous total of the
    same gradients. Checked by replaying the reference's own recorded round sums by hand."""
    stages = split(TiedLM(), [1, 3])
    sched = make_schedule("pipedream", [1, 1, 1], 8)
    ex = ReferenceExecutor(stages, [1, 1, 1], sched, ce, sgd_plain)
    start = ex.workers[(0, 0)].stash.latest["wte.weight"].detach().clone()
    rounds: list[torch.Tensor] = []
    real = ex._round_grads

    def spy(r, key, names, j):
        out = real(r, key, names, j)
        if r == (0, 0) and j >= 0:
            rounds.append(out["wte.weight"].clone())
        return out
    ex._round_grads = spy  # type: ignore[method-assign]
    res = ex.run(token_batches(8))
    assert ex._delay == 2 and len(rounds) == 8  # 6 at updates 2..7, 2 at the segment end
    want = start - 0.1 * torch.stack(rounds).sum(0)
    torch.testing.assert_close(res.params[0]["wte.weight"], want, **CLOSE)
    assert torch.equal(res.params[0]["wte.weight"], res.params[2]["lm_head.weight"])


def test_distributed_trainer_refuses_unequal_tied_cadence_at_once(monkeypatch) -> None:
    """GPT-like tie between stages 0 and 2 with replicas [2, 1, 1] under pipedream: stage 0
    updates once per 2 minibatches, stage 2 after each, so their tied all-reduces could never
    pair up (a hang until the timeout, blaming a peer). Refused before any process group."""
    for var, value in (("RANK", "0"), ("WORLD_SIZE", "4"), ("MASTER_ADDR", "127.0.0.1"),
                       ("MASTER_PORT", "1")):
        monkeypatch.setenv(var, value)

    def no_rendezvous(*args: object, **kwargs: object) -> None:
        raise AssertionError("the process group was started before the cadence check")

    monkeypatch.setattr(torch.distributed, "init_process_group", no_rendezvous)
    with pytest.raises(RuntimeConfigError, match="same update cadence"):
        Trainer(split(TiedLM(), [1, 3]), [2, 1, 1], ce, sgd_m, executor="distributed",
                timeout_s=3, progress=False)
