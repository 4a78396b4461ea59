"""A replica's peak memory, walked action by action through the schedule that runs.

Adds to :func:`~.memory.schedule_memory` what lives inside actions: receives posted ahead, sends
not yet proven, the backward's working set, the optimizer step's temporaries and tied sums.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

from fxpipe.costmodel.profile import Profile
from fxpipe.passes.made_here import inputs_behind_in
from fxpipe.passes.plan import Plan

from ..schedules.commplan import MODEL, Msg, RankPlan, StageLinks, comm_plans
from ..schedules.kinds import make_schedule
from ..schedules.localsgd import LOCALSGD
from ..schedules.program import lower
from ..schedules.proofs import HappensBefore, SendProofs
from ..schedules.schedule import Rank, Schedule, tie_by_messages, tie_delay
from .core import tied_from_profile
from .memory import held_parameters, kept_inputs, state_bytes, stashed_versions
from .sim_measure import peak_in_flight


@dataclass(frozen=True)
class StageBytes:
    """What one replica of a stage holds and makes, in bytes: ``base`` always (state and
    stashed versions), ``held`` per minibatch from its F to its B (or W where the backward is
    split), ``backward`` during each B, ``update`` during each U, and ``for_w`` from each B to
    its W where the backward is split."""

    base: float
    held: float
    backward: float
    update: float
    for_w: float = 0.0  # a split backward: what B leaves for W, per minibatch
    tie_received: float = 0.0  # a tied pair's receive, posted through the round
    tie_sent: float = 0.0  # tied parts sent (or lagged rounds summing) between updates


@dataclass(frozen=True)
class StagePeak:
    """The walked peak of one stage (its largest replica) and what is live at it, by part:
    ``base`` (state and versions), ``held`` (activation sets in flight), ``working`` (the
    running action's backward working set or optimizer temporaries), ``received`` (receive
    buffers posted and not yet consumed), ``sent`` (sent tensors not yet proven received)."""

    stage: int
    peak: float
    parts: Mapping[str, float]


def stage_links(plan: Plan, profile: Profile) -> tuple[tuple[StageLinks, ...], dict[str, float]]:
    """The plan's stages' communication shape from the profile (what codegen would build), and
    the bytes of each value that crosses. A value made from the model's inputs alone is made
    by each stage that reads it (:mod:`fxpipe.passes.made_here`): that stage reads those inputs
    instead."""
    stage = plan.stage_of()
    nodes = {n.name: n for n in profile.nodes}
    placeholders = {n.name for n in profile.nodes if n.op == "placeholder"}
    behind = inputs_behind_in(profile)
    S = len(plan.stages)
    consumers: dict[str, set[int]] = {}
    for n in profile.nodes:
        if n.name in placeholders or n.name not in stage:
            continue
        for i in n.inputs:
            for read in behind.get(i, (i,)):
                consumers.setdefault(read, set()).add(stage[n.name])
        if n.is_output and stage[n.name] != S - 1:
            consumers.setdefault(n.name, set()).add(S - 1)
    links = []
    for s in range(S):
        ins = sorted(v for v, cs in consumers.items() if s in cs
                     and (v in placeholders or stage.get(v, s) < s))
        outs = sorted(v for v, cs in consumers.items() if v not in placeholders
                      and stage.get(v) == s and any(c > s for c in cs))
        links.append(StageLinks(
            tuple(ins), tuple(MODEL if v in placeholders else stage[v] for v in ins),
            tuple(outs), tuple(tuple(sorted(c for c in consumers[v] if c > s)) for v in outs)))
    sizes = {v: float(nodes[v].activation_bytes) for v in consumers if v in nodes}
    return tuple(links), sizes


def gradient_values(profile: Profile) -> frozenset[str]:
    """The values a gradient flows back along: those computed from a parameter (the model's
    inputs carry none, nor an attention mask or rotary table made from them and buffers), so
    the walk plans no gradient message for the others, as the runtime plans none."""
    grads: set[str] = set()
    for n in profile.nodes:  # program order: inputs before their users
        if n.op != "placeholder" and (n.params or n.shared_params or n.parameter_bytes > 0
                                      or any(i in grads for i in n.inputs)):
            grads.add(n.name)
    return frozenset(grads)


def backward_working_set(plan: Plan, profile: Profile) -> tuple[float, ...]:
    """Per stage, the largest of its nodes' output bytes plus their inputs' bytes: a node's
    backward holds its output's gradient and makes its inputs' (an estimate from the graph)."""
    nodes = {n.name: n for n in profile.nodes}
    out = []
    for sp in plan.stages:
        best = 0.0
        for name in sp.nodes:
            n = nodes.get(name)
            if n is None or n.op == "placeholder":
                continue
            best = max(best, n.activation_bytes
                       + sum(nodes[i].activation_bytes for i in n.inputs if i in nodes))
        out.append(best)
    return tuple(out)


def weight_gradient_inputs(plan: Plan, profile: Profile) -> tuple[float, ...]:
    """Per stage, the output bytes of its nodes that use a parameter: what a split backward's B
    leaves for its W (each weight's gradient needs its node's output gradient), per minibatch."""
    nodes = {n.name: n for n in profile.nodes}
    return tuple(sum(nodes[n].activation_bytes for n in sp.nodes if n in nodes
                     and (nodes[n].params or nodes[n].shared_params
                          or nodes[n].parameter_bytes > 0))
                 for sp in plan.stages)


LOSS_IN_MODEL = "loss_in_model"
"""``Profile.meta`` key: the model computes its own loss (a Hugging Face model given labels),
so what its backward makes is in the graph's working set (set by ``fxpipe.compile``)."""
GRADIENT_WIDTH = "gradient_bytes_per_parameter_byte"
"""``Profile.meta`` key: a gradient's bytes per byte of its parameter (2 for bfloat16 weights
with float32 masters, whose gradients are summed in float32; 1 where absent; set by
``fxpipe.compile``)."""


