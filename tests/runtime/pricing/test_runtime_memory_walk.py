"""The walked peak (runtime/pricing/memory_walk.py): links from a hand-made profile, a 2-stage
1f1b-flush walk computed by hand (receive buffers posted ahead, sends until their proof, working
sets, the update's temporaries), the optimizer step's temporaries measured, and check_memory's
walked column."""
from __future__ import annotations

import pytest
import torch

from fxpipe.costmodel.profile import Profile, ProfileNode
from fxpipe.passes.plan import Plan, StagePlan
from fxpipe.runtime.pricing.memory import check_memory, memory_rule, memory_table
from fxpipe.runtime.pricing.memory_walk import (GRADIENT_WIDTH, LOSS_IN_MODEL, StageBytes,
                                                StagePeak,
                                                gradient_values, stage_bytes, stage_links,
                                                tie_buffers, walk_memory, walk_rank)
from fxpipe.runtime.replica.state_size import step_temporaries, temporaries_for
from fxpipe.runtime.schedules.commplan import MODEL, StageLinks
from fxpipe.runtime.schedules.kinds import make_schedule


def _node(name: str, inputs: tuple[str, ...] = (), out: float = 0.0, p: float = 0.0,
          op: str = "call_module", is_output: bool = False) -> ProfileNode:
    # a module call by default: a layer (a function call on the model inputs alone would be
    # made again by each stage that reads it, passes/made_here: see the test below)
    return ProfileNode(name=name, op=op, target=name, forward_s=1.0, backward_s=2.0,
                       activation_bytes=out, parameter_bytes=p, inputs=inputs,
                       params=("w",) if p else (), is_output=is_output)


def _stage(i: int, nodes: tuple[str, ...], *, p: float = 0.0, a: float = 0.0,
           state: float = 0.0, v: int = 1, recompute: bool = False,
           kept: float | None = None) -> StagePlan:
    return StagePlan(index=i, nodes=nodes, replicas=1, compute_s=1.0, sync_s=0.0,
                     stage_time_s=1.0, input_bytes=0.0, comm_s=0.0, parameter_bytes=p,
                     activation_bytes=a, memory_bytes=state + v * a, in_flight=v,
                     state_bytes=state, recompute=recompute, kept_input_bytes=kept)


def _plan(kind: str, stages: tuple[StagePlan, ...]) -> Plan:
    return Plan(stages=stages, cluster={"workers": len(stages)}, sync="allreduce",
                time_per_minibatch=1.0, noam=len(stages), data_parallel_time=2.0,
                memory_rule=memory_rule(kind))


def test_links_follow_the_values_that_cross() -> None:
    # x -> a -> b -> c(b, a) -> d(c, x), the output; stages {a}, {b}, {c, d}: a skips to stage 2,
    # the model input x is read locally by stages 0 and 2
    prof = Profile(nodes=(_node("x", op="placeholder", out=8), _node("a", ("x",), 16),
                          _node("b", ("a",), 32), _node("c", ("b", "a"), 64),
                          _node("d", ("c", "x"), 4, is_output=True)))
    plan = _plan("1f1b-flush", (_stage(0, ("x", "a")), _stage(1, ("b",)),
                                _stage(2, ("c", "d"))))
    links, sizes = stage_links(plan, prof)
    assert links == (StageLinks(("x",), (MODEL,), ("a",), ((1, 2),)),
                     StageLinks(("a",), (0,), ("b",), ((2,),)),
                     StageLinks(("a", "b", "x"), (0, 1, MODEL), (), ()))
    assert sizes["a"] == 16 and sizes["b"] == 32


def test_a_value_made_from_the_inputs_alone_is_made_where_it_is_read_not_sent() -> None:
    # x -> mask(x) (a function of the model input alone) -> a(x) -> b(a, mask) -> c(b, mask):
    # stages {mask, a}, {b}, {c}: stages 1 and 2 make the mask from x, read locally; only a and
    # b cross
    prof = Profile(nodes=(_node("x", op="placeholder", out=8),
                          _node("mask", ("x",), 4, op="call_function"),
                          _node("a", ("x",), 16, p=40), _node("b", ("a", "mask"), 16),
                          _node("c", ("b", "mask"), 4, is_output=True)))
    plan = _plan("1f1b-flush", (_stage(0, ("x", "mask", "a")), _stage(1, ("b",)),
                                _stage(2, ("c",))))
    links, sizes = stage_links(plan, prof)
    assert links == (StageLinks(("x",), (MODEL,), ("a",), ((1,),)),
                     StageLinks(("a", "x"), (0, MODEL), ("b",), ((2,),)),
                     StageLinks(("b", "x"), (1, MODEL), (), ()))
    assert "mask" not in sizes


