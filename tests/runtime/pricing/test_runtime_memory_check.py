"""check_memory (runtime/pricing/memory.py): a plan's memory split into its rule's terms by hand,
next to measured peaks; the Trainer and the API refuse to report what was not measured."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import fxpipe
from fxpipe.errors import ConfigError
from fxpipe.passes.plan import Plan, StagePlan
from fxpipe.runtime.errors import RuntimeConfigError
from fxpipe.runtime.pricing.memory import check_memory, memory_rule, memory_table


def _stage(i: int, p: float, a: float, v: int, memory: float, state: float) -> StagePlan:
    return StagePlan(index=i, nodes=(f"n{i}",), replicas=1, compute_s=1.0, sync_s=0.0,
                     stage_time_s=1.0, input_bytes=0.0, comm_s=0.0, parameter_bytes=p,
                     activation_bytes=a, memory_bytes=memory, in_flight=v, state_bytes=state)


def _plan(kind: str, stages: tuple[StagePlan, ...]) -> Plan:
    return Plan(stages=stages, cluster={"workers": 2}, sync="allreduce", time_per_minibatch=1.0,
                noam=2, data_parallel_time=2.0, memory_rule=memory_rule(kind))


def test_terms_by_hand() -> None:
    # pipedream, AdamW (opt = 2): stage 0 P = 100, A = 10, v = 2: 4 P + (2 - 1) P + 2 A = 520;
    # stage 1 P = 50, A = 30, v = 1: 200 + 0 + 30 = 230
    plan = _plan("pipedream", (_stage(0, 100, 10, 2, 520, 400), _stage(1, 50, 30, 1, 230, 200)))
    rows = check_memory(plan, [572, 230], {0: {"F": 20}})
    assert [(r.state, r.versions, r.activations) for r in rows] == [(400, 100, 20), (200, 0, 30)]
    assert [r.predicted for r in rows] == [520, 230]
    assert rows[0].ratio == pytest.approx(1.1) and rows[1].ratio == 1.0
    assert rows[0].parts == {"F": 20} and rows[1].parts == {}
    # 1f1b-flush stashes nothing: the same figures are state and activations only
    flush = _plan("1f1b-flush", (_stage(0, 100, 10, 2, 420, 400), _stage(1, 50, 30, 1, 230, 200)))
    assert [r.versions for r in check_memory(flush, [1, 1])] == [0, 0]
    table = memory_table(rows)
    assert table.splitlines()[2].startswith("| 0 | 0.00 |") and "| 1.10 |" in table
    with pytest.raises(ValueError, match="1 measured stages for a plan of 2"):
        check_memory(plan, [1])


def test_not_measured_is_a_clear_error() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    compiled = fxpipe.compile(model, 2, example_inputs=(torch.randn(4, 4),),
                              loss_fn=nn.functional.mse_loss, stages=2, straight=True, repeats=1)
    with pytest.raises(RuntimeConfigError, match="measure_memory=True needs executor="):
        compiled.trainer(optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1), executor="reference",
                         schedule="1f1b-flush", measure_memory=True)
    trainer = compiled.trainer(optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1),
                               executor="reference", schedule="1f1b-flush", progress=False)
    trainer.fit([(torch.randn(4, 4), torch.randn(4, 2))], epochs=1)
    assert trainer.measured_memory() is None and trainer.memory_parts == {}
    with pytest.raises(ConfigError, match="has measured no memory"):
        compiled.memory_check(trainer)


def test_split_backward_kinds_keep_recomputed_sets_until_w() -> None:
    """zb-h1 / zb-h2 recompute in B and need the graph in W: a recomputing stage holds a full
    set per minibatch in flight; the other kinds one while it recomputes."""
    assert [memory_rule(k).recomputed for k in ("zb-h1", "zb-h2", "1f1b-flush", "pipedream",
                                                "2bw", "gpipe")] == ["held"] * 2 + ["one"] * 4
    sp = _stage(0, 100, 10, 3, 0, 400)
    sp = StagePlan(**{**sp.__dict__, "recompute": True, "kept_input_bytes": 2.0})
    from fxpipe.runtime.pricing.memory import schedule_memory
    # state 400 + 3 minibatches' inputs (3 x 2) + one set (10) or three (30)
    assert schedule_memory([sp], "1f1b-flush", [3]) == (400 + 6 + 10,)
    assert schedule_memory([sp], "zb-h1", [3]) == (400 + 6 + 30,)
    rule = memory_rule("zb-h2", 4, 2)
    # zb-h2 holds an update's share, ceil(4 / 1) = 4 microbatches of half a minibatch each
    assert rule.recomputed_sets(3, 1, 4) == rule.sets(3, 1, 4) == 2.0


def test_rules_round_trip_and_stay_readable_by_older_versions() -> None:
    from fxpipe.passes.memory_rule import MemoryRule

    for kind in ("pipedream", "1f1b-flush", "zb-h1", "zb-h2", "2bw", "gpipe"):
        rule = memory_rule(kind, 4, 2)
        assert MemoryRule.from_dict(rule.to_dict()) == rule
    # the fields fxpipe wrote before `recomputed` existed: what a rule without it still writes
    before = {"schedule", "versions", "held", "microbatches", "split", "limit"}
    assert set(memory_rule("1f1b-flush", 4).to_dict()) == before
    assert memory_rule("zb-h2", 4).to_dict()["recomputed"] == "held"