def loss_bytes(plan: Plan, profile: Profile) -> float:
    """The model output's bytes, which the loss on the last stage keeps for its backward (a
    cross entropy's log-softmax) and whose gradient it makes; the loss is not in the graph.
    Where the model computes its own loss, the output is still kept (returned with the loss),
    and the loss's backward is the graph's (:data:`LOSS_IN_MODEL`): B makes no copy of it
    there, unless the stage recomputes (its forward makes the output again). Measured
    (benchmarks/memory-check.md, a GPT-2 with 4 MiB of logits): without that copy its last
    stage's walk went from 0.82-0.86 to 0.96-1.00 of the measured peak, and with it for the
    recomputing ones, which without it walked 1.13-1.18."""
    return float(sum(n.activation_bytes for n in profile.nodes if n.is_output))


def largest_parameter(plan: Plan, profile: Profile) -> tuple[float, ...]:
    """Per stage, the most parameter bytes one node owns (the largest tensor, or a layer's
    weight and bias together: an upper bound of it)."""
    nodes = {n.name: n for n in profile.nodes}
    return tuple(max((nodes[n].parameter_bytes for n in sp.nodes if n in nodes), default=0.0)
                 for sp in plan.stages)


def stage_bytes(plan: Plan, profile: Profile, kind: str, in_flight: Sequence[int],
                temporaries: tuple[float, float] = (0.0, 0.0), scale: float = 1.0
                ) -> tuple[StageBytes, ...]:
    """Each stage's :class:`StageBytes` under ``kind``. ``in_flight``: the schedule's peak
    minibatches held per stage (for the stashed versions); ``temporaries``: the optimizer's
    ``(per_byte, per_largest)``; ``scale``: each set's share of the profiled minibatch."""
    ws = backward_working_set(plan, profile)
    big = largest_parameter(plan, profile)
    for_w = weight_gradient_inputs(plan, profile)
    loss = loss_bytes(plan, profile)
    per_byte, per_largest = temporaries
    out = []
    last = len(plan.stages) - 1
    width = float(profile.meta.get(GRADIENT_WIDTH, 1.0))
    for sp, v, w, L, fw in zip(plan.stages, in_flight, ws, big, for_w):
        held = (kept_inputs(sp) if sp.recompute else sp.activation_bytes) * scale
        recomputed = sp.activation_bytes * scale if sp.recompute else 0.0
        extra = loss * scale if sp.index == last else 0.0
        # in B: the loss's working copy, or where the model computes its own loss (its backward
        # the graph's) the output a recomputing stage makes again beside the one it keeps
        outside = extra if sp.recompute or not profile.meta.get(LOSS_IN_MODEL) else 0.0
        # a replicated stage's gradient buckets (its replicas' sum overlapped with the
        # backward, as DDP's): flat buffers of every gradient, kept for the run; at the
        # update the round's gradient sums (in the state) go and the step reads the buckets
        bucket = held_parameters(sp) * width if sp.replicas > 1 and kind != LOCALSGD else 0.0
        # a sharded replica steps its share of the parameters (whole tensors: the largest may
        # be among them)
        step = per_byte * held_parameters(sp) / (sp.replicas if plan.shard else 1) \
            + per_largest * L
        out.append(StageBytes(
            base=state_bytes(sp) + stashed_versions(kind, v) * held_parameters(sp) + bucket,
            held=held + extra, backward=w * scale + outside + recomputed,
            update=max(step - bucket, 0.0),
            for_w=fw * scale + recomputed))
    return tuple(out)


