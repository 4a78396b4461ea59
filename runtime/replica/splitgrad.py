"""A stage's backward in two parts: input gradients now (B), weight gradients later (W).

B asks autograd for the input gradients and records the gradients reaching the weight branches; W
walks only those branches from the records: nothing twice, the fused backward's gradients exactly.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
from torch.autograd.graph import GradientEdge, Node


def _node_of(t: torch.Tensor) -> Node | None:
    """The autograd node producing ``t``: its grad_fn, or its AccumulateGrad for a leaf (made to
    exist by a throwaway view, as autograd creates it lazily)."""
    if t.grad_fn is not None:
        return t.grad_fn
    if not t.requires_grad:
        return None
    return t.view_as(t).grad_fn.next_functions[0][0]  # type: ignore[union-attr]


def _consumers(roots: Sequence[Node]) -> dict[Node, list[Node]]:
    """Reverse edges of the graph below ``roots``: node -> the nodes its output feeds."""
    out: dict[Node, list[Node]] = collections.defaultdict(list)
    seen: set[Node] = set()
    queue = collections.deque(r for r in roots if r is not None)
    seen.update(queue)
    while queue:
        node = queue.popleft()
        for nxt, _ in node.next_functions:
            if nxt is None:
                continue
            out[nxt].append(node)
            if nxt not in seen:
                seen.add(nxt)
                queue.append(nxt)
    return out


def _upward(starts: Sequence[Node], consumers: dict[Node, list[Node]],
            stop: set[Node]) -> tuple[set[Node], set[Node]]:
    """Nodes reached from ``starts`` towards the roots, not crossing ``stop``; and the ``stop``
    nodes met on the way."""
    reached: set[Node] = set(s for s in starts if s is not None)
    met: set[Node] = set()
    queue = collections.deque(reached)
    while queue:
        node = queue.popleft()
        for up in consumers.get(node, ()):
            if up in stop:
                met.add(up)
            elif up not in reached:
                reached.add(up)
                queue.append(up)
    return reached, met


@dataclass
class WeightTask:
    """What W needs: the recorded gradients at the frontier (or, with no input closure, the
    roots themselves) and the weights, in order. :meth:`run` returns one gradient (or None) per
    weight, as ``torch.autograd.grad(roots, weights)`` would have."""

    weights: list[torch.Tensor]
    roots: list[torch.Tensor] = field(default_factory=list)  # all of them: no input closure
    seeds: list[torch.Tensor | None] = field(default_factory=list)
    frontier: list[Node] = field(default_factory=list)
    # roots outside the input closure that a weight hangs from directly (a last stage's loss
    # term that no input reaches): W starts there too, with their seeds
    loose: list[tuple[torch.Tensor, torch.Tensor | None]] = field(default_factory=list)
    recorded: dict[Node, tuple[torch.Tensor | None, ...]] = field(default_factory=dict)

    def run(self, hook: Callable[[int, torch.Tensor], None] | None = None
            ) -> list[torch.Tensor | None]:
        """The weight gradients; ``hook(i, grad)``, if given, sees weight i's as soon as
        autograd produces it (so a caller can start all-reducing it)."""
        if not self.weights:
            return []
        handles = [w.register_hook(lambda g, i=i: hook(i, g)) for i, w in enumerate(self.weights)
                   ] if hook is not None else []
        try:
            if self.roots:  # no input closure: the whole backward happens here
                return list(torch.autograd.grad(self.roots, self.weights, self.seeds,
                                                allow_unused=True))
            edges: list[GradientEdge | torch.Tensor] = []
            grads: list[torch.Tensor | None] = []
            for node in self.frontier:
                for i, g in enumerate(self.recorded.get(node, ())):
                    if g is not None:
                        edges.append(GradientEdge(node, i))
                        grads.append(g)
            for root, seed in self.loose:
                edges.append(root)
                grads.append(torch.ones_like(root) if seed is None else seed)
            if not edges:
                return [None] * len(self.weights)
            # a frontier node below another receives its recorded gradient again through it:
            # replace what arrives with the recorded value, so nothing counts twice
            clamps = [node.register_prehook(lambda _g, saved=self.recorded[node]: saved)
                      for node in self.frontier if node in self.recorded]
            try:
                return list(torch.autograd.grad(edges, self.weights, grads, allow_unused=True))
            finally:
                for h in clamps:
                    h.remove()
        finally:
            for h in handles:
                h.remove()
            self.recorded.clear()
            self.roots, self.seeds, self.loose = [], [], []


def input_gradients(roots: Sequence[torch.Tensor], seeds: Sequence[torch.Tensor | None],
                    inputs: Sequence[torch.Tensor], weights: Sequence[torch.Tensor]
                    ) -> tuple[list[torch.Tensor | None], WeightTask]:
    """B: the gradients of ``inputs`` (None where one does not reach the roots), and the
    :class:`WeightTask` that W runs later for ``weights``."""
    weights = list(weights)
    if not inputs or not roots:
        return [None] * len(inputs), WeightTask(weights, list(roots), list(seeds))
    root_nodes = [n for n in map(_node_of, roots) if n is not None]
    consumers = _consumers(root_nodes)
    closure, _ = _upward([_node_of(x) for x in inputs], consumers, set())
    frontier: set[Node] = set()
    branches: set[Node] = set()
    for w in weights:
        node = _node_of(w)
        if node is not None:
            reached, met = _upward([node], consumers, closure)
            frontier |= met
            branches |= reached
    loose = [(r, s) for r, s, n in zip(roots, seeds, map(_node_of, roots))
             if n is not None and n not in closure and n in branches]
    task = WeightTask(weights, frontier=sorted(frontier, key=lambda n: -n._sequence_nr()),
                      loose=loose)
    handles = [node.register_prehook(lambda g, node=node: task.recorded.__setitem__(node, g))
               for node in task.frontier]
    try:
        grads = torch.autograd.grad(list(roots), list(inputs), list(seeds), retain_graph=True,
                                    allow_unused=True)
    finally:
        for h in handles:
            h.remove()
    return list(grads), task

