"""How the field splits a model into pipeline stages, written here from the descriptions (no code
copied), so fxpipe's plans can be priced next to them by the same simulator.

- :func:`even_split`: torchtitan's ``generate_llm_fqn_per_model_part``: the embedding and the
  output (norm and head) count as ``input_weight`` and ``output_weight`` extra layers, the
  effective layers are dealt evenly, the first ``effective % stages`` stages taking one more.
- :func:`auto_partition`: the dynamic program of torch's proposed
  ``torch.distributed.pipelining.auto_partition`` (pytorch PR 179212): per-block forward and
  backward costs, a communication cost per stage, a schedule and a microbatch count in; the split
  with the shortest critical path out.
- :func:`parameter_balance`: DeepSpeed's ``partition_method="parameters"``: contiguous parts
  whose largest parameter count is smallest.

Each is a function from per-block numbers to the first block of each stage. :func:`blocks_of`
reads the blocks of an fxpipe profile (the model's inputs and embedding, each repeated layer, the
output part), so a block split becomes node boundaries fxpipe's ``plan_for`` prices.
"""
from __future__ import annotations

import bisect
import re
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from fxpipe.costmodel.profile import Profile
from fxpipe.passes.cuts import cut_bytes

__all__ = ["Blocks", "auto_partition", "blocks_of", "critical_path", "even_split",
           "min_max_split", "parameter_balance"]

SCHEDULES = ("1f1b", "interleaved_1f1b", "interleaved_zero_bubble")


def even_split(num_layers: int, stages: int, input_weight: int = 1,
               output_weight: int = 1) -> list[int]:
    """torchtitan's even split of ``[input, layer 0 .. layer L-1, output]`` (L + 2 blocks):
    the first block of each stage. Refuses, as torchtitan does, more stages than effective
    layers and a weight larger than the layers a stage gets."""
    if stages < 1:
        raise ValueError(f"stages={stages}: need at least 1")
    if stages == 1:
        return [0]
    effective = num_layers + input_weight + output_weight
    per, extra = divmod(effective, stages)
    if per == 0 or input_weight > per or output_weight > per:
        raise ValueError(f"{stages} stages of {effective} effective layers (input_weight "
                         f"{input_weight}, output_weight {output_weight}): a stage would hold "
                         f"{per} layers")
    starts, layer = [0], 0
    for s in range(stages - 1):
        take = per + (1 if s < extra else 0) - (input_weight if s == 0 else 0)
        layer = min(num_layers, layer + take)
        starts.append(1 + layer)  # block 1 + i is layer i
    return starts


def min_max_split(weights: Sequence[float], parts: int) -> list[int]:
    """Contiguous non-empty ``parts`` of ``weights`` whose largest sum is smallest (exact); of
    the splits that reach it, the one whose earlier parts take as many blocks as they can. The
    first index of each part."""
    n = len(weights)
    if not 1 <= parts <= n:
        raise ValueError(f"{parts} parts of {n} blocks")
    if any(w < 0 for w in weights):
        raise ValueError("weights must be non-negative")
    prefix = np.concatenate([[0.0], np.cumsum(np.asarray(weights, dtype=float))])
    sums = np.unique((prefix[None, :] - prefix[:, None])[np.triu_indices(n + 1, 1)])

    def parts_needed(cap: float) -> int:
        count, start = 0, 0
        while start < n:
            end = bisect.bisect_right(prefix, prefix[start] + cap) - 1
            if end <= start:
                return n + 1  # one block alone is over the cap
            count, start = count + 1, end
        return count

    lo, hi = 0, len(sums) - 1
    while lo < hi:  # the smallest achievable largest part that needs at most ``parts`` parts
        mid = (lo + hi) // 2
        if parts_needed(sums[mid]) <= parts:
            hi = mid
        else:
            lo = mid + 1
    cap = sums[lo]
    starts, start = [], 0
    for s in range(parts):
        starts.append(start)
        end = bisect.bisect_right(prefix, prefix[start] + cap) - 1
        start = min(end, n - (parts - s - 1))  # leave one block for each later part
    return starts


def critical_path(fwd: Sequence[float], bwd: Sequence[float], starts: Sequence[int],
                  microbatches: int, comm: float = 0.0, chunks: int = 1) -> float:
    """The critical path of one batch under 1F1B by the usual bubble rule: the first
    microbatch's forward and backward through every stage, then ``microbatches - 1`` more at
    the slowest rank's pace, plus a forward and a backward message per cut. With ``chunks``
    stages per rank (interleaved), stage s runs on rank s % (stages / chunks) and a rank's pace is
    its chunks' sum, the bubble shrinking by 1 / chunks."""
    bounds = list(starts) + [len(fwd)]
    stage = [sum(fwd[a:b]) + sum(bwd[a:b]) for a, b in zip(bounds, bounds[1:])]
    S = len(stage)
    ranks = S // chunks
    pace = [sum(stage[r::ranks]) for r in range(ranks)]
    return sum(stage) / chunks + (microbatches - 1) * max(pace) + 2 * (S - 1) * comm