def tie_buffers(plan: Plan, profile: Profile, sched: Schedule
                ) -> tuple[tuple[float, float, float, float], ...]:
    """Per stage, what summing its tied parameters keeps, as the runtime sums them
    (:mod:`fxpipe.runtime.execution.rank_update`): ``(received, sent, update, pair)`` bytes,
    the first two live between updates, ``update`` made during each update besides the step's
    temporaries, ``pair`` made at the update before the step (the sum of a tied pair: the
    update's working set is the larger of it and the step's temporaries). ``T``: the bytes of
    the ties the stage holds (each tie's sum is a flat segment of its gradients)."""
    tied = tied_from_profile(plan, profile)
    delay = tie_delay(sched, [t.stages for t in tied])
    out = []
    for s in range(len(plan.stages)):
        received = sent = update = pair = 0.0
        for t in tied:
            if s not in t.stages:
                continue
            T = t.nbytes
            if tie_by_messages(t.stages, sched.replicas, delay):
                # the update frees the old part and makes the new one and the sum, then
                # steps with the sum: T more than between updates, before the step's own
                received, sent, pair = received + T, sent + T, pair + T
            elif delay > 0:  # d rounds in flight; this round's part posted at the update
                sent, update = sent + delay * T, update + T
            else:  # an all-reduce of the part, made at the update
                update += T
        out.append((received, sent, update, pair))
    return tuple(out)


def _index(links: Sequence[StageLinks]) -> dict[str, int]:
    """The message tags' value numbers (any fixed numbering: both ends agree)."""
    values = {v for st in links for v in (*st.inputs, *st.outputs)}
    return {v: i for i, v in enumerate(sorted(values))}


def _owner(sched: Schedule) -> Callable[[int, int], Rank]:
    """The rank holding stage s's minibatch k: replicas take minibatches round robin."""
    return lambda s, k: (s, k % sched.replicas[s])


