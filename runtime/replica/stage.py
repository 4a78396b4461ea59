"""One stage replica's computation: forward, backward and update of a StageSpec, no transport.

Both executors drive the same :class:`StageReplica`: the same floating-point operations in the
same order. Re-exports the names of :mod:`.stage_update`, :mod:`.stage_set`, :mod:`.stage_call`.
"""
from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Collection, Mapping, Sequence

import torch
from torch.func import functional_call

from fxpipe.codegen.split import MODEL, StageSpec

from ..errors import RuntimeConfigError, StashError
from .device import move_constants
from .loss_scale import LossScaler, ScalerConfig
from .precision import autocast
from .splitgrad import WeightTask, input_gradients
from .stage_call import is_differentiable, may_write_inputs, modes, rng_state, writable
from .stage_set import (LossFn, TiedParameter, check_stages, model_env, sync_components, tie_sets,
                        tied_parameters)
from .stage_update import UpdateMixin
from .stash import OptimizerFactory, WeightStash, swapped_call, tensor_slots

__all__ = ["LossFn", "StageReplica", "TiedParameter", "check_stages", "detached_values",
           "is_differentiable", "model_env", "modes", "sync_components", "tie_sets",
           "tied_parameters"]

log = logging.getLogger(__name__)

_DETACH_FUNCTIONS = (torch.detach, torch.Tensor.detach, torch.ops.aten.detach.default)


def _is_detach(node: torch.fx.Node) -> bool:
    return (node.op == "call_method" and node.target == "detach") or (
        node.op == "call_function" and node.target in _DETACH_FUNCTIONS)


def detached_values(stages: Sequence[StageSpec]) -> frozenset[str]:
    """Values sent between stages that every stage consuming them only ``.detach()``es (each
    use of its input is a detach): no gradient can flow back along them.

    Why it matters: PyTorch gives a parameter whose output is detached no gradient at all
    (``grad=None``: the optimizer skips it), and fxpipe keeps that rule within a stage (see
    :mod:`.stage_update`). Across a cut, the consumer would compute a gradient for its input
    anyway (zeros: the input did not influence its outputs) and send it back, and the producer's
    parameters would then get a zero gradient, which weight decay and momentum step. So both
    executors treat these values as carrying no gradient: the consumer does not differentiate
    them, no gradient message is planned for them, and the producer's backward has nothing to
    seed them with. The rule is deliberately narrow (a detach as the only use of the input, the
    usual shape of a cut right before ``.detach()``): a value reaching the outputs through any
    other op keeps its gradient message, zeros included, as before.

    Also without a gradient: values no gradient can reach, not even from a floating model
    input, as tracing's shape pass found on every rank (``meta["fxpipe"]["carries_grad"]``
    False on the consumer's placeholder, copied from the producing node): a float made from
    indices (``histc`` of an ``argmax``, a Mixture-of-Experts router's counts) is a constant to
    autograd in eager PyTorch; made a leaf that requires grad, an integer ``cumsum`` of it fails
    (``Autograd not support dtype: Int``)."""
    uses: dict[str, list[bool]] = {}
    for st in stages:
        placeholders = [n for n in st.gm.graph.nodes if n.op == "placeholder"]
        if len(placeholders) != len(st.inputs):  # not split_graph's layout: assume nothing
            return frozenset()
        for name, src, ph in zip(st.inputs, st.sources, placeholders):
            if src != MODEL:
                uses.setdefault(name, []).append(
                    ph.meta.get("fxpipe", {}).get("carries_grad") is False
                    or (bool(ph.users) and all(_is_detach(u) for u in ph.users)))
    return frozenset(n for n, only in uses.items() if only and all(only))


@dataclass
class _InFlight:
    inputs: list[torch.Tensor]
    outputs: tuple[Any, ...] | None  # None when the forward ran without a graph (no stashing)
    loss: torch.Tensor | None
    target: Any = None  # kept to recompute the loss when not stashing
    rng: tuple[torch.Tensor, torch.Tensor | None] | None = None  # recompute: the forward's RNG


