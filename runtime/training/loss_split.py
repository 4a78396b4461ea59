"""Losses that split exactly: the update of a cut minibatch is the gradient of its whole loss.

:func:`probe` finds the loss's reduction on the first minibatch (mean, sum, token mean over labels
!= -100, or weighted mean; none: :class:`LossSplitError`). Microbatch i of an update of g then
scales its loss by ``c_i = g u_i / U`` (u: its samples or valid labels; ``c_i = g`` for a sum)."""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.utils._pytree as pytree

from fxpipe.tracing.batchdims import as_call, tensor_leaves

from ..errors import RuntimeConfigError
from ..execution.contract import Batch
from ..replica.weighted import Weighted
from .minibatch import (BATCH_DIMS_HINT, CutSpec, cut_part, cut_sizes, minibatch_size, name_of,
                        piece_sizes)

IGNORE = -100  # torch's CrossEntropyLoss default ignore_index, Hugging Face's padding label
RULES = ("mean", "sum", "token", "weighted")


class LossSplitError(RuntimeConfigError):
    """The loss is not a combination of its microbatches' losses: a cut would train another
    objective."""


@dataclass(frozen=True)
class LossRule:
    """How a loss combines over parts: ``kind`` in RULES; for ``token``, where the labels are
    (``side`` "inputs" or "target", ``path``) and ``shift`` (1: a causal LM's next-token labels,
    the first position of every sequence not counted)."""

    kind: str
    side: str = ""
    path: str = ""
    shift: int = 0
    # ``weighted``: the whole minibatch's output as probed (shape, batch dimension, dtype): the
    # shape of the output :func:`shares` differentiates the loss at
    out_shape: tuple[int, ...] = ()
    out_dim: int = 0
    out_dtype: str = "torch.float32"

    def describe(self) -> str:
        return {"mean": "a per-sample mean: microbatches weighted by their samples",
                "sum": "a sum: microbatch losses added",
                "token": f"a mean over valid labels ({name_of(self.side, self.path)} != {IGNORE}"
                         f"{', shifted by one' if self.shift else ''}): microbatches weighted "
                         "by their valid labels",
                "weighted": "a weighted mean (per-sample weights the target decides, e.g. "
                            "cross entropy with weight=): microbatches weighted by their "
                            "samples' summed weights"}[self.kind]


def units(rule: LossRule, part: Batch, size: int) -> float:
    """What a part counts for under ``rule``: samples, or valid labels."""
    if rule.kind != "token":
        return float(size)
    side = as_call(part[0]) if rule.side == "inputs" else part[1]
    labels = dict(tensor_leaves(side))[rule.path]
    return float((labels[..., rule.shift:] != IGNORE).sum())


def shares(rule: LossRule, loss_fn: Callable[..., Any], whole: Any, targets: Sequence[Any],
           sizes: Sequence[int]) -> list[float]:
    """A weighted mean's ``w_i / W`` for the parts of one minibatch (their ``targets``, of
    ``sizes`` samples, cut from the ``whole`` target; see docs/design-notes.md), from the loss's
    gradients at a fixed pseudo-random output of ``rule.out_shape`` (its batch dimension made
    ``sum(sizes)``). A part whose own loss has no gradient there counts for nothing."""
    shape = list(rule.out_shape)
    shape[rule.out_dim] = sum(sizes)
    dtype = getattr(torch, rule.out_dtype.replace("torch.", ""))
    out = torch.randn(shape, generator=torch.Generator().manual_seed(0), dtype=dtype)
    with torch.enable_grad():
        o = out.clone().requires_grad_(True)
        (g,) = torch.autograd.grad(loss_fn(o, whole), o)
        found, start = [], 0
        for target, n in zip(targets, sizes):
            op = out.narrow(rule.out_dim, start, n).clone().requires_grad_(True)
            (h,) = torch.autograd.grad(loss_fn(op, target), op)
            h, gp = h.double(), g.narrow(rule.out_dim, start, n).double()
            hh = float((h * h).sum())
            found.append(float((gp * h).sum()) / hh if hh > 0 else 0.0)
            start += n
    return found


def weights(rule: LossRule, pieces: Sequence[Batch], sizes: Sequence[int],
            whole: Batch | None = None, loss_fn: Callable[..., Any] | None = None
            ) -> list[float]:
    """``c_i`` of each piece of ONE update (docs/design-notes.md); a weighted mean needs the
    ``whole`` minibatch the pieces were cut from and the user's ``loss_fn``."""
    g = len(pieces)
    if rule.kind == "sum":
        return [float(g)] * g
    if rule.kind == "weighted":
        if whole is None or loss_fn is None:
            raise RuntimeConfigError("a weighted-mean loss cut without its whole minibatch",
                                     "report this as an fxpipe bug")
        return [g * c for c in shares(rule, loss_fn, whole[1], [p[1] for p in pieces], sizes)]
    counts = [units(rule, p, n) for p, n in zip(pieces, sizes)]
    total = sum(counts)
    return [g * u / total if total > 0 else 1.0 for u in counts]