def test_two_stage_flush_walk_by_hand() -> None:
    """1f1b-flush, 2 stages, 2 microbatches, one value of X = 4 bytes crossing.

    Stage 0 runs F0 F1 B0 B1 U and receives the gradients g0, g1 (both posted before its first
    forward: their senders start within the runtime's lead); it sends x0 in F0 and x1 in F1,
    each kept until a later message from stage 1 proves it received (g0 proves x0: stage 1
    sent it after consuming x0; nothing before B1 proves x1). At B0: 2 sets held (2 x 10),
    its working set (3), g0 and g1 posted (8), x1 unproven (4): 35, the peak.

    Stage 1 runs F0 B0 F1 B1 U: at B0 one set (6) + working set (2) + x1 posted (4) = 12; at
    U its temporaries (20) beside g0 and g1, which nothing proves (stage 0 sends nothing after
    receiving them): 28, the peak. Base (state) added to both."""
    sched = make_schedule("1f1b-flush", [1, 1], 2, microbatches=2)
    assert [str(a.kind) + str(a.minibatch) for a in sched.actions[(0, 0)]] == \
        ["F0", "F1", "B0", "B1", "U0"]
    links = (StageLinks(("in",), (MODEL,), ("x",), ((1,),)),
             StageLinks(("x",), (0,), ("y",), ((MODEL,),)))
    sizes = {"x": 4.0}
    peak0, parts0 = walk_rank(sched, links, sizes, (0, 0), StageBytes(100.0, 10.0, 3.0, 5.0))
    assert peak0 == 135.0
    assert parts0 == {"base": 100.0, "held": 20.0, "working": 3.0, "received": 8.0,
                      "sent": 4.0}
    peak1, parts1 = walk_rank(sched, links, sizes, (1, 0), StageBytes(50.0, 6.0, 2.0, 20.0))
    assert peak1 == 78.0
    assert parts1 == {"base": 50.0, "held": 0.0, "working": 20.0, "received": 0.0,
                      "sent": 8.0}
    # a microbatch of half the minibatch: every message and set at half its bytes
    half, _ = walk_rank(sched, links, sizes, (0, 0), StageBytes(100.0, 5.0, 1.5, 5.0), 0.5)
    assert half == 100.0 + 10.0 + 1.5 + 4.0 + 2.0


def test_split_backward_holds_what_w_needs_until_w() -> None:
    """zb-h1, stage 0 of 2: F0 F1 B0 W0 B1 W1 U; B leaves ``for_w`` (7) per minibatch until its
    W (no bytes on the wire here). At B0: sets 0 and 1 (20) + its working set (3) = 123; at W0:
    set 0 with what B0 left (17) and set 1 (10) = 127, the peak; after W0 set 0 is gone."""
    sched = make_schedule("zb-h1", [1, 1], 2, microbatches=2)
    assert [a.kind + str(a.minibatch) for a in sched.actions[(0, 0)]] == \
        ["F0", "F1", "B0", "W0", "B1", "W1", "U0"]
    links = (StageLinks(("in",), (MODEL,), ("x",), ((1,),)),
             StageLinks(("x",), (0,), ("y",), ((MODEL,),)))
    peak, parts = walk_rank(sched, links, {}, (0, 0), StageBytes(100.0, 10.0, 3.0, 0.0, 7.0))
    assert peak == 127.0 and parts["held"] == 27.0 and parts["working"] == 0.0
    # without the split's term the peak is B0's, 123
    assert walk_rank(sched, links, {}, (0, 0), StageBytes(100.0, 10.0, 3.0, 0.0))[0] == 123.0
    # a W that needs more than a set: at W0, set 0 (10 + 30) and set 1 (10)
    peak, parts = walk_rank(sched, links, {}, (0, 0), StageBytes(100.0, 10.0, 3.0, 0.0, 30.0))
    assert peak == 150.0 and parts == {"base": 100.0, "held": 50.0, "working": 0.0,
                                       "received": 0.0, "sent": 0.0}


