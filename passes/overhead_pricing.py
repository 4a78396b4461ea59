"""The runtime's overheads priced onto the solver's partition, after its search (pure numbers).

A stage pays a fixed cost, its messages, a share of the stash's copy and the values it makes again
(:func:`made_again_s`), priced outside the search, whose costs must grow with a stage's end.
"""
from __future__ import annotations

from typing import Sequence

from fxpipe.costmodel.overheads import Overheads
from fxpipe.costmodel.profile import Profile

from .cuts import all_crossing_values
from .made_here import facts_of, made_here_in
from .memory_rule import MemoryRule


def messages(crossing_in: int, crossing_out: int) -> tuple[int, int]:
    """Messages a stage posts or takes per minibatch, (those of the first value across each of
    its cuts, those of the others): each value crossing a cut travels once forward and once
    back (its gradient), on both of the cut's sides. The first value's carry the action's
    cost of posting and waiting (``Overheads.message_s``), the others less (``value_s``)."""
    first = 2 * (crossing_in > 0) + 2 * (crossing_out > 0)
    return first, 2 * crossing_in + 2 * crossing_out - first


def tie_sets_per_stage(profile: Profile, bounds: Sequence[int]) -> list[int]:
    """Per stage, the distinct sets of stages it shares some parameter with (the runtime runs
    one all-reduce per set: ``runtime/replica/stage_set.py:tie_sets``)."""
    holders: dict[str, set[int]] = {}
    for s in range(len(bounds) - 1):
        for nd in profile.nodes[bounds[s]:bounds[s + 1]]:
            for p in (*nd.params, *nd.shared_params):
                holders.setdefault(p, set()).add(s)
    keys = {tuple(sorted(v)) for v in holders.values() if len(v) > 1}
    return [sum(1 for k in keys if s in k) for s in range(len(bounds) - 1)]


def made_again_s(profile: Profile, bounds: Sequence[int]) -> list[float]:
    """Per stage ``[a, e)``, the forward seconds of the values made from the model's inputs
    alone that it makes again: those placed before ``a`` that it reads, and what they are made
    from (each once)."""
    facts = facts_of(profile)
    made = made_here_in(profile)
    index = {n.name: i for i, n in enumerate(profile.nodes)}
    out = []
    for s in range(len(bounds) - 1):
        a, e = bounds[s], bounds[s + 1]
        todo = [i for f in facts[a:e] for i in f.inputs if i in made and index[i] < a]
        again: set[int] = set()
        while todo:
            i = index[todo.pop()]
            if i not in again:
                again.add(i)
                todo.extend(v for v in facts[i].inputs if v in made)
        out.append(float(sum(profile.nodes[i].forward_s for i in again)))
    return out


def stage_overheads(profile: Profile, starts: Sequence[int], replicas: Sequence[int],
                    in_flight: Sequence[int], rule: MemoryRule,
                    overheads: Overheads | None = None) -> list[float]:
    """Seconds per minibatch (of the pipeline: a stage with r replicas pays 1/r) each stage of
    the partition pays beyond its nodes' times: the runtime's overheads by ``overheads``
    (default: the profile's), and the values it makes again (:func:`made_again_s`)."""
    ov = profile.overheads if overheads is None else overheads
    n = len(profile.nodes)
    bounds = list(starts) + [n]
    again = [t / r for t, r in zip(made_again_s(profile, bounds), replicas)]
    if ov.zero:
        return again
    crossing = all_crossing_values(profile, [a for a in bounds if 0 < a < n])
    total_p = sum(nd.parameter_bytes for nd in profile.nodes)
    ties = tie_sets_per_stage(profile, bounds)
    out = []
    for s, r in enumerate(replicas):
        a, e = bounds[s], bounds[s + 1]
        msgs, further = messages(len(crossing.get(a, ())), len(crossing.get(e, ())))
        share = (sum(nd.parameter_bytes for nd in profile.nodes[a:e]) / total_p
                 if total_p > 0 else 0.0)
        tensors = len({p for nd in profile.nodes[a:e] for p in (*nd.params, *nd.shared_params)})
        out.append(ov.stage_s(msgs, tensors, share, rule.stashed(in_flight[s]) > 0, ties[s],
                              further) / r + again[s])
    return out