class StageReplica(UpdateMixin):
    """The parameters, weight versions, buffers and gradient sums of one (stage, replica)."""

    def __init__(self, spec: StageSpec, optimizer_factory: OptimizerFactory, *,
                 loss_fn: LossFn | None = None, stashing: bool = True,
                 planned_reads: Mapping[int, int] | None = None,
                 model_input_grads: bool = True, device: torch.device | None = None,
                 precision: str = "fp32", recompute: bool = False,
                 master_weights: bool | None = None, scaler: ScalerConfig | None = None,
                 detached: Collection[str] = ()) -> None:
        """``device``: where this replica's weights, buffers and gradients live. The stage's
        GraphModule is NOT moved: its own tensors are never used for compute (every call swaps
        the replica's in), so a device holds the weights once (the stash), not twice.
        ``precision``: ``"bf16"``/``"fp16"`` runs forwards under autocast
        (:mod:`fxpipe.runtime.replica.precision`).
        ``recompute``: activation recomputation: forwards keep only the stage's inputs (and the
        RNG state), the backward re-runs the forward with the same stashed weights, RNG and
        precision, so gradients are those of the stored-activation run (bitwise on the CPU).
        ``master_weights``: float32 masters for low-precision parameters (:mod:`.master`).
        ``scaler``: dynamic loss scaling (fp16, :mod:`.loss_scale`): the last stage seeds its
        backwards with the scale; the executor unscales, checks and steps at each update.
        ``detached``: input values that carry no gradient (:func:`detached_values`): not
        differentiated, their backward gradient None (nothing is sent back for them)."""
        self.spec = spec
        self.precision, self.recompute = precision, recompute
        self.scaler = LossScaler(scaler) if scaler is not None else None
        self.device = device if device is not None else torch.device("cpu")
        self.clip: Callable[[dict[str, torch.Tensor | None]],
                            dict[str, torch.Tensor | None]] | None = None
        """Gradient clipping of an update's mean gradients (set by the executor, see
        :mod:`fxpipe.runtime.replica.clipping`); ``clip_local``: it needs no communication (the
        stage scope), so it also applies to the tied-only steps."""
        self.clip_local = True
        self.busy_s = 0.0  # seconds spent in forward, backward and update (metrics)
        self.on_update: Callable[[], None] | None = None
        """Called after every optimizer step of an update ``U`` (an LR scheduler's ``step``),
        not after the tied-only steps that complete delayed tied rounds."""
        # False: model inputs get no gradient (backward returns None for them). Why: nobody
        # consumes it in the distributed executor, and for the input stage it is a whole extra
        # product with the first layer's weights per backward; parameter gradients do not
        # depend on it.
        self._no_grad_in = (frozenset() if model_input_grads else frozenset(
            i for i, src in enumerate(spec.sources) if src == MODEL)) | frozenset(
            i for i, (n, src) in enumerate(zip(spec.inputs, spec.sources))
            if src != MODEL and n in detached)
        self.is_last = loss_fn is not None
        self.loss_fn = loss_fn
        params = dict(spec.gm.named_parameters())
        self.stash = WeightStash(params, optimizer_factory, stashing=stashing,
                                 planned_reads=planned_reads, device=device,
                                 master_weights=master_weights)
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
        self._clone_in = may_write_inputs(spec)  # see stage_call.writable

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
                outs = self._call(weights, writable(ins, self._clone_in))
                loss = self._loss(outs, target) if self.is_last else None
            self._flight[minibatch] = _InFlight(ins, outs, loss)
        else:
            rng = rng_state(self.device) if self.recompute else None
            with torch.no_grad(), autocast(self.precision, self.device):
                outs = self._call(weights, writable(ins, self._clone_in))
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
            roots = [fl.loss]
            seeds = [self.scaler.seed(fl.loss) if self.scaler is not None else None]
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
        self._weights_done(minibatch, names, grads[len(diff_in):], summed,
                           exclusive(grads[len(diff_in):], [*seeds, *grads[:len(diff_in)]]))
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
                      grads: Sequence[torch.Tensor | None], summed: Mapping[str, torch.Tensor],
                      own: Sequence[bool] = ()) -> None:
        """Sum a minibatch's weight gradients (those the hooks have not summed yet), count the
        minibatch and let its weight version go. ``own[i]``: gradient i shares its memory with
        nothing (:func:`exclusive`), so a sum it starts may be added to in place."""
        self.stash.release(minibatch)
        for i, (n, g) in enumerate(zip(names, grads)):
            if n not in summed and g is not None:  # the hooks already added theirs
                self._accumulate(n, g, own=i < len(own) and own[i])
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
                outs = self._call(weights, writable(fl.inputs, self._clone_in))
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
                    outs = self._call(weights, writable(fl.inputs, self._clone_in))
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

    def _accumulate(self, name: str, g: torch.Tensor, own: bool = False) -> torch.Tensor:
        """Add ``g`` to ``name``'s gradient sum and return the sum. The first gradient is kept
        as is (no copy); unless it is known to share its memory with nothing (``own``), the
        second allocates the sum once; later ones add in place (the same additions, in the same
        order, as ``sum = sum + g``: a peak of one weight less when the first is owned,
        measured in tests/runtime/replica/test_runtime_memory_dist.py). A gradient of a parameter with a
        float32 master is summed in float32 (:mod:`.master`): the first one is cast (a copy)."""
        cur = self._grad_sum.get(name)
        if cur is None:
            dt = self.stash.grad_dtypes.get(name, g.dtype)
            if g.dtype != dt:
                g = g.to(dt)
                own = True
            if own:
                self._owned.add(name)
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

    def averaged(self) -> list[torch.Tensor]:
        """What LocalSGD averages over a stage's replicas, in one order on every replica: each
        weight's float32 master where one is kept (rounded down afterwards with
        ``stash.masters.copy_down``), else the weight, then the floating-point buffers."""
        masters = self.stash.masters.master
        return ([masters.get(n, t) for n, t in self.stash.latest.items()]
                + [b for b in self.buffers.values() if b.is_floating_point()])

    @property
    def grad_sums(self) -> Mapping[str, torch.Tensor]:
        """Gradient sums since the last update by parameter name (absent: no gradient yet)."""
        return self._grad_sum

    def evaluate(self, inputs: Sequence[Any]) -> tuple:
        """Evaluation forward with the latest weights: no graph, the stage in eval mode (then
        every module back in the mode it had)."""
        with modes(self.spec.gm, training=False), torch.no_grad(), \
                autocast(self.precision, self.device):
            return self._call(self.stash.latest, inputs)

    def parameters(self) -> dict[str, torch.Tensor]:
        """The latest weights by the model's own names (detached copies)."""
        return {n: t.detach().clone() for n, t in self.stash.latest.items()}


def exclusive(grads: Sequence[torch.Tensor | None], others: Sequence[Any]) -> list[bool]:
    """Per gradient, whether it may be summed into in place: its storage is shared with no
    other returned gradient and none of ``others`` (the backward's seeds and input gradients:
    autograd passes an incoming gradient, or a view of it, straight through ``x + w`` or
    ``w.view(...)``, and an input gradient is sent on), and it covers that storage exactly,
    densely (contiguous, or a 2-D transpose of contiguous, as a Linear's weight gradient is),
    so it is no expanded or partial view."""
    counts: dict[int, int] = {}
    for t in [*grads, *others]:
        if isinstance(t, torch.Tensor):
            p = t.untyped_storage().data_ptr()
            counts[p] = counts.get(p, 0) + 1
    out = []
    for g in grads:
        out.append(isinstance(g, torch.Tensor)
                   and counts[g.untyped_storage().data_ptr()] == 1
                   and g.untyped_storage().nbytes() == g.numel() * g.element_size()
                   and (g.is_contiguous() or (g.dim() == 2 and g.t().is_contiguous())))
    return out

