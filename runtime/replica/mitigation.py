"""Mitigations of weight staleness, as options of ``pipedream`` (``"pipedream+predict+dc"``).

For stage s, d_s = S - 1 - s updates stale: ``lr_scale``, ``predict`` (weight prediction), ``dc``
(DC-ASGD-a), ``momentum`` (:mod:`.compensate`), ``nesterov`` (:mod:`.nesterov`), joined with ``+``.
"""
from __future__ import annotations

import inspect
import logging
from dataclasses import fields
from typing import Any, Callable, Mapping, Sequence

import torch

from fxpipe.codegen.split import StageSpec

from ..errors import RuntimeConfigError, StashError
from ..schedules.schedule import Action
from ..schedules.spec import Mitigation
from .compensate import spike_compensate
from .nesterov import nesterov_form
from .stage import StageReplica
from .stash import OptimizerFactory, WeightStash

log = logging.getLogger(__name__)


def accepted_keywords(factory: Callable[..., Any]) -> frozenset[str]:
    """Which of ``stage`` and ``delay`` the optimizer factory takes (by its signature)."""
    try:
        params = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: params only
        return frozenset()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return frozenset({"stage", "delay"})
    return frozenset(p.name for p in params if p.name in ("stage", "delay")
                     and p.kind is not inspect.Parameter.POSITIONAL_ONLY)


def bind_optimizer(factory: Callable[..., torch.optim.Optimizer], stage: int, delay: int,
                   mitigation: Mitigation | None = None, depth: int = 1) -> OptimizerFactory:
    """The ``params -> optimizer`` factory of one stage of a ``depth``-stage pipeline: the
    user's factory (given ``stage=`` and ``delay=`` when it takes them), then the Nesterov form,
    learning-rate scaling and momentum correction."""
    kw = {k: v for k, v in (("stage", stage), ("delay", delay)) if k in accepted_keywords(factory)}

    def make(params: list[torch.Tensor]) -> torch.optim.Optimizer:
        opt = factory(params, **kw)
        if mitigation is not None and mitigation.nesterov:
            opt = nesterov_form(opt, delay, max(depth, 1))
        if mitigation is not None and mitigation.lr_scale and delay:
            for group in opt.param_groups:
                group["lr"] = group["lr"] / (1 + delay)
        if mitigation is not None and mitigation.momentum:
            spike_compensate(opt, delay)
        return opt

    return make


def check_mitigation(mitigation: Mitigation | None, *, kind: str, stashing: bool,
                     vertical_sync: bool, stages: Sequence[StageSpec] = (),
                     delays: Sequence[int] = ()) -> None:
    """Refuse combinations the mitigations are not defined for (docs/design-notes.md)."""
    if mitigation is None:
        return
    if kind != "pipedream":
        raise RuntimeConfigError(f"mitigation {mitigation.name!r} with schedule {kind!r}",
                                 "mitigations are options of the asynchronous schedule: "
                                 f"schedule='pipedream+{mitigation.name}'")
    if (mitigation.predict or mitigation.dc) and (not stashing or vertical_sync):
        raise RuntimeConfigError(
            f"mitigation {mitigation.name!r} with stashing={stashing}, vertical_sync="
            f"{vertical_sync}", "predict and dc need weight stashing and the forward reading the "
            "latest weights: use stashing=True, vertical_sync=False")
    if mitigation.momentum and mitigation.nesterov:
        raise RuntimeConfigError("mitigations momentum and nesterov together",
                                 "both rewrite the optimizer's momentum: use one")
    if (mitigation.lr_scale or mitigation.momentum or mitigation.nesterov) and stages and delays:
        from .stage import tied_parameters

        for t in tied_parameters(stages):
            if len({delays[s] for s in t.stages}) > 1:
                raise RuntimeConfigError(
                    f"parameter {t.key!r} is tied across stages {list(t.stages)} with delays "
                    f"{[delays[s] for s in t.stages]}: lr_scale, momentum and nesterov would "
                    "give its copies different steps", "use predict or dc, or untie the parameter")


class _PredictingStash:
    """A replica's :class:`WeightStash` whose forwards read predicted weights (``predict``):
    the same object for everything else (attribute reads go to the stash)."""

    def __init__(self, inner: WeightStash) -> None:
        self._inner = inner
        self.delta: dict[str, torch.Tensor] | None = None  # the last update: W_new - W_old
        self.horizon: dict[int, int] = {}  # minibatch -> updates before its gradient is applied
        self._used: dict[int, dict[str, torch.Tensor]] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def acquire(self, minibatch: int, version: int | None) -> dict[str, torch.Tensor]:
        weights = self._inner.acquire(minibatch, version)
        if version not in (None, self._inner.version):
            raise StashError(f"weight prediction: minibatch {minibatch} reads version {version}, "
                             f"not the latest ({self._inner.version})",
                             "predict needs the forward to read the latest weights")
        h = self.horizon.get(minibatch, 0)
        if h and self.delta is not None:
            with torch.no_grad():
                weights = dict(weights)
                for n, d in self.delta.items():
                    weights[n] = (weights[n] + h * d).requires_grad_(True)
        self._used[minibatch] = weights
        return weights

    def for_backward(self, minibatch: int) -> tuple[int, dict[str, torch.Tensor]]:
        v, weights = self._inner.for_backward(minibatch)
        return v, self._used.get(minibatch, weights)

    def release(self, minibatch: int) -> None:
        self._used.pop(minibatch, None)
        self._inner.release(minibatch)

    def update(self, grads: Mapping[str, torch.Tensor]) -> int:
        old = {n: self._inner.latest[n].detach().clone() for n in self._inner.trainable}
        v = self._inner.update(grads)
        self.delta = {n: self._inner.latest[n].detach() - old[n] for n in old}
        return v