def test_stage_terms_from_the_profile() -> None:
    # stage 0: a(x) with a 40-byte weight, out 16; stage 1: b(a) weightless out 32, d(b) with a
    # 24-byte weight, the output (8 bytes); state 4 P; AdamW-like temporaries 1 P + 2 L
    prof = Profile(nodes=(_node("x", op="placeholder", out=8), _node("a", ("x",), 16, p=40),
                          _node("b", ("a",), 32), _node("d", ("b",), 8, p=24,
                                                          is_output=True)))
    plan = _plan("1f1b-flush", (_stage(0, ("x", "a"), p=40, a=24, state=160, v=2),
                                _stage(1, ("b", "d"), p=24, a=40, state=96)))
    t = stage_bytes(plan, prof, "1f1b-flush", [2, 1], temporaries=(1.0, 2.0))
    # working set: the largest node's output + its inputs: a 16 + x 8; b 32 + a 16 = 48
    # (+ the loss's output 8 on the last stage); W needs the weighted nodes' outputs
    assert t[0] == StageBytes(base=160, held=24, backward=24, update=40 + 80, for_w=16)
    assert t[1] == StageBytes(base=96, held=40 + 8, backward=48 + 8, update=24 + 48, for_w=8)
    # a microbatch of half the minibatch: every per-minibatch term at half (the state whole)
    h = stage_bytes(plan, prof, "1f1b-flush", [2, 1], temporaries=(1.0, 2.0), scale=0.5)[1]
    assert h == StageBytes(base=96, held=24, backward=28, update=24 + 48, for_w=4)
    # a model that computes its own loss: its output still kept, the loss's backward the graph's
    own = Profile(nodes=prof.nodes, meta={LOSS_IN_MODEL: True})
    assert stage_bytes(plan, own, "1f1b-flush", [2, 1], temporaries=(1.0, 2.0))[1] == \
        StageBytes(base=96, held=40 + 8, backward=48, update=24 + 48, for_w=8)
    # ... unless it recomputes: its forward makes the output (8) again beside the kept one
    again = _plan("1f1b-flush", (plan.stages[0], _stage(1, ("b", "d"), p=24, a=40, state=96,
                                                        recompute=True, kept=32.0)))
    assert stage_bytes(again, own, "1f1b-flush", [2, 1])[1].backward == 48 + 8 + 40
    # pipedream stashes v - 1 versions of the stage's weights
    assert stage_bytes(plan, prof, "pipedream", [2, 1])[0].base == 160 + 40
    # recomputing: kept inputs per minibatch in flight, the recomputed set during B (and
    # until W where the backward is split)
    rc = _plan("zb-h1", (_stage(0, ("x", "a"), p=40, a=24, state=160, v=2, recompute=True,
                                kept=8.0), _stage(1, ("b", "d"), p=24, a=40, state=96)))
    r0 = stage_bytes(rc, prof, "zb-h1", [2, 1])[0]
    assert (r0.held, r0.backward, r0.for_w) == (8.0, 24 + 24, 16 + 24)
    peaks = walk_memory(plan, prof, "1f1b-flush", microbatches=2, temporaries=(1.0, 2.0))
    assert [p.stage for p in peaks] == [0, 1] and all(isinstance(p, StagePeak) for p in peaks)
    assert all(p.peak == sum(p.parts.values()) for p in peaks)


