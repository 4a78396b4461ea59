"""One stage replica's computation: forward, backward and update of a StageSpec, no transport.

Both executors (the single-process reference and the distributed one) drive the same
:class:`StageReplica`, so they do the same floating-point operations in the same order and their
results can be compared tightly; they differ only in how tensors travel and how the replicas'
gradients are summed.

Gradient semantics of an update ``U``: each replica sums the parameter gradients of the minibatches
it ran since its previous update and counts them; the replicas of the stage add up both (an
all-reduce of one flat buffer, or the same sums in buckets launched during the last backward of
the round: :mod:`fxpipe.runtime.buckets`) and the update uses sum / count, the mean gradient over
the minibatches of the group (= plain SGD for one replica updating after every minibatch).

Why the update path avoids copies: on a one-stage run the gradient memory is touched by the
backward and by the optimizer anyway; every extra pass (concatenating, dividing into a new tensor,
cloning) costs as much again, and every fresh allocation of a large tensor pays page faults. So
a gradient sum is accumulated in place once the replica owns it, a lone replica without tied
weights hands its sums straight to the optimizer (:meth:`StageReplica.apply_local_update`), and
the flat path divides views of the summed buffer in place. The floating-point operations (one
addition per minibatch in order, one division by the count) are exactly those of the copying
version, so results are bit-identical.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import operator
import time
from dataclasses import dataclass
from typing import Any, Callable, Collection, Iterator, Mapping, Sequence

import torch
from torch.func import functional_call

from fxpipe.codegen.split import MODEL, StageSpec

from .device import move_constants
from .errors import RuntimeConfigError, StashError
from .splitgrad import WeightTask, input_gradients
from .precision import autocast
from .schedule import sync_sets
from .stash import OptimizerFactory, WeightStash, swapped_call, tensor_slots

log = logging.getLogger(__name__)

LossFn = Callable[[Any, Any], torch.Tensor]


def is_differentiable(t: torch.Tensor) -> bool:
    """Gradients flow only through floating/complex tensors: the rule both ends of a cut share,
    so a receiver never waits for a gradient the sender will not send."""
    return t.is_floating_point() or t.is_complex()


def check_stages(stages: Sequence[StageSpec], replicas: Sequence[int]) -> None:
    """Reject pipelines the runtime cannot carry out, with a hint."""
    if not stages:
        raise RuntimeConfigError("no stages", "pass the list split_graph returned")
    if len(replicas) != len(stages):
        raise RuntimeConfigError(f"{len(stages)} stages but replicas={list(replicas)}",
                                 "give one replica count per stage")
    last = len(stages) - 1
    for st in stages:
        for name, cons in zip(st.outputs, st.consumers):
            if MODEL in cons and st.index != last:
                raise RuntimeConfigError(
                    f"model output {name!r} is produced by stage {st.index}, not the last stage",
                    "the loss runs on the last stage: put every model output there")
    if stages[last].io is None:
        raise RuntimeConfigError("the stages carry no model I/O description",
                                 "build them with fxpipe.codegen.split_graph")
    for t in tied_parameters(stages):
        log.info("parameter %r is used by stages %s: one logical parameter, its gradients are "
                 "summed across those stages at every update", t.key, list(t.stages))


@dataclass(frozen=True)
class TiedParameter:
    """A Parameter used by several stages (e.g. GPT's ``wte.weight`` / ``lm_head.weight``).

    Why it matters: every stage holding it trains a copy, so the copies stay one logical
    parameter only if every update of each copy uses the same gradient: the sum of all its uses'
    gradients (Megatron's embedding all-reduce). ``key``: its name in the lowest stage;
    ``names[s]``: its name in stage s (tied weights can have a different name per stage).
    """

    key: str
    names: Mapping[int, str]

    @property
    def stages(self) -> tuple[int, ...]:
        return tuple(sorted(self.names))


def tied_parameters(stages: Sequence[StageSpec]) -> tuple[TiedParameter, ...]:
    """Trainable Parameters shared by identity across stages (split_graph keeps the model's
    Parameter objects, and a pickled list of stages keeps the sharing), sorted by key."""
    seen: dict[int, dict[int, str]] = {}
    for st in stages:
        for n, p in st.gm.named_parameters(remove_duplicate=False):
            if p.requires_grad:
                seen.setdefault(id(p), {}).setdefault(st.index, n)
    tied = [TiedParameter(names[min(names)], dict(sorted(names.items())))
            for names in seen.values() if len(names) > 1]
    return tuple(sorted(tied, key=lambda t: t.key))


def tie_sets(tied: Sequence[TiedParameter]) -> dict[tuple[int, ...], list[TiedParameter]]:
    """Tied parameters grouped by the exact set of stages holding them: one all-reduce (and one
    process group) per set, in sorted order so every rank posts them in the same order."""
    out: dict[tuple[int, ...], list[TiedParameter]] = {}
    for t in tied:
        out.setdefault(t.stages, []).append(t)
    return dict(sorted(out.items()))


def sync_components(tied: Sequence[TiedParameter]) -> list[tuple[int, ...]]:
    """Stages whose updates must happen together (connected through tied parameters)."""
    return sync_sets([t.stages for t in tied])


def model_env(stages: Sequence[StageSpec], inputs: Any) -> dict[str, Any]:
    """Model inputs by placeholder name, from a tensor, a tuple of positional inputs or a dict
    of keyword inputs (a Hugging Face batch)."""
    io = stages[-1].io
    if isinstance(inputs, Mapping):
        return io.bind_inputs((), inputs)  # type: ignore[union-attr]
    args = inputs if isinstance(inputs, (tuple, list)) else (inputs,)
    return io.bind_inputs(args, None)  # type: ignore[union-attr]


@dataclass
class _InFlight:
    inputs: list[torch.Tensor]
    outputs: tuple[Any, ...] | None  # None when the forward ran without a graph (no stashing)
    loss: torch.Tensor | None
    target: Any = None  # kept to recompute the loss when not stashing
    rng: tuple[torch.Tensor, torch.Tensor | None] | None = None  # recompute: the forward's RNG


class StageReplica:
    """The parameters, weight versions, buffers and gradient sums of one (stage, replica)."""

    def __init__(self, spec: StageSpec, optimizer_factory: OptimizerFactory, *,
                 loss_fn: LossFn | None = None, stashing: bool = True,
                 planned_reads: Mapping[int, int] | None = None,
                 model_input_grads: bool = True, device: torch.device | None = None,
                 precision: str = "fp32", recompute: bool = False) -> None:
        """``device``: where this replica's weights, buffers and gradients live. The stage's
        GraphModule is NOT moved: its own tensors are never used for compute (every call swaps
        the replica's in), so a device holds the weights once (the stash), not twice.
        ``precision``: ``"bf16"`` runs forwards under autocast (:mod:`fxpipe.runtime.precision`).
        ``recompute``: activation recomputation: forwards keep only the stage's inputs (and the
        RNG state), the backward re-runs the forward with the same stashed weights, RNG and
        precision, so gradients are those of the stored-activation run (bitwise on the CPU)."""
        self.spec = spec
        self.precision, self.recompute = precision, recompute
        self.device = device if device is not None else torch.device("cpu")
        self.clip: Callable[[dict[str, torch.Tensor | None]],
                            dict[str, torch.Tensor | None]] | None = None
        """Gradient clipping of an update's mean gradients (set by the executor, see
        :mod:`fxpipe.runtime.clipping`); ``clip_local``: it needs no communication (the stage
        scope), so it also applies to the tied-only steps."""
        self.clip_local = True
        self.busy_s = 0.0  # seconds spent in forward, backward and update (metrics)
        self.on_update: Callable[[], None] | None = None
        """Called after every optimizer step of an update ``U`` (an LR scheduler's ``step``),
        not after the tied-only steps that complete delayed tied rounds."""
        # False: model inputs get no gradient (backward returns None for them). Why: nobody
        # consumes it in the distributed executor, and for the input stage it is a whole extra
        # product with the first layer's weights per backward; parameter gradients do not
        # depend on it.
        self._no_grad_in = frozenset() if model_input_grads else frozenset(
            i for i, src in enumerate(spec.sources) if src == MODEL)
        self.is_last = loss_fn is not None
        self.loss_fn = loss_fn
        params = dict(spec.gm.named_parameters())
        self.stash = WeightStash(params, optimizer_factory, stashing=stashing,
                                 planned_reads=planned_reads, device=device)
        self.buffers = {n: b.detach().to(device, copy=True) if device is not None
                        else b.detach().clone() for n, b in spec.gm.named_buffers()}
        if device is not None:
            move_constants(spec.gm, device)
        self._flight: dict[int, _InFlight] = {}
        self._weight_tasks: dict[int, WeightTask] = {}  # split backwards awaiting their W
        self._grad_sum: dict[str, torch.Tensor] = {}
        # names whose sum is a tensor this replica allocated (safe to add to / divide in place);
        # a first gradient is kept as autograd returned it, which may alias a tensor that is sent
        # on (e.g. the gradient of ``x + w`` is the incoming gradient itself)
        self._owned: set[str] = set()
        self._count = 0
        self._slots = tensor_slots(spec.gm)
        self._clone_in = _may_write_inputs(spec)  # see _writable

    def _call(self, weights: Mapping[str, torch.Tensor], inputs: Sequence[torch.Tensor]) -> tuple:
        if self._slots is None:
            out = functional_call(self.spec.gm, {**weights, **self.buffers}, tuple(inputs))
        else:
            out = swapped_call(self.spec.gm, self._slots, (weights, self.buffers), inputs)
        if not isinstance(out, tuple) or len(out) != len(self.spec.outputs):
            raise RuntimeConfigError(f"stage {self.spec.index} returned {type(out).__name__}, "
                                     f"expected a tuple of {len(self.spec.outputs)} values",
                                     "use StageSpecs built by split_graph")
        return out

    def _loss(self, outs: tuple, target: Any) -> torch.Tensor:
        env = dict(zip(self.spec.outputs, outs))
        return self.loss_fn(self.spec.io.build_output(env), target)  # type: ignore[misc,union-attr]

    def forward(self, minibatch: int, version: int | None, inputs: Sequence[Any],
                target: Any = None) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """Run the forward of ``minibatch`` on weight ``version``; return the detached outputs
        (to send on) and, on the last stage, the detached loss (a tensor on the stage's device:
        reading it as a number would make a GPU wait for the forward, so callers collect losses
        and read them once per segment)."""
        ins = [t.detach().requires_grad_(True) if isinstance(t, torch.Tensor)
               and is_differentiable(t) and i not in self._no_grad_in else t
               for i, t in enumerate(inputs)]
        t0 = time.perf_counter()
        weights = self.stash.acquire(minibatch, version)
        if self.stash.stashing and not self.recompute:
            with autocast(self.precision, self.device):
                outs = self._call(weights, _writable(ins, self._clone_in))
                loss = self._loss(outs, target) if self.is_last else None
            self._flight[minibatch] = _InFlight(ins, outs, loss)
        else:
            rng = _rng_state(self.device) if self.recompute else None
            with torch.no_grad(), autocast(self.precision, self.device):
                outs = self._call(weights, _writable(ins, self._clone_in))
                loss = self._loss(outs, target) if self.is_last else None
            self._flight[minibatch] = _InFlight(ins, None, None, target, rng)
        self.busy_s += time.perf_counter() - t0
        sent = [o.detach() if isinstance(o, torch.Tensor) else o for o in outs]
        return sent, (loss.detach() if loss is not None else None)

    def backward(self, minibatch: int, output_grads: Sequence[torch.Tensor | None], *,
                 on_grad: Callable[[str, torch.Tensor], None] | None = None,
                 hooked: Collection[str] | None = None,
                 split: bool = False) -> list[torch.Tensor | None]:
        """Backward of ``minibatch`` given the gradients of its outputs (ignored on the last
        stage); accumulates parameter gradients and returns the inputs' gradients (None for
        non-differentiable inputs; zeros where an input did not influence the outputs).

        ``on_grad(name, sum)``: called in the middle of the backward, as soon as parameter
        ``name``'s gradient is computed, with its new gradient sum (the same tensor that is then
        kept): lets the caller all-reduce it while the rest of the backward runs. Parameters
        without a gradient are not reported. ``hooked``: the names reported this way (default:
        every trainable one); the caller reads the other sums from :attr:`grad_sums` after.

        ``split``: compute only the input gradients now (a zero-bubble schedule's B); the weight
        gradients wait for :meth:`backward_weight` (its W), which also releases the weights'
        version. The results are those of the fused backward (:mod:`.splitgrad`)."""
        if minibatch not in self._flight:
            raise StashError(f"backward of minibatch {minibatch} on stage {self.spec.index} "
                             "without its forward", "run F<k> before B<k>")
        t0 = time.perf_counter()
        fl = self._flight.pop(minibatch)
        _, weights = self.stash.for_backward(minibatch)
        if fl.outputs is None:  # recompute (or no stashing: with the latest weights)
            fl = self._recompute(fl, weights)
        if self.is_last:
            roots, seeds = [fl.loss], [None]
        else:
            pairs = [(o, g) for o, g in zip(fl.outputs, output_grads)  # type: ignore[arg-type]
                     if isinstance(o, torch.Tensor) and o.requires_grad and g is not None]
            roots, seeds = [p[0] for p in pairs], [p[1] for p in pairs]
        diff_in = [i for i, t in enumerate(fl.inputs)
                   if isinstance(t, torch.Tensor) and t.requires_grad]
        names = self.stash.trainable
        if split:
            got, task = input_gradients(roots, seeds, [fl.inputs[i] for i in diff_in],
                                        [weights[n] for n in names])
            self._weight_tasks[minibatch] = task
            self.busy_s += time.perf_counter() - t0
            return self._input_grads(fl.inputs, diff_in, got)
        wrt = [fl.inputs[i] for i in diff_in] + [weights[n] for n in names]
        grads: Sequence[torch.Tensor | None] = [None] * len(wrt)
        summed: dict[str, torch.Tensor] = {}  # sums already made by the hooks
        hooks = ([weights[n].register_hook(functools.partial(self._hook, n, summed, on_grad))
                  for n in names if hooked is None or n in hooked]
                 if on_grad is not None and roots else [])
        try:
            if roots and wrt:
                grads = torch.autograd.grad(roots, wrt, seeds, allow_unused=True)
        finally:
            for h in hooks:  # the weights are shared with other minibatches' graphs
                h.remove()
        self._weights_done(minibatch, names, grads[len(diff_in):], summed)
        self.busy_s += time.perf_counter() - t0
        return self._input_grads(fl.inputs, diff_in, grads[:len(diff_in)])

    def backward_weight(self, minibatch: int, *,
                        on_grad: Callable[[str, torch.Tensor], None] | None = None,
                        hooked: Collection[str] | None = None) -> None:
        """W of ``minibatch``: the weight gradients its split :meth:`backward` left, summed like
        the fused backward's (``on_grad``/``hooked`` as there)."""
        task = self._weight_tasks.pop(minibatch, None)
        if task is None:
            raise StashError(f"weight gradients of minibatch {minibatch} on stage "
                             f"{self.spec.index} without its split backward",
                             "run B<k> (split) before W<k>")
        t0 = time.perf_counter()
        names = self.stash.trainable
        summed: dict[str, torch.Tensor] = {}
        hook = None
        if on_grad is not None:
            def hook(i: int, g: torch.Tensor) -> None:
                if hooked is None or names[i] in hooked:
                    self._hook(names[i], summed, on_grad, g)
        self._weights_done(minibatch, names, task.run(hook), summed)
        self.busy_s += time.perf_counter() - t0

    def _weights_done(self, minibatch: int, names: Sequence[str],
                      grads: Sequence[torch.Tensor | None], summed: Mapping[str, torch.Tensor]
                      ) -> None:
        """Sum a minibatch's weight gradients (those the hooks have not summed yet), count the
        minibatch and let its weight version go."""
        self.stash.release(minibatch)
        for n, g in zip(names, grads):
            if n not in summed and g is not None:  # the hooks already added theirs
                self._accumulate(n, g)
        self._count += 1

    @staticmethod
    def _input_grads(inputs: Sequence[Any], diff_in: Sequence[int],
                     grads: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
        out: list[torch.Tensor | None] = [None] * len(inputs)
        for i, g in zip(diff_in, grads):
            out[i] = torch.zeros_like(inputs[i]) if g is None else g
        return out

    def _recompute(self, fl: _InFlight, weights: Mapping[str, torch.Tensor]) -> _InFlight:
        """The forward again, with a graph: same weights, precision and (recompute) RNG state;
        buffers written by the forward (BatchNorm's running statistics) are updated once, by
        the first forward, so the recomputation writes into copies."""
        if fl.rng is None:  # the no-stashing ablation: as it always did
            with autocast(self.precision, self.device):
                outs = self._call(weights, _writable(fl.inputs, self._clone_in))
                loss = self._loss(outs, fl.target) if self.is_last else None
            return _InFlight(fl.inputs, outs, loss)
        devices = [self.device] if self.device.type == "cuda" else []
        saved = self.buffers
        self.buffers = {n: b.clone() for n, b in saved.items()}
        try:
            with torch.random.fork_rng(devices=devices):
                torch.set_rng_state(fl.rng[0])
                if fl.rng[1] is not None:
                    torch.cuda.set_rng_state(fl.rng[1], self.device)
                with autocast(self.precision, self.device):
                    outs = self._call(weights, _writable(fl.inputs, self._clone_in))
                    loss = self._loss(outs, fl.target) if self.is_last else None
        finally:
            self.buffers = saved
        return _InFlight(fl.inputs, outs, loss)

    def _hook(self, name: str, summed: dict[str, torch.Tensor],
              on_grad: Callable[[str, torch.Tensor], None], g: torch.Tensor) -> None:
        """Tensor hook of weight ``name``: the same sum :meth:`backward` would make afterwards
        (so results do not depend on hooks), made now and handed to ``on_grad``."""
        summed[name] = self._accumulate(name, g)
        on_grad(name, summed[name])

    def _accumulate(self, name: str, g: torch.Tensor) -> torch.Tensor:
        """Add ``g`` to ``name``'s gradient sum and return the sum. The first gradient is kept
        as is (no copy); the second allocates the sum once; later ones add in place (the same
        additions, in the same order, as ``sum = sum + g``)."""
        cur = self._grad_sum.get(name)
        if cur is None:
            self._grad_sum[name] = g
        elif name in self._owned:
            cur.add_(g)
        else:
            self._grad_sum[name] = cur + g
            self._owned.add(name)
        return self._grad_sum[name]

    @property
    def count(self) -> int:
        """Minibatches whose backward ran since the last update."""
        return self._count

    @property
    def grad_sums(self) -> Mapping[str, torch.Tensor]:
        """Gradient sums since the last update by parameter name (absent: no gradient yet)."""
        return self._grad_sum

    # ------------------------------------------------------------------ updates
    def local_gradient(self) -> torch.Tensor:
        """Flat buffer [sum of gradients of every trainable parameter..., minibatch count]."""
        parts = []
        for n in self.stash.trainable:
            p = self.stash.latest[n]
            g = self._grad_sum.get(n)
            parts.append((torch.zeros_like(p) if g is None else g).reshape(-1))
        ref = next(iter(self.stash.latest.values()), torch.zeros(()))
        parts.append(torch.tensor([float(self._count)], dtype=ref.dtype, device=ref.device))
        return torch.cat(parts)

    def _offsets(self) -> dict[str, tuple[int, int]]:
        """name -> (offset, numel) in the flat buffer of :meth:`local_gradient`."""
        out, off = {}, 0
        for n in self.stash.trainable:
            out[n] = (off, self.stash.latest[n].numel())
            off += out[n][1]
        return out

    def segment(self, flat: torch.Tensor, names: Sequence[str]) -> torch.Tensor:
        """The parts of ``flat`` (a :meth:`local_gradient` layout) for ``names``, concatenated
        (a copy): what a tied-parameter all-reduce sends."""
        offs = self._offsets()
        return torch.cat([flat[offs[n][0]:offs[n][0] + offs[n][1]] for n in names])

    def split_segment(self, seg: torch.Tensor, names: Sequence[str]) -> dict[str, torch.Tensor]:
        """The parts of ``seg`` (a :meth:`segment` layout) by name, shaped like the weights."""
        out, pos = {}, 0
        for n in names:
            p = self.stash.latest[n]
            out[n] = seg[pos:pos + p.numel()].view(p.shape)
            pos += p.numel()
        return out

    def put_segment(self, flat: torch.Tensor, names: Sequence[str], seg: torch.Tensor) -> None:
        """Write ``seg`` (the layout of :meth:`segment`) back into ``flat`` in place."""
        offs, pos = self._offsets(), 0
        for n in names:
            off, numel = offs[n]
            flat[off:off + numel] = seg[pos:pos + numel]
            pos += numel

    def apply_update(self, total: torch.Tensor,
                     tied: Mapping[str, torch.Tensor | None] | None = None) -> int:
        """Step the optimizer with the mean gradient in ``total`` (the sum over the stage's
        replicas of :meth:`local_gradient`); returns the new weight version. ``total`` is
        consumed: its parts are divided in place and handed to the optimizer as views.
        ``tied``: gradients (already means) used instead of ``total``'s for those names, None
        for "no step for this parameter now" (delayed tied rounds, see reference.tied_delay)."""
        return self.finish_update(self.update_grads(total, tied))

    def update_grads(self, total: torch.Tensor,
                     tied: Mapping[str, torch.Tensor | None] | None = None
                     ) -> dict[str, torch.Tensor | None]:
        """The mean gradients :meth:`apply_update` steps with (before clipping); resets the
        round's sums. The reference executor clips them over all stages in between."""
        count = float(total[-1])
        grads: dict[str, torch.Tensor | None] = {}
        offset = 0
        for n in self.stash.trainable:
            p = self.stash.latest[n]
            grads[n] = total[offset:offset + p.numel()].reshape(p.shape)
            offset += p.numel()
        fixed = dict(tied or {})
        grads.update(fixed)
        return self.mean_grads(grads, count, writable=grads, fixed=fixed)

    def apply_local_update(self) -> int:
        """The update of a replica that sums with nobody (one replica, no tied parameters):
        its own gradient sums go straight to the optimizer, with no flat buffer; the same
        values as ``apply_update(local_gradient())``."""
        latest = self.stash.latest
        grads = {n: self._grad_sum[n] if n in self._grad_sum else torch.zeros_like(latest[n])
                 for n in self.stash.trainable}
        writable = {n for n in grads if n in self._owned or n not in self._grad_sum}
        return self.apply_grads(grads, float(self._count), writable=writable)

    def apply_grads(self, grads: Mapping[str, torch.Tensor | None], count: float, *,
                    writable: Collection[str], fixed: Collection[str] = ()) -> int:
        """Step the optimizer with ``grads[n] / count`` (every trainable name; ``count`` 0:
        no minibatch, the sums are used as they are; 1: nothing to divide, ``x / 1 == x``).
        Names in ``writable`` are divided in place, the others into a new tensor; names in
        ``fixed`` are used as given (None: that parameter takes no step). Resets the round's
        sums and count, clips (:attr:`clip`), calls :attr:`on_update`; returns the new weight
        version."""
        return self.finish_update(self.mean_grads(grads, count, writable=writable, fixed=fixed))

    def mean_grads(self, grads: Mapping[str, torch.Tensor | None], count: float, *,
                   writable: Collection[str], fixed: Collection[str] = ()
                   ) -> dict[str, torch.Tensor | None]:
        """``grads / count`` (see :meth:`apply_grads`); resets the round's sums and count."""
        if count > 0 and count != 1:
            grads = {n: g if n in fixed or g is None else g.div_(count) if n in writable
                     else g / count for n, g in grads.items()}
        self._grad_sum.clear()
        self._owned.clear()
        self._count = 0
        return dict(grads)

    def finish_update(self, grads: dict[str, torch.Tensor | None]) -> int:
        """Clip (:attr:`clip`) and step with the mean gradients ``grads``."""
        if self.clip is not None:
            grads = self.clip(grads)
        return self.step(grads)

    def step(self, grads: Mapping[str, torch.Tensor | None]) -> int:
        """One optimizer step with final gradients; calls :attr:`on_update`."""
        t0 = time.perf_counter()
        version = self.stash.update(grads)
        if self.on_update is not None:
            self.on_update()
        self.busy_s += time.perf_counter() - t0
        return version

    def apply_tied_only(self, tied: Mapping[str, torch.Tensor]) -> int:
        """One optimizer step of the tied parameters alone (every other parameter's gradient
        None, so it does not move): what completes the delayed tied rounds at a segment end.
        Does not call :attr:`on_update` (it finishes earlier updates, it is not a new one)."""
        grads: dict[str, torch.Tensor | None] = {n: None for n in self.stash.trainable}
        grads.update(tied)
        if self.clip is not None and self.clip_local:
            grads = self.clip(grads)
        return self.stash.update(grads)

    def evaluate(self, inputs: Sequence[Any]) -> tuple:
        """Evaluation forward with the latest weights: no graph, the stage in eval mode (then
        every module back in the mode it had)."""
        with modes(self.spec.gm, training=False), torch.no_grad(), \
                autocast(self.precision, self.device):
            return self._call(self.stash.latest, inputs)

    def parameters(self) -> dict[str, torch.Tensor]:
        """The latest weights by the model's own names (detached copies)."""
        return {n: t.detach().clone() for n, t in self.stash.latest.items()}


@contextlib.contextmanager
def modes(module: torch.nn.Module, training: bool) -> Iterator[None]:
    """Put ``module`` and all its submodules in train (or eval) mode for a block, then give
    every one back the mode it had (``module.train(old)`` would flatten a mix of modes)."""
    saved = [(m, m.training) for m in module.modules()]
    module.train(training)
    try:
        yield
    finally:
        for m, was in saved:
            m.training = was


def _rng_state(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The CPU generator's state (and the device's, on CUDA): what a recomputed forward needs
    to draw the same dropout masks."""
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


def _writable(ins: Sequence[Any], which: Collection[int]) -> list[Any]:
    """The stage's inputs ``which`` as non-leaf clones: a received activation is a leaf that
    requires grad, and a stage that starts with an in-place op (a cut right before
    ``ReLU(inplace=True)``) may not write into a leaf. The leaves stay in ``_InFlight`` for their
    gradients. Inputs no op may write into (:func:`_may_write_inputs`) are passed as they are."""
    return [x.clone() if i in which and isinstance(x, torch.Tensor) and x.requires_grad else x
            for i, x in enumerate(ins)]


# consumers that never write into their input and return a fresh tensor (not a view of it)
_FRESH_MODULES = (torch.nn.Linear, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d,
                  torch.nn.BatchNorm1d, torch.nn.BatchNorm2d, torch.nn.LayerNorm, torch.nn.ReLU,
                  torch.nn.GELU, torch.nn.Tanh, torch.nn.Sigmoid, torch.nn.MaxPool2d,
                  torch.nn.AvgPool2d, torch.nn.AdaptiveAvgPool2d)
_FRESH_FUNCTIONS = frozenset({operator.add, operator.sub, operator.mul, operator.truediv,
                              operator.matmul, torch.add, torch.mul, torch.matmul, torch.cat,
                              torch.nn.functional.linear, torch.relu})


def _may_write_inputs(spec: StageSpec) -> frozenset[int]:
    """Positions of the inputs that some op might write into in place: every one, except those
    whose every user is a known out-of-place op with a fresh result (conservative)."""
    gm = spec.gm
    if not isinstance(gm, torch.fx.GraphModule):
        return frozenset(range(len(spec.inputs)))
    def safe(user: torch.fx.Node) -> bool:
        if user.op == "call_module":
            mod = gm.get_submodule(str(user.target))
            return type(mod) in _FRESH_MODULES and not getattr(mod, "inplace", False)
        return (user.op == "call_function" and user.target in _FRESH_FUNCTIONS
                and not user.kwargs.get("inplace", False) and "out" not in user.kwargs)
    holders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    return frozenset(i for i, n in enumerate(holders) if not all(safe(u) for u in n.users))