class MitigatedReplica(StageReplica):
    """A :class:`StageReplica` applying ``predict`` and ``dc`` (``lr_scale`` and ``momentum``
    live in the optimizer: :func:`bind_optimizer`). Both executors build it in place of a
    StageReplica, so distributed and reference runs do the same arithmetic."""

    def __init__(self, spec: StageSpec, optimizer_factory: OptimizerFactory, *,
                 mitigation: Mitigation, **kwargs: Any) -> None:
        super().__init__(spec, optimizer_factory, **kwargs)
        self.mitigation = mitigation
        if mitigation.predict:
            self.stash = _PredictingStash(self.stash)  # type: ignore[assignment]
        self._point: Mapping[str, torch.Tensor] | None = None  # weights the gradient read
        self._ms: dict[str, torch.Tensor] = {}

    def prepare(self, actions: Sequence[Action]) -> None:
        """Before a schedule (or a window of a stretch, with its lookahead) runs: for each
        minibatch this rank forwards in ``actions``, how many updates of the stage happen
        between its forward's read and the update applying its gradient (prediction's horizon:
        ``u - v`` for a forward reading version v applied by ``U<u>``). Minibatches forwarded
        earlier keep theirs; a backward of one is skipped here."""
        if not isinstance(self.stash, _PredictingStash):
            return
        read: dict[int, int] = {}
        pending: list[int] = []
        horizon: dict[int, int] = {}
        for a in actions:
            if a.kind == "F":
                read[a.minibatch] = a.version or 0
            elif a.kind == "B":
                pending.append(a.minibatch)
            elif a.kind == "U":
                horizon.update((k, a.minibatch - read[k]) for k in pending if k in read)
                pending = []
        self.stash.horizon = horizon

    def backward(self, minibatch: int, output_grads: Sequence[torch.Tensor | None],
                 **kwargs: Any) -> list[torch.Tensor | None]:
        if self.mitigation.dc:
            self._point = self.stash.for_backward(minibatch)[1]
        try:
            return super().backward(minibatch, output_grads, **kwargs)
        finally:
            self._point = None

    def _accumulate(self, name: str, g: torch.Tensor, own: bool = False) -> torch.Tensor:
        if self._point is not None:
            g, own = self._compensate(name, g), True  # a new tensor
        return super()._accumulate(name, g, own)

    @torch.no_grad()
    def _compensate(self, name: str, g: torch.Tensor) -> torch.Tensor:
        """DC-ASGD-a's correction of one minibatch's gradient of ``name`` (docs/design-notes.md)."""
        m = self.mitigation
        ms = self._ms.get(name)
        ms = self._ms[name] = ((1 - m.dc_decay) * g * g if ms is None
                               else ms.mul_(m.dc_decay).addcmul_(g, g, value=1 - m.dc_decay))
        diff = self.stash.latest[name].detach() - self._point[name].detach()  # type: ignore[index]
        return g + m.dc_lambda / (ms + m.dc_eps).sqrt() * g * g * diff


def make_replica(spec: StageSpec, optimizer_factory: Callable[..., torch.optim.Optimizer], *,
                 delay: int = 0, mitigation: Mitigation | None = None, depth: int = 1,
                 **kwargs: Any) -> StageReplica:
    """The replica of stage ``spec.index`` (of ``depth`` stages) with ``delay``: a plain
    StageReplica or, with ``predict``/``dc``, a MitigatedReplica; its optimizer made by
    :func:`bind_optimizer`."""
    factory = bind_optimizer(optimizer_factory, spec.index, delay, mitigation, depth)
    if mitigation is not None and (mitigation.predict or mitigation.dc):
        return MitigatedReplica(spec, factory, mitigation=mitigation, **kwargs)
    return StageReplica(spec, factory, **kwargs)


def describe(mitigation: Mitigation | None) -> str:
    """One line for logs and summaries."""
    if mitigation is None:
        return "no mitigation"
    knobs = {f.name: getattr(mitigation, f.name) for f in fields(mitigation)
             if f.name.startswith("dc_")} if mitigation.dc else {}
    return mitigation.name + (f" ({', '.join(f'{k}={v:g}' for k, v in knobs.items())})"
                              if knobs else "")