def test_a_replicated_stage_keeps_its_buckets_and_a_sharded_one_steps_its_share() -> None:
    """Stage 0 of the profile above (P = 40 of weights, state 160, AdamW-like temporaries
    1 P + 2 L = 120) on 2 replicas: its gradient buckets (P in the gradients' dtype) live with
    the state; at the update the round's gradient sums (P) go before the step, so its working
    set is 120 - 40. Float32 gradients of bfloat16 weights (GRADIENT_WIDTH 2): buckets of 2 P.
    Sharded over the 2 (state 120): the step touches half the parameters, 20 + 80 - 40.
    LocalSGD's replicas sum nothing: no buckets."""
    from dataclasses import replace

    prof = Profile(nodes=(_node("x", op="placeholder", out=8), _node("a", ("x",), 16, p=40),
                          _node("b", ("a",), 32), _node("d", ("b",), 8, p=24,
                                                          is_output=True)))
    two = replace(_stage(0, ("x", "a"), p=40, a=24, state=160, v=2), replicas=2)
    plan = replace(_plan("1f1b-flush", (two, _stage(1, ("b", "d"), p=24, a=40, state=96))),
                   cluster={"workers": 3})
    t = stage_bytes(plan, prof, "1f1b-flush", [2, 1], temporaries=(1.0, 2.0))[0]
    assert (t.base, t.update) == (160 + 40, 120 - 40)
    wide = Profile(nodes=prof.nodes, meta={GRADIENT_WIDTH: 2.0})
    t = stage_bytes(plan, wide, "1f1b-flush", [2, 1], temporaries=(1.0, 2.0))[0]
    assert (t.base, t.update) == (160 + 80, 120 - 80)
    sharded = replace(plan, shard="optimizer", stages=(replace(two, state_bytes=120.0),
                                                       plan.stages[1]))
    t = stage_bytes(sharded, prof, "1f1b-flush", [2, 1], temporaries=(1.0, 2.0))[0]
    assert (t.base, t.update) == (120 + 40, 20 + 80 - 40)
    t = stage_bytes(plan, prof, "localsgd", [2, 1], temporaries=(1.0, 2.0))[0]
    assert (t.base, t.update) == (160, 120)
    # the one-replica stage: no buckets, its whole step
    assert stage_bytes(sharded, prof, "1f1b-flush", [2, 1],
                       temporaries=(1.0, 2.0))[1].update == 24 + 48


def _tied(stages: int) -> tuple[Profile, Plan, Plan]:
    """An embedding e (owns the 64-byte weight w) on stage 0, a head h using it on the last
    stage, plain layers between: the profile, and its plan under 1f1b-flush and pipedream."""
    mid = [ProfileNode(name=f"m{i}", op="call_module", target=f"m{i}", forward_s=1.0,
                       backward_s=2.0, activation_bytes=8, parameter_bytes=4.0,
                       inputs=(f"m{i - 1}" if i else "e",), params=(f"v{i}",))
           for i in range(stages - 2)]
    last = mid[-1].name if mid else "e"
    head = ProfileNode(name="h", op="call_module", target="h", forward_s=1.0, backward_s=2.0,
                       activation_bytes=8, parameter_bytes=0.0, inputs=(last,),
                       shared_params=("w",), is_output=True)
    prof = Profile(nodes=(_node("x", op="placeholder", out=8), _node("e", ("x",), 8, p=64),
                          *mid, head))
    groups = [("x", "e"), *[(n.name,) for n in mid], ("h",)]
    plans = tuple(_plan(k, tuple(_stage(i, g, p=64 if i == 0 else (4 if g[0][0] == "m" else 0))
                                 for i, g in enumerate(groups)))
                  for k in ("1f1b-flush", "pipedream"))
    return prof, plans[0], plans[1]


def test_a_tie_keeps_its_sums_buffers_by_hand() -> None:
    """(received, sent, update, pair) per stage, T = 64 the tie's bytes: a pair of lone stages
    summed at the update keeps the receive of the other's part posted (T) and its own part
    sent until proven (T), and makes T more at the update before the step; pipedream lags the
    sum d = 1 round on 2 stages (windows 2 and 1): one round's part in flight, this round's
    posted at the update; a stage without the tie keeps nothing."""
    prof, flush, pipedream = _tied(2)
    f = make_schedule("1f1b-flush", [1, 1], 8, microbatches=2)
    assert tie_buffers(flush, prof, f) == ((64.0, 64.0, 0.0, 64.0),) * 2
    d = make_schedule("pipedream", [1, 1], 8)
    assert tie_buffers(pipedream, prof, d) == ((0.0, 64.0, 64.0, 0.0),) * 2
    prof3, flush3, pipedream3 = _tied(3)  # a middle stage without the tie; d = 2 under pipedream
    assert tie_buffers(flush3, prof3, make_schedule("1f1b-flush", [1, 1, 1], 8, microbatches=3)
                       ) == ((64.0, 64.0, 0.0, 64.0), (0.0,) * 4, (64.0, 64.0, 0.0, 64.0))
    assert tie_buffers(pipedream3, prof3, make_schedule("pipedream", [1, 1, 1], 8)
                       ) == ((0.0, 128.0, 64.0, 0.0), (0.0,) * 4, (0.0, 128.0, 64.0, 0.0))
    # in the walk (state 0 here): stage 0 peaks at its update as without the tie (the step's
    # temporaries, 1 x P = 64, and 16 bytes of receives posted), plus the two buffers; stage 1,
    # without temporaries (P = 0), peaks at its update too with the tie: the sum (64), the two
    # buffers, and its own messages (16 received, 16 sent), where untied it peaked in B (56)
    peaks = walk_memory(flush, prof, "1f1b-flush", microbatches=2, temporaries=(1.0, 0.0))
    plain = walk_memory(flush, Profile(nodes=tuple(
        n if n.name != "h" else ProfileNode(**{**n.__dict__, "shared_params": ()})
        for n in prof.nodes)), "1f1b-flush", microbatches=2, temporaries=(1.0, 0.0))
    assert [p.peak for p in plain] == [80.0, 56.0]
    assert [p.peak for p in peaks] == [80.0 + 128.0, 64.0 + 128.0 + 32.0]
    assert dict(peaks[1].parts) == {"base": 0.0, "held": 0, "working": 64.0,
                                    "received": 16.0 + 64.0, "sent": 16.0 + 64.0}


