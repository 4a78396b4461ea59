"""The wire plan: the shape and dtype of every value crossing a stage boundary, per minibatch.

Receivers post ``irecv`` into right-sized buffers before the data arrives, with no shapes on the
wire; specs come from the tracer's metadata, else a fake-tensor dry run per input signature.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

from fxpipe.codegen.split import MODEL, StageSpec

from ..replica.precision import autocast
from ..replica.stage import model_env
from .comm import TensorSpec

log = logging.getLogger(__name__)

Signature = tuple[tuple[str, tuple[int, ...], str], ...]


@dataclass(frozen=True)
class WirePlan:
    """``values``: every crossing value name, in a fixed order (its index is part of the tag).
    ``specs[signature_of[k]][name]``: the TensorSpec of ``name`` for minibatch k."""

    values: tuple[str, ...]
    specs: tuple[Mapping[str, TensorSpec], ...]
    signature_of: tuple[int, ...]

    def spec(self, name: str, minibatch: int) -> TensorSpec:
        return self.specs[self.signature_of[minibatch]][name]

    def index(self, name: str) -> int:
        return self.values.index(name)


def crossing_values(stages: Sequence[StageSpec]) -> tuple[str, ...]:
    """Names of the values sent from one stage to another, in stage/output order."""
    return tuple(n for st in stages for n, cons in zip(st.outputs, st.consumers)
                 if any(c != MODEL for c in cons))


def _signature(env: Mapping[str, Any]) -> Signature:
    return tuple((n, tuple(v.shape), str(v.dtype)) for n, v in sorted(env.items())
                 if isinstance(v, torch.Tensor))


def _dtype(text: str) -> torch.dtype | None:
    dt = getattr(torch, text.split(".")[-1], None) if isinstance(text, str) else None
    return dt if isinstance(dt, torch.dtype) else None


def _from_meta(stages: Sequence[StageSpec], env: Mapping[str, Any],
               values: Sequence[str]) -> dict[str, TensorSpec] | None:
    """Specs from the tracer's metadata, or None unless it covers these exact model inputs."""
    meta: dict[str, tuple[Any, Any]] = {}
    for st in stages:
        for node in st.gm.graph.nodes:
            m = node.meta.get("fxpipe")
            if isinstance(m, Mapping) and m.get("is_tensor"):
                meta[node.name] = (m.get("shape"), m.get("dtype"))
    for name, v in env.items():
        if isinstance(v, torch.Tensor) and (name not in meta or tuple(meta[name][0] or ())
                                            != tuple(v.shape)):
            return None
    out: dict[str, TensorSpec] = {}
    for name in values:
        shape, dtype = meta.get(name, (None, None))
        dt = _dtype(dtype)
        if shape is None or dt is None:
            return None
        out[name] = TensorSpec(tuple(shape), dt)
    return out


def _specs(env: Mapping[str, Any], values: Sequence[str]) -> dict[str, TensorSpec]:
    return {name: TensorSpec(tuple(env[name].shape), env[name].dtype) for name in values}


def _fake_run(stages: Sequence[StageSpec], env: dict[str, Any],
              values: Sequence[str], precision: str = "fp32",
              device: str = "cpu") -> dict[str, TensorSpec]:
    """Shapes by fake-tensor propagation: every weight and input becomes a fake tensor on
    ``device`` (the CPU, unless autocast must follow another device's rules)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.func import functional_call

    with FakeTensorMode(allow_non_fake_inputs=False) as mode:
        def fake(t: Any) -> Any:
            return mode.from_tensor(t.detach()).to(device) if isinstance(t, torch.Tensor) else t
        fenv = {n: fake(v) for n, v in env.items()}
        with torch.no_grad(), autocast(precision, device):
            for st in stages:
                state = {n: fake(t) for n, t in [*st.gm.named_parameters(),
                                                  *st.gm.named_buffers()]}
                outs = functional_call(st.gm, state, tuple(fenv[n] for n in st.inputs))
                fenv.update(zip(st.outputs, outs))
        return _specs(fenv, values)


def _dry_run(stages: Sequence[StageSpec], env: dict[str, Any],
             values: Sequence[str], precision: str = "fp32",
             device: str = "cpu") -> dict[str, TensorSpec]:
    try:
        return _fake_run(stages, env, values, precision, device)
    except Exception as err:  # noqa: BLE001 - any op without a fake implementation
        log.debug("fake-tensor dry run failed (%s); running the stages on the host", err)
    from ..replica.stage import modes

    state = [t for st in stages for t in st.gm.buffers()]
    saved = [t.detach().clone() for t in state]
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        for st in stages:
            dev = next((t.device for t in st.gm.parameters()), torch.device("cpu"))
            with modes(st.gm, training=False), autocast(precision, dev):
                outs = st.gm(*(v.to(dev) if isinstance(v, torch.Tensor) else v
                               for v in (env[n] for n in st.inputs)))
            env.update(zip(st.outputs, outs))
        for t, old in zip(state, saved):
            t.copy_(old)
    return _specs(env, values)


def make_wire_plan(stages: Sequence[StageSpec], inputs: Sequence[Any], *,
                   cache: dict[Signature, dict[str, TensorSpec]] | None = None,
                   precision: str = "fp32", device: str = "cpu") -> WirePlan:
    """The plan for minibatches with model inputs ``inputs[k]`` (docs/design-notes.md).
    ``precision``: the stages' forwards run under that autocast (``"bf16"``), on ``device``'s
    type (its rules differ between the CPU and CUDA): the tracer's float32 metadata then does
    not apply, the dry run runs under the same autocast."""
    values = crossing_values(stages)
    sigs: dict[Signature, int] = {}
    specs: list[dict[str, TensorSpec]] = []
    signature_of: list[int] = []
    cache = {} if cache is None else cache
    for x in inputs:
        env = model_env(stages, x)
        sig = _signature(env)
        if sig not in sigs:
            found = cache.get(sig)
            how = "the cache"
            if found is None and precision == "fp32":
                found, how = _from_meta(stages, env, values), "metadata"
            if found is None:
                found, how = _dry_run(stages, dict(env), values, precision, device), "a dry run"
            log.debug("wire plan for inputs %s from %s", sig, how)
            cache[sig] = found
            sigs[sig] = len(specs)
            specs.append(found)
        signature_of.append(sigs[sig])
    return WirePlan(values, tuple(specs), tuple(signature_of))


class StretchWire:
    """The wire plans of a stretch's windows (:mod:`fxpipe.runtime.schedules.stream`), by
    minibatch number from the stretch's start: a window's messages may be of minibatches an
    earlier window forwarded, so each window's plan (made for its new minibatches) stays until
    nothing in flight is older than its last minibatch."""

    def __init__(self) -> None:
        self.values: tuple[str, ...] = ()
        self._plans: list[tuple[int, WirePlan]] = []  # (first minibatch, plan), in order

    def add(self, start: int, plan: WirePlan) -> None:
        self.values = plan.values
        self._plans.append((start, plan))

    def spec(self, name: str, minibatch: int) -> TensorSpec:
        for start, plan in reversed(self._plans):
            if start <= minibatch < start + len(plan.signature_of):
                return plan.spec(name, minibatch - start)
        raise KeyError(f"no wire plan holds minibatch {minibatch}")

    def index(self, name: str) -> int:
        return self.values.index(name)

    def forget_before(self, minibatch: int) -> None:
        """Drop the plans of windows whose minibatches are all older than ``minibatch``."""
        self._plans = [(s, p) for s, p in self._plans if s + len(p.signature_of) > minibatch]
