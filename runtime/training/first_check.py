"""What the loader's first minibatch must pass before any training step.

The model runs on its inputs (eval mode, no gradients) and ``loss_fn`` on the output and target,
to one number; a mistake ends here in an error that names it, not mid-pipeline as a raw torch
error or as a loss that "does not split"."""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from fxpipe.codegen.split import MODEL, StageSpec
from fxpipe.errors import FxpipeError, InputMismatchError
from fxpipe.tracing.batchdims import as_call

from ..errors import LossFunctionError
from ..execution.contract import Batch


def describe(value: Any) -> str:
    """A value's structure in a few words: tensors by shape and dtype, containers by content."""
    if isinstance(value, torch.Tensor):
        return f"tensor {tuple(value.shape)} {str(value.dtype).replace('torch.', '')}"
    if isinstance(value, (tuple, list)):
        inner = ", ".join(describe(v) for v in value[:4]) + (", ..." if len(value) > 4 else "")
        return f"{type(value).__name__} of {len(value)} ({inner})"
    if isinstance(value, dict):
        inner = ", ".join(f"{k!r}: {describe(v)}" for k, v in list(value.items())[:4])
        return f"dict ({inner}{', ...' if len(value) > 4 else ''})"
    if hasattr(value, "keys") and hasattr(value, "__getitem__"):  # a model output (ModelOutput)
        return f"{type(value).__name__} with {', '.join(map(str, list(value.keys())[:6]))}"
    return type(value).__name__


def example_shapes(stages: Sequence[StageSpec]) -> dict[str, tuple[tuple[int, ...], str]]:
    """Each model input as the model was compiled: placeholder name -> (shape, dtype) of the
    example (recorded on the stages' placeholders by tracing)."""
    out: dict[str, tuple[tuple[int, ...], str]] = {}
    for st in stages:
        for node in st.gm.graph.nodes:
            if node.op != "placeholder":
                continue
            where = st.inputs.index(node.name) if node.name in st.inputs else -1
            meta = node.meta.get("fxpipe") or {}
            if where >= 0 and st.sources[where] == MODEL and meta.get("shape") is not None:
                out.setdefault(node.name, (tuple(meta["shape"]), str(meta.get("dtype", ""))))
    return out


def input_differences(stages: Sequence[StageSpec], inputs: Any) -> list[str]:
    """How the loader's ``inputs`` differ from the example's, input by input (shape beyond the
    batch dimension, number of dimensions, dtype); empty when nothing differs or the inputs do
    not bind to the model's arguments."""
    io = stages[0].io
    if io is None:
        return []
    args, kwargs = as_call(inputs)
    try:
        bound = io.bind_inputs(args, kwargs)
    except FxpipeError:
        return []
    example = example_shapes(stages)
    arg = (dict(zip(io.input_names, io.arg_names))
           if len(io.input_names) == len(io.arg_names) else {})
    out = []
    for placeholder, value in bound.items():
        if not isinstance(value, torch.Tensor) or placeholder not in example:
            continue
        shape, dtype = example[placeholder]
        name = arg.get(placeholder, placeholder)
        got = tuple(value.shape)
        if len(got) != len(shape):
            out.append(f"input {name!r} has {len(got)} dimensions {got}, the example had "
                       f"{len(shape)} {shape}")
            continue
        dims = [d for d in range(1, len(got)) if got[d] != shape[d]]
        if dims:
            out.append(f"input {name!r} is {got} where the example was {shape}: dimension "
                       + ", ".join(f"{d} ({got[d]} vs {shape[d]})" for d in dims) + " differs")
        if dtype and str(value.dtype) != dtype:
            out.append(f"input {name!r} is {value.dtype}, the example was {dtype}")
    return out


def check_first(stages: Sequence[StageSpec], loss_fn: Callable[..., Any], part: Batch,
                run: Callable[[Any], Any]) -> None:
    """Raise an error naming the mistake when the model cannot run on ``part``'s inputs
    (:class:`~fxpipe.errors.InputMismatchError`), or ``loss_fn`` fails on its output and target
    or returns more than one number (:class:`~fxpipe.runtime.errors.LossFunctionError`).
    ``run(inputs)``: the whole model's output, in eval mode without gradients."""
    inputs, target = part
    try:
        out = run(inputs)
    except FxpipeError:
        raise
    except Exception as err:  # noqa: BLE001 - the model's own error, named with its cause
        diff = input_differences(stages, inputs)
        raise InputMismatchError(
            f"the model fails on the loader's first minibatch ({type(err).__name__}: "
            f"{str(err).strip().splitlines()[0] if str(err).strip() else ''})"
            + (f": {'; '.join(diff)}" if diff else ""),
            "feed minibatches shaped like the example_inputs the model was compiled with (only "
            "the batch dimension may differ), or compile with an example of the data you train "
            f"on; the loader's inputs: {describe(inputs)}") from err
    said = (f"fxpipe calls loss_fn(output, target) with the model's output ({describe(out)}) "
            f"and the loader's target ({describe(target)})")
    try:
        loss = loss_fn(out, target)
    except FxpipeError:
        raise
    except Exception as err:  # noqa: BLE001 - the user's loss: its own error, surfaced
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        raise LossFunctionError(
            f"loss_fn {name_of(loss_fn)} raised {type(err).__name__} on the first minibatch: "
            f"{first}", f"{said}: a loss of one argument, or one written (target, output), "
            "fails here") from err
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        what = (f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor)
                else describe(loss))
        raise LossFunctionError(
            f"loss_fn {name_of(loss_fn)} returned {what}, not one number",
            "a loss with reduction='none' gives one value per sample: use reduction='mean' or "
            "'sum', or reduce it in your loss (.mean()); " + said)


def name_of(fn: Any) -> str:
    """A callable's name as a user wrote it (``F.cross_entropy``, ``CrossEntropyLoss()``)."""
    if isinstance(fn, torch.nn.Module):
        return f"{type(fn).__name__}()"
    inner = getattr(fn, "loss_fn", None)  # fxpipe's WeightedLoss around the user's
    if inner is not None and inner is not fn:
        return name_of(inner)
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)


def check_loss_fn(loss_fn: Any) -> None:
    """Refuse what cannot be a loss before anything is traced or trained: a class (the loss
    module's ``nn.CrossEntropyLoss`` instead of ``nn.CrossEntropyLoss()``) or a non-callable."""
    if isinstance(loss_fn, type):
        raise LossFunctionError(
            f"loss_fn={loss_fn.__module__.replace('torch.nn.modules.loss', 'nn')}."
            f"{loss_fn.__name__} is a class, not a loss",
            f"pass an instance, loss_fn={loss_fn.__name__}() (with its options), or a function "
            "such as F.cross_entropy")
    if not callable(loss_fn):
        raise LossFunctionError(f"loss_fn={loss_fn!r} is not callable",
                                "pass a function loss_fn(output, target) -> a scalar tensor, "
                                "e.g. F.cross_entropy or nn.CrossEntropyLoss()")