def auto_partition(fwd: Sequence[float], bwd: Sequence[float], stages: int, microbatches: int,
                   comm: float = 0.0, schedule: str = "1f1b") -> list[int]:
    """The PR's dynamic program, as its description gives it: the split of the blocks into
    ``stages`` contiguous stages (for the interleaved schedules: virtual stages, dealt round robin
    to the ranks) with the shortest :func:`critical_path` under ``schedule`` for
    ``microbatches``. The total forward and backward and the messages do not depend on where the
    cuts fall, so the program minimises the slowest stage, which fixes the critical path; ties
    go to earlier stages holding more blocks."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r}: use one of {SCHEDULES}")
    if len(fwd) != len(bwd):
        raise ValueError("one forward and one backward cost per block")
    return min_max_split([f + b for f, b in zip(fwd, bwd)], stages)


def parameter_balance(params: Sequence[float], stages: int) -> list[int]:
    """DeepSpeed's ``parameters`` method: parameter counts per block, balanced."""
    return min_max_split(params, stages)


@dataclass(frozen=True)
class Blocks:
    """A profile read as the blocks the field splits by: ``starts`` (first node of each block),
    ``names`` (``input``, ``layer 0`` ...), per block forward and backward seconds and parameter
    bytes (a shared parameter counts where it is owned), and the bytes crossing each boundary."""

    starts: tuple[int, ...]
    names: tuple[str, ...]
    forward_s: tuple[float, ...]
    backward_s: tuple[float, ...]
    parameter_bytes: tuple[float, ...]
    boundary_bytes: tuple[float, ...]

    @property
    def layers(self) -> int:
        return len(self.starts) - 2

    def nodes(self, block_starts: Sequence[int]) -> list[int]:
        """Node boundaries of a split given by blocks."""
        return [self.starts[b] for b in block_starts]


_LAYER = re.compile(r"^(.*?)\.(\d+)\.")


def blocks_of(profile: Profile) -> Blocks:
    """The repeated layers of ``profile`` (the parameter prefix ``<container>.<i>.`` with the
    most indices, e.g. ``model.layers`` or ``transformer.h``), with everything before layer 0
    as ``input`` and everything after the last as ``output``. Layer i starts at the cheapest
    cut (fewest bytes live, the earliest of equals) between the last parameter of layer i-1 (or
    of the input part) and the first parameter of layer i: after the residual add that ends
    the previous layer, as a module boundary falls."""
    owner: list[tuple[str, int] | None] = []
    counts: dict[str, set[int]] = {}
    for nd in profile.nodes:
        found = None
        for p in nd.params + nd.shared_params:
            m = _LAYER.match(p)
            if m:
                found = (m.group(1), int(m.group(2)))
                counts.setdefault(found[0], set()).add(found[1])
                break
        owner.append(found)
    if not counts:
        raise ValueError("no repeated layers (parameters named <container>.<i>.) in the profile")
    container = max(counts, key=lambda c: len(counts[c]))
    layers = sorted(counts[container])
    if layers != list(range(len(layers))):
        raise ValueError(f"{container}: layer indices {layers} are not 0..{len(layers) - 1}")
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    for i, o in enumerate(owner):
        if o is not None and o[0] == container:
            first.setdefault(o[1], i)
            last[o[1]] = i
    cb = cut_bytes(profile)
    n = len(profile.nodes)
    tail = next((i for i in range(n) if profile.nodes[i].params and i > last[layers[-1]]), n - 1)

    def cheapest(lo: int, hi: int) -> int:
        """The cut position in (lo, hi] with the fewest bytes live (position p: before node p)."""
        best = min(range(lo + 1, hi + 1), key=lambda p: (cb[p - 1], p))
        if not np.isfinite(cb[best - 1]):
            raise ValueError(f"no sendable cut between nodes {lo} and {hi}")
        return best

    prev = max((i for i in range(first[0]) if profile.nodes[i].params), default=0)
    starts = [0, cheapest(prev, first[0])]
    for k in layers[1:]:
        starts.append(cheapest(last[k - 1], first[k]))
    starts.append(cheapest(last[layers[-1]], tail))
    names = ["input"] + [f"layer {k}" for k in layers] + ["output"]
    bounds = starts + [n]
    fwd, bwd, par = [], [], []
    for a, b in zip(bounds, bounds[1:]):
        nodes = profile.nodes[a:b]
        fwd.append(sum(nd.forward_s for nd in nodes))
        bwd.append(sum(nd.backward_s for nd in nodes))
        par.append(sum(nd.parameter_bytes for nd in nodes))
    return Blocks(tuple(starts), tuple(names), tuple(fwd), tuple(bwd), tuple(par),
                  tuple(float(cb[p - 1]) for p in starts[1:]))
