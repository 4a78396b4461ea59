"""Values made from the model's inputs alone (masks, rotary tables): each reading stage makes them.

Such a node: a function or method call, repeatable (no random op, ``empty``, in-place op or
running-statistics norm), reaching no parameter, on model inputs or made values; none mutated.
"""
from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any, NamedTuple, TypeVar

from fxpipe.costmodel.profile import Profile

# Substrings of an op's name whose result differs between two runs, or that may update state
# (a normalisation in training updates its running statistics, buffers every stage would update
# again: they are not among a node's inputs here, so no write would taint them).
UNREPEATABLE = ("rand", "dropout", "bernoulli", "multinomial", "normal", "uniform", "poisson",
                "exponential", "cauchy", "geometric", "empty", "batch_norm", "instance_norm")
_CALLS = ("call_function", "call_method")
_INPLACE_DUNDERS = frozenset(f"__i{op}__" for op in (
    "add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "and", "or", "xor", "lshift",
    "rshift", "matmul"))


class NodeFacts(NamedTuple):
    """What the decision reads of one node: ``inputs`` are the node names it reads (no
    parameters or buffers), ``target`` the op as costmodel's ``describe_target`` names it."""

    name: str
    op: str
    target: str
    inputs: tuple[str, ...]
    uses_params: bool
    writes: bool = False  # known to write into an input (``inplace=True``), whatever its name


def op_name(target: str) -> str:
    """The op's own name in a target: ``torch.ops.aten.add_.Tensor`` -> ``add_``,
    ``Tensor.masked_fill_`` -> ``masked_fill_``, ``operator.iadd`` -> ``iadd``,
    ``drop (Dropout)`` -> ``Dropout``."""
    if target.endswith(")") and " (" in target:  # a module: its class
        return target[target.rindex(" (") + 2:-1]
    parts = target.split(".")
    if target.startswith("torch.ops.") and len(parts) >= 5:  # torch.ops.<ns>.<op>.<overload>
        return parts[3]
    return parts[-1]


def mutates(target: str) -> bool:
    """Does the op write into one of its inputs (``add_``, ``x[i] = v``, ``a += b``)?"""
    name = op_name(target)
    if name.startswith("__") and name.endswith("__"):
        return name in _INPLACE_DUNDERS
    if target.startswith("operator."):
        return name == "setitem" or f"__{name}__" in _INPLACE_DUNDERS
    return name.endswith("_")


def repeatable(target: str) -> bool:
    """Does the op give the same result from the same inputs (no randomness, no uninitialised
    memory, no writes into its inputs)?"""
    low = op_name(target).lower()
    return not mutates(target) and not any(w in low for w in UNREPEATABLE)


def made_here(nodes: Sequence[NodeFacts]) -> frozenset[str]:
    """The names of the nodes each stage that reads them makes itself (the rule:
    docs/design-notes.md); ``nodes`` in program order, placeholders included (read, never made)."""
    placeholders = {n.name for n in nodes if n.op == "placeholder"}
    made: set[str] = set()
    for n in nodes:
        if (n.op in _CALLS and not n.uses_params and not n.writes
                and repeatable(n.target)
                and all(i in placeholders or i in made for i in n.inputs)):
            made.add(n.name)
    # A write taints the value it writes into and what that value may be a view of: back through
    # nodes that reach no parameter (a node that does makes fresh storage), model inputs
    # included. Then drop every made node made from a tainted one.
    by_name = {n.name: n for n in nodes}
    tainted: set[str] = set()
    stack = [i for n in nodes if n.op != "placeholder" and (n.writes or mutates(n.target))
             for i in n.inputs]
    while stack:
        v = stack.pop()
        if v not in tainted and v in by_name:
            tainted.add(v)
            if not by_name[v].uses_params:
                stack.extend(by_name[v].inputs)
    for n in nodes:  # program order: an input's taint is known before its users'
        if any(i in tainted for i in n.inputs):
            tainted.add(n.name)
    return frozenset(made - tainted)


def profile_facts(profile: Profile) -> list[NodeFacts]:
    """The facts of a profile's nodes (its inputs exclude parameters and buffers already)."""
    return [NodeFacts(n.name, n.op, n.target, tuple(n.inputs),
                      bool(n.params or n.shared_params or n.parameter_bytes > 0))
            for n in profile.nodes]


T = TypeVar("T")
GRAPHS_KEPT = 4
"""Graphs whose facts :func:`per_graph` keeps (the newest): a planning run has one or two."""
_GRAPHS: list[tuple[tuple[Any, ...], dict[Hashable, Any]]] = []


def per_graph(profile: Profile, what: Hashable, make: Callable[[], T]) -> T:
    """``make()``, computed once per graph: kept under ``what`` for the profile's node tuple
    (immutable, and shared by every copy of the profile that re-prices or rescales it), so a
    planner trying many candidates does not derive the graph's facts again for each one."""
    nodes = profile.nodes
    for key, facts in _GRAPHS:
        if key is nodes:
            break
    else:
        facts = {}
        _GRAPHS.append((nodes, facts))
        del _GRAPHS[:max(len(_GRAPHS) - GRAPHS_KEPT, 0)]
    if what not in facts:
        facts[what] = make()
    return facts[what]


def facts_of(profile: Profile) -> tuple[NodeFacts, ...]:
    """:func:`profile_facts`, once per graph."""
    return per_graph(profile, "facts", lambda: tuple(profile_facts(profile)))


def made_here_in(profile: Profile) -> frozenset[str]:
    """:func:`made_here` of a profile, once per graph."""
    return per_graph(profile, "made_here", lambda: made_here(facts_of(profile)))


def inputs_behind_in(profile: Profile) -> dict[str, frozenset[str]]:
    """:func:`model_inputs_behind` of a profile's made values, once per graph (do not mutate)."""
    return per_graph(profile, "behind",
                     lambda: model_inputs_behind(facts_of(profile), made_here_in(profile)))


def model_inputs_behind(nodes: Iterable[NodeFacts], made: frozenset[str]
                        ) -> dict[str, frozenset[str]]:
    """For each made node, the model inputs it is made from (what a stage reading it reads)."""
    out: dict[str, frozenset[str]] = {}
    for n in nodes:
        if n.name in made:
            roots: set[str] = set()
            for i in n.inputs:
                roots.update(out.get(i, {i}))
            out[n.name] = frozenset(roots)
    return out