def walk_rank(sched: Schedule, links: Sequence[StageLinks], sizes: Mapping[str, float],
              rank: Rank, terms: StageBytes, scale: float = 1.0,
              plan: RankPlan | None = None,
              grads: Callable[[str, int], bool] = lambda n, k: True,
              order: HappensBefore | None = None) -> tuple[float, dict[str, float]]:
    """The peak of live bytes on ``rank`` over its actions of ``sched``, and its parts (see
    :class:`StagePeak`); messages as the executor posts them (``plan``: the rank's message plan,
    made here when not given; ``grads(value, minibatch)``: whether a gradient goes back;
    ``order``: the schedule's :class:`HappensBefore`, made here when not given)."""
    index = _index(links)
    if plan is None:
        plan = comm_plans(links, sched, index, grads, ranks=[rank])[rank]
    posted: dict[Msg, float] = {}  # receives posted, not yet consumed
    sent: dict[Msg, float] = {}  # sends posted, not yet proven received
    held: dict[int, float] = {}
    proofs = SendProofs(links, _owner(sched), rank, index, grads)
    proofs.window(sched.actions, (m for ms in plan.sends for m in ms), order)
    split = any(a.kind == "W" for a in sched.actions[rank])
    best, parts = -1.0, {}
    def post(msgs: Sequence[Msg]) -> None:  # a receive's buffer; a send's until proven received
        for m in msgs:
            (sent if m.send else posted)[m] = sizes.get(m.name, 0.0) * scale

    program = lower(plan, sched.actions[rank])  # the rank's program (schedules/program.py)
    post(program.start)
    for step in program.steps:
        post(step.before)
        for m in step.waits:  # waited for now: proves the peer got our earlier sends
            for p in proofs.proven_by(m):
                sent.pop(p, None)
        a = step.action
        working = {"B": terms.backward, "U": terms.update}.get(a.kind, 0.0)
        now = {"base": terms.base, "held": sum(held.values()), "working": working,
               "received": sum(posted.values()) + terms.tie_received,
               "sent": sum(sent.values()) + terms.tie_sent}
        total = sum(now.values())
        if total > best:
            best, parts = total, now
        for m in step.waits:  # consumed: an input is the activations' now, a gradient gone
            posted.pop(m, None)
        if a.kind == "F":
            held[a.minibatch] = terms.held
        elif a.kind == "B" and split:  # W still needs the output gradients (and the graph)
            held[a.minibatch] = held.get(a.minibatch, 0.0) + terms.for_w
        elif a.kind in ("B", "W"):
            held.pop(a.minibatch, None)
        post(step.after)
    return best, parts


def walk_memory(plan: Plan, profile: Profile, kind: str, *, microbatches: int | None = None,
                temporaries: tuple[float, float] = (0.0, 0.0), scale: float = 1.0,
                minibatches: int | None = None) -> tuple[StagePeak, ...]:
    """Per stage, the walked peak of its busiest replica under ``kind`` (docs/design-notes.md):
    the schedule generated as the planner's simulation generates it, ``minibatches`` long
    (default: enough for its steady state, 4 S or two updates)."""
    S = len(plan.stages)
    n = minibatches or max(4 * S, 2 * (microbatches or S))
    sched = make_schedule(kind, list(plan.replicas), n,
                          microbatches=microbatches if kind != "pipedream" else None)
    links, sizes = stage_links(plan, profile)
    in_flight = [max(peak_in_flight(sched.actions[(s, j)]) for j in range(r))
                 for s, r in enumerate(plan.replicas)]
    own = stage_bytes(plan, profile, kind, in_flight, temporaries, scale)
    terms = [replace(b, update=max(b.update, p) + u, tie_received=r, tie_sent=t)
             for b, (r, t, u, p) in zip(own, tie_buffers(plan, profile, sched))]
    carries = gradient_values(profile)

    def grads(value: str, k: int) -> bool:
        return value in carries

    index = _index(links)
    plans = comm_plans(links, sched, index, grads)  # every rank, one pass
    order = HappensBefore(links, _owner(sched), index, grads, sched.actions)  # every rank's
    out = []
    for s, r in enumerate(plan.replicas):
        walked = [walk_rank(sched, links, sizes, (s, j), terms[s], scale, plans[(s, j)], grads,
                            order) for j in range(r)]
        peak, parts = max(walked, key=lambda w: w[0])
        out.append(StagePeak(s, peak, parts))
    return tuple(out)