def test_step_temporaries_measured() -> None:
    shapes = [(2, torch.float32), (1, torch.float32)] * 3
    # plain SGD updates in place: nothing
    assert step_temporaries(lambda ps: torch.optim.SGD(ps, lr=0.1), shapes) == (0.0, 0.0)
    # foreach AdamW makes every tensor's sqrt of its second moment at once: one P
    per_byte, per_largest = step_temporaries(
        lambda ps: torch.optim.AdamW(ps, lr=0.1, foreach=True), shapes)
    assert per_byte == pytest.approx(1.0, abs=0.05) and per_largest == pytest.approx(0, abs=0.2)
    # the per-tensor loop: a tensor at a time, so the largest tensor's
    per_byte, per_largest = step_temporaries(
        lambda ps: torch.optim.AdamW(ps, lr=0.1, foreach=False), shapes)
    assert per_byte < 0.5 and per_largest >= 1.0
    assert step_temporaries(lambda ps: 1 / 0, shapes) is None  # a factory that will not run


def test_temporaries_of_low_precision_weights_are_in_the_dtype_they_step_in() -> None:
    """bfloat16 weights stepped on float32 masters make float32 temporaries: per byte of the
    weights, twice those of float32 weights (foreach AdamW: one P of float32, so 2 per bf16
    byte); without masters they step in bfloat16 and make bfloat16 ones (1 per byte)."""
    def params(dt: torch.dtype) -> list[torch.nn.Parameter]:
        return [torch.nn.Parameter(torch.zeros(32, 32, dtype=dt)),
                torch.nn.Parameter(torch.zeros(32, dtype=dt))]

    def adamw(ps: list[torch.Tensor]) -> torch.optim.Optimizer:
        return torch.optim.AdamW(ps, lr=0.1, foreach=True)

    fp32 = temporaries_for(params(torch.float32), adamw)
    assert fp32[0] == pytest.approx(1.0, abs=0.05)
    assert temporaries_for(params(torch.bfloat16), adamw) == pytest.approx(
        (2 * fp32[0], 2 * fp32[1]))
    assert temporaries_for(params(torch.bfloat16), adamw, master_weights=False) \
        == pytest.approx(fp32, abs=0.05)


def test_check_memory_reports_the_walk() -> None:
    plan = _plan("1f1b-flush", (_stage(0, ("a",), p=100, a=10, state=400, v=2),))
    walked = (StagePeak(0, 500.0, {"base": 400.0, "held": 20.0, "working": 80.0}),)
    (row,) = check_memory(plan, [550], walked=walked)
    assert row.predicted == 420 and row.walked == 500 and row.walked_ratio == 1.1
    assert row.walked_parts["working"] == 80.0
    table = memory_table([row])
    assert "walked peak | measured / walked |" in table and table.endswith("| 1.10 |")
    (plain,) = check_memory(plan, [550])
    assert plain.walked is None and plain.walked_ratio is None
    assert "walked" not in memory_table([plain])


def test_gradients_flow_back_only_along_values_computed_from_parameters() -> None:
    # x (model input) -> mask(x) (an attention mask: no parameter); a(x) with a weight;
    # b(a, mask); c(mask) still none: a gradient goes back along a and b only
    prof = Profile(nodes=(_node("x", op="placeholder", out=8), _node("mask", ("x",), 4),
                          _node("a", ("x",), 16, p=40), _node("b", ("a", "mask"), 16),
                          _node("c", ("mask",), 4)))
    assert gradient_values(prof) == {"a", "b"}