def _loss(loss_fn: Callable[..., Any], out: Any, target: Any) -> float | None:
    try:
        v = loss_fn(out, target)
    except Exception:  # noqa: BLE001 - this target cut does not fit the outputs
        return None
    if not isinstance(v, torch.Tensor) or v.numel() != 1:
        return None
    return float(v.detach().double())


def _label_sources(part: Batch, spec: CutSpec) -> list[tuple[str, str, int]]:
    """Integer tensors with a batch dimension, where labels may be (inputs first), and their
    number of dimensions."""
    out = []
    for side, value, dims in (("inputs", as_call(part[0]) if part[0] is not None else None,
                               spec.inputs), ("target", part[1], spec.target)):
        for p, t in tensor_leaves(value) if value is not None else []:
            if not t.is_floating_point() and t.dtype != torch.bool and dims.get(p) is not None:
                out.append((side, p, t.dim()))
    return out


def _masked(part: Batch, side: str, path: str, spec: CutSpec) -> Batch:
    """``part`` with labels set to IGNORE unevenly: all but the first label of the first
    sample (its whole label when a sample has one), so the valid counts of the probe's parts
    differ from their samples."""
    dims = dict(spec.inputs if side == "inputs" else spec.target)

    def mask(value: Any) -> Any:
        flat, tree = pytree.tree_flatten_with_path(value)
        new = []
        for p, v in flat:
            if pytree.keystr(p) == path:
                v = v.clone()
                first = v.select(dims[path], 0)
                if first.dim() == 0:
                    v.select(dims[path], 0).fill_(IGNORE)
                else:
                    flat_first = first.clone().reshape(-1)
                    flat_first[1:] = IGNORE
                    first.copy_(flat_first.reshape(first.shape))
            new.append(v)
        return pytree.tree_unflatten(new, tree)

    inputs, target = part
    if side == "inputs":
        args, kwargs = mask(as_call(inputs))
        inputs = kwargs if isinstance(inputs, Mapping) else (
            type(inputs)(args) if isinstance(inputs, (tuple, list)) else args[0])
    else:
        target = mask(target)
    return inputs, target


def _predict(rule: LossRule, parts: Sequence[float], units: Sequence[float]) -> float:
    if rule.kind == "sum":
        return sum(parts)
    total = sum(units)  # a part without valid labels adds nothing (its own loss is 0 / 0)
    return (sum(u * v for u, v in zip(units, parts) if u > 0) / total if total > 0
            else math.nan)


def probe(run: Callable[[Any], Any], loss_fn: Callable[..., Any], part: Batch,
          inputs_dims: dict[str, int | None], target_dims: dict[str, int | None] | None
          ) -> tuple[CutSpec, LossRule]:
    """The target's batch dimensions (unless given) and the loss's rule, from one minibatch
    (docs/design-notes.md). ``run(inputs)``: the whole model's output, in eval mode without
    gradients."""
    inputs, target = part
    pseudo = CutSpec(inputs_dims, {})
    size = minibatch_size((inputs, None), pseudo)
    if size < 2:
        raise LossSplitError(f"the first minibatch has {size} sample(s) along the inputs' batch "
                             "dimension: nothing to test the loss on", "give minibatches of at "
                             "least 2 samples, or " + BATCH_DIMS_HINT)
    leaves = tensor_leaves(target) if target is not None else []
    if target_dims is not None:
        combos = [target_dims]
    else:
        options = [[d for d in range(t.dim()) if t.shape[d] == size] + [None] for _, t in leaves]
        combos = [{p: d for (p, _), d in zip(leaves, c)} for c in itertools.product(*options)]
        combos.sort(key=lambda c: sum(d is None for d in c.values()))
    tried = []
    for dims in combos[:32]:
        spec = CutSpec(inputs_dims, dims)
        rule = _rule(run, loss_fn, part, spec, size)
        if rule is not None:
            return spec, rule
        tried.append(dims)
    what = (f"the target's tensors {[p for p, _ in leaves]} (tried batch dimensions {tried})"
            if leaves else "the loss")
    raise LossSplitError(
        f"the loss of the whole minibatch is not a combination of its parts' losses for any "
        f"cut of {what}: neither a per-sample mean, a sum, a mean over labels != {IGNORE}, nor "
        "a weighted mean whose weights the target decides (e.g. a loss over the whole "
        "minibatch, such as in-batch negatives, which a cut changes)",
        "train with one microbatch per update (schedule='pipedream', or a named schedule with "
        "microbatches=: each loader minibatch is then one microbatch), or write the loss per "
        "sample; if the target's batch dimension is what fxpipe got wrong, " + BATCH_DIMS_HINT)


