"""Tied parameters across stages in the reference executor: one logical parameter, whose
gradient at every update is the sum over all its uses (Megatron's embedding all-reduce)."""
from __future__ import annotations

import copy

import pytest
import torch
from rt_helpers import split
from rt_tied import TiedLM, ce, plain_sgd_groups, sgd_m, token_batches
from stale_oracles import tied_lm_pipedream_sgd

from fxpipe.runtime.errors import RuntimeConfigError
from fxpipe.runtime.reference import ReferenceExecutor
from fxpipe.runtime.schedule import make_schedule
from fxpipe.runtime.stage import tied_parameters

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
    gradients, each taken at its own stage's version. Two separate parameters (the untied
    counterfactual) would end measurably elsewhere."""
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
    for name in ("wte.weight", "lm_head.weight"):
        assert float((untied[name] - want[name]).abs().max()) > 1e-3, name


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