def _rule(run: Callable[[Any], Any], loss_fn: Callable[..., Any], part: Batch, spec: CutSpec,
          size: int) -> LossRule | None:
    """The rule with the smallest error (at most 1e-4 relative) over two cuts (1 + N-1 and
    about half and half) of ``part`` and of its masked copies (one per integer tensor that may
    hold labels). The true rule is exact up to rounding; a wrong one is off by its weights'
    difference times the parts' loss difference, which the masked copies make large for label
    counts. Rules no copy tells apart keep the order mean, sum, token; a weighted mean (its
    shares read off float gradients, theirs exact counts) only where none of those holds."""
    sources = _label_sources(part, spec)
    candidates = [LossRule("mean"), LossRule("sum")] + [
        LossRule("token", side, path, shift) for side, path, ndim in sources
        for shift in ((0, 1) if ndim > 1 else (0,))]
    out = run(part[0])
    if isinstance(out, torch.Tensor) and out.is_floating_point() and size in out.shape:
        candidates.append(LossRule("weighted", out_shape=tuple(out.shape),
                                   out_dim=list(out.shape).index(size), out_dtype=str(out.dtype)))
    error = dict.fromkeys(candidates, 0.0)
    cuts = sorted({1, (size + 1) // 2})
    variants = [part] + [_masked(part, side, path, spec) for side, path, _ in sources]
    for i, variant in enumerate(variants):
        try:
            whole = _loss(loss_fn, run(variant[0]), variant[1])
        except Exception:  # noqa: BLE001 - a masked copy of ids, not labels: the model fails
            if i == 0:
                raise
            continue
        if whole is None or not math.isfinite(whole):
            if i == 0:
                return None
            continue  # a masked copy the model or loss cannot take (ids, not labels)
        for k in cuts:
            pieces = cut_sizes(variant, [k, size - k], spec)
            parts = [_loss(loss_fn, run(q[0]), q[1]) for q in pieces]
            if any(v is None for v in parts):
                return None
            for r in candidates:
                if r.kind == "weighted":
                    try:
                        counts = shares(r, loss_fn, variant[1], [q[1] for q in pieces],
                                        (k, size - k))
                    except Exception:  # noqa: BLE001 - no gradient to read weights from
                        error[r] = math.inf
                        continue
                else:
                    counts = [units(r, q, n) for q, n in zip(pieces, (k, size - k))]
                got = _predict(r, parts, counts)  # type: ignore[arg-type]
                err = abs(got - whole) / max(abs(whole), 1e-3) if math.isfinite(got) else math.inf
                error[r] = max(error[r], err)
    plain = [r for r in candidates if r.kind != "weighted"]
    best = min(plain, key=lambda r: error[r])
    if error[best] <= 1e-4:
        return next(r for r in plain if error[r] <= error[best] + 1e-9)
    # a weighted mean only where no count of samples or labels explains the loss: its shares
    # are read off float gradients, a plain mean's are exact integers
    weighted = [r for r in candidates if r.kind == "weighted" and error[r] <= 1e-4]
    return weighted[0] if weighted else None


@dataclass(frozen=True)
class Cut:
    """How the trainer cuts minibatches (:mod:`.trainer_cut`), for auto's pilot to cut alike:
    the same pieces, the same loss scales, so the pilot's flush is the flush that trains."""

    spec: CutSpec
    rule: LossRule | None

    def sizes(self, parts: Sequence[Batch]) -> list[int]:
        return [minibatch_size(p, self.spec) for p in parts]

    loss_fn: Callable[..., Any] | None = None  # the user's (a weighted mean's weights)

    def pieces(self, parts: Sequence[Batch], sizes: Sequence[int], k: int) -> list[Batch]:
        return cut_segment(parts, sizes, k, self.spec, self.rule, self.loss_fn)[0]


def cut_segment(parts: Sequence[Batch], sizes: Sequence[int], k: int, spec: CutSpec,
                rule: LossRule | None, loss_fn: Callable[..., Any] | None = None
                ) -> tuple[list[Batch], list[float]]:
    """A segment's minibatches as ``k`` microbatches each, in order, each target wrapped with
    its loss scale when ``rule`` is given (ranks that compute the loss), and each microbatch's
    share of its minibatch (1/pieces: the logged loss is the mean of the minibatches' losses).
    The segment's last minibatch may be short (a loader without drop_last): it becomes as
    many microbatches as it has samples, the schedule's last, partial, update."""
    out: list[Batch] = []
    share: list[float] = []
    last = len(parts) - 1
    for i, (p, size) in enumerate(zip(parts, sizes)):
        kj = min(k, size) if i == last and size else k
        pieces = cut_part(p, kj, size, spec)
        if rule is not None and kj > 1:
            cs = weights(rule, pieces, piece_sizes(size, kj), p, loss_fn)
            pieces = [(a, Weighted(t, c)) for (a, t), c in zip(pieces, cs)]
        out += pieces
        share += [1.0 / kj] * kj
    return out, share
