"""Capture an unmodified ``nn.Module`` as a trainable ``torch.fx.GraphModule``.

``torch.fx.symbolic_trace`` first (module-level nodes: stage code reads like the model), else
``torch.export`` (aten-level, survives shape-dependent control flow such as Hugging Face's).
Either way the graph's parameters ARE the user's Parameter objects, under the user's names.
"""
from __future__ import annotations

import contextlib
import inspect
import io
import linecache
import logging
import os
import re
import traceback
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Literal, Mapping, Sequence

import torch
import torch.fx
from torch import nn

from fxpipe.errors import ConfigError, InputMismatchError, TracingError

from .leaves import rebuildable
from .batchdims import BatchDims, export_dynamic_shapes, infer_batch_dims, record_batch_dims
from .modelio import ModelIO
from .modes import exported_in_train_mode, follow_modes
from .shapes import preserved_state, propagate_shapes

log = logging.getLogger(__name__)

Method = Literal["symbolic_trace", "export"]

# Nodes torch.export's unlifted module adds that only check metadata; they return None and have
# no users, so we drop them: stage code should contain only real work.
_CHECK_TARGETS = tuple(
    t for t in (
        getattr(torch.ops.aten, "_assert_tensor_metadata", None),
        getattr(torch.ops.aten, "_assert_scalar", None),
        getattr(torch.ops.aten, "sym_constrain_range_for_size", None),
    ) if t is not None
)


@dataclass
class TracedGraph:
    """A traced model: the GraphModule, which tracer produced it, its placeholder names, the
    model's calling convention (``io``) and the example inputs bound to the placeholders, in
    order (``flat_inputs``: what every later phase runs the graph on)."""

    gm: torch.fx.GraphModule
    method: Method
    input_names: tuple[str, ...]
    io: ModelIO | None = None
    flat_inputs: tuple[Any, ...] = ()
    batch_dims: BatchDims = BatchDims(note="not tested")


class _LeafTracer(torch.fx.Tracer):
    """A Tracer that keeps user-chosen submodules (by class or qualified name) as leaves, and
    torch.nn modules only where stage code can rebuild them (see :mod:`.leaves`): it traces
    through ``MultiheadAttention`` and ``TransformerEncoderLayer`` rather than keeping them."""

    def __init__(self, leaf_classes: tuple[type, ...], leaf_names: frozenset[str]) -> None:
        super().__init__()
        self._leaf_classes = leaf_classes
        self._leaf_names = leaf_names
        self._rebuildable: dict[int, bool] = {}

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if module_qualified_name in self._leaf_names:
            return True
        if self._leaf_classes and isinstance(m, self._leaf_classes):
            return True
        if not super().is_leaf_module(m, module_qualified_name):
            return False
        if id(m) not in self._rebuildable:
            self._rebuildable[id(m)] = rebuildable(m)
        return self._rebuildable[id(m)]


def _describe(v: Any) -> str:
    if isinstance(v, torch.Tensor):
        return f"Tensor(shape={tuple(v.shape)}, dtype={v.dtype})"
    return type(v).__name__


def _describe_inputs(inputs: Sequence[Any], kwargs: Mapping[str, Any] | None = None) -> str:
    parts = [_describe(v) for v in inputs]
    parts += [f"{k}={_describe(v)}" for k, v in (kwargs or {}).items()]
    return "(" + ", ".join(parts) + ")"


def _signature(model: nn.Module) -> str:
    try:
        return f"{type(model).__name__}.forward{inspect.signature(model.forward)}"
    except (TypeError, ValueError):
        return f"{type(model).__name__}.forward(...)"


def _check_eager(model: nn.Module, inputs: tuple[Any, ...], kwargs: Mapping[str, Any]) -> None:
    """Run the model once; a failure here is the user's inputs, not our tracers."""
    try:
        with preserved_state(model), torch.no_grad():
            model(*inputs, **kwargs)
    except Exception as exc:  # noqa: BLE001 - any failure means the inputs do not fit
        first = str(exc).strip().splitlines()
        msg = first[0] if first else type(exc).__name__
        raise InputMismatchError(
            f"the model does not run on the example inputs {_describe_inputs(inputs, kwargs)}: "
            f"{type(exc).__name__}: {msg}; the model's signature is {_signature(model)}",
            hint="pass example_inputs as a tuple of forward()'s positional arguments and/or a "
                 "dict of its keyword arguments (example_inputs={'input_ids': ids, ...}), with "
                 "the shapes and dtypes the model expects",
        ) from None


def on_meta(model: nn.Module) -> bool:
    """True for a model instantiated on the meta device (``with torch.device('meta'):``): it
    has shapes but no values, enough to trace and estimate costs, not to run or measure."""
    return any(t.device.type == "meta" for t in (*model.parameters(), *model.buffers()))


def _to_meta(value: Any) -> Any:
    return value.to("meta") if isinstance(value, torch.Tensor) else value


def _user_files(model: nn.Module) -> set[str]:
    """Source files of the model's module classes (torch.nn's own files excluded)."""
    torch_dir = os.path.dirname(torch.__file__)
    files: set[str] = set()
    for m in model.modules():
        for cls in type(m).__mro__:
            if cls in (nn.Module, object):
                continue
            try:
                f = inspect.getsourcefile(cls)
            except (TypeError, OSError):
                continue
            if f and not os.path.abspath(f).startswith(torch_dir):
                files.add(os.path.abspath(f))
    return files


def _exception_chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]


_USER_FRAME = re.compile(r'File "([^"]+)", line (\d+)')


def _failing_line(excs: Iterable[BaseException], files: set[str]) -> str | None:
    """``file:line: code`` of the innermost frame in the user's model files, if any: from the
    traceback, or from the frames an exception lists in its message (torch.export reports where
    in the user's code it stopped as ``File "...", line N`` under "from user code")."""
    for exc in excs:
        for e in _exception_chain(exc):
            frames = [(f.filename, f.lineno, f.line) for f in traceback.extract_tb(e.__traceback__)
                      if os.path.abspath(f.filename) in files]
            frames += [(m.group(1), int(m.group(2)), None)
                       for m in _USER_FRAME.finditer(str(e))
                       if os.path.abspath(m.group(1)) in files]
            if frames:
                name, lineno, code = frames[-1]
                code = code if code is not None else linecache.getline(name, lineno or 0)
                return f"{name}:{lineno}: {(code or '').strip()}"
    return None


def _short(exc: BaseException) -> str:
    lines = [ln for ln in str(exc).strip().splitlines() if ln.strip()]
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"


def _symbolic_trace(model: nn.Module, leaf_modules: Sequence[Any]) -> torch.fx.GraphModule:
    classes = tuple(x for x in leaf_modules if isinstance(x, type))
    names = frozenset(x for x in leaf_modules if isinstance(x, str))
    tracer = _LeafTracer(classes, names)
    graph = tracer.trace(model)
    name = model.__class__.__name__
    gm = torch.fx.GraphModule(tracer.root, graph, name)
    _match_module_order(gm, model)
    _canonical_get_attrs(gm)
    return gm


def _match_module_order(gm: nn.Module, model: nn.Module) -> None:
    """Order gm's submodules and parameters as the model declares them, not by first use.

    Why: GraphModule copies submodules in the order the graph first touches them (a ResNet
    block's downsample comes before conv1), so ``gm.parameters()`` would list the model's
    Parameters in another order, and an optimizer built from one would not load the other's
    state_dict by index.
    """
    if gm is model:
        return
    for attr in ("_modules", "_parameters", "_buffers"):
        mine = getattr(gm, attr)
        order = [k for k in getattr(model, attr) if k in mine]
        rest = [k for k in mine if k not in order]
        reordered = {k: mine[k] for k in order + rest}
        mine.clear()
        mine.update(reordered)
    for key, child in gm._modules.items():
        orig = model._modules.get(key)
        if child is not None and orig is not None:
            _match_module_order(child, orig)


@contextmanager
def _hf_training_config(model: nn.Module) -> Iterator[None]:
    """Turn off Hugging Face's KV cache while exporting.

    Why: with ``use_cache=True`` the output holds a ``DynamicCache`` / ``EncoderDecoderCache``
    object that torch.export cannot flatten (no pytree registration), and a KV cache is useless
    for training anyway. Every submodule's config is switched (T5's decoder stack holds its own
    copy of the config), and restored afterwards.
    """
    configs = {id(c): c for m in model.modules()
               if (c := getattr(m, "config", None)) is not None
               and getattr(c, "use_cache", False) is True}
    for cfg in configs.values():
        cfg.use_cache = False
    try:
        yield
    finally:
        for cfg in configs.values():
            cfg.use_cache = True


@contextmanager
def _quiet_export() -> Iterator[None]:
    """Silence torch.export's logs and partial-graph dumps; we report failures ourselves."""
    loggers = [logging.getLogger(n) for n in (
        "torch.fx.experimental.symbolic_shapes", "torch._export", "torch.export",
        "torch._dynamo", "torch.fx.experimental.recording")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        # export prints a failing trace's partial graph straight to sys.stderr
        with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, lv in zip(loggers, levels):
            lg.setLevel(lv)


def _export(model: nn.Module, inputs: tuple[Any, ...], kwargs: Mapping[str, Any],
            dims: BatchDims | None = None) -> torch.fx.GraphModule:
    """torch.export with the batch dimension left free where ``dims`` found one (so the stages
    take microbatches of any size); a model whose code pins it is exported as it stands."""
    dynamic = export_dynamic_shapes(model, inputs, kwargs, dims) if dims is not None else None
    with _quiet_export(), exported_in_train_mode(model):  # every dropout and its p in the graph
        try:
            ep = torch.export.export(model, inputs, dict(kwargs) or None, strict=False,
                                     dynamic_shapes=dynamic)
        except Exception:  # noqa: BLE001 - the batch cannot be symbolic: the static graph
            if dynamic is None:
                raise
            log.info("torch.export could not leave the batch dimension free; static shapes")
            ep = torch.export.export(model, inputs, dict(kwargs) or None, strict=False)
        gm = ep.module()
    _strip_checks(gm)
    _rebind_to_originals(gm, model)
    _match_module_order(gm, model)
    _canonical_get_attrs(gm)
    follow_modes(gm, model)  # dropout, attention dropout, BatchNorm follow train()/eval()
    return gm


def _canonical_get_attrs(gm: torch.fx.GraphModule) -> None:
    """Point every get_attr at the name ``gm.named_parameters()`` uses for that object.

    Why: export reads a tied weight through whichever alias it met last (GPT-2's embedding
    lookup reads ``lm_head.weight``) and leaves an unused get_attr for the other alias; later
    phases match get_attr targets against ``named_parameters()`` names, which keep the first
    alias only (``transformer.wte.weight``).
    """
    canonical: dict[int, str] = {}
    for name, t in list(gm.named_parameters()) + list(gm.named_buffers()):
        canonical.setdefault(id(t), name)
    for node in list(gm.graph.nodes):
        if node.op != "get_attr":
            continue
        if not node.users:
            gm.graph.erase_node(node)
            continue
        obj: Any = gm
        try:
            for part in str(node.target).split("."):
                obj = getattr(obj, part)
        except AttributeError:
            continue
        name = canonical.get(id(obj))
        if name is not None and name != node.target:
            node.target = name
    gm.graph.lint()
    gm.recompile()


def _strip_checks(gm: torch.fx.GraphModule) -> None:
    """Drop export's input guard (``_guards_fn``) and metadata assertions: no stage work."""
    graph = gm.graph
    for node in list(graph.nodes):
        if node.users:
            continue
        guard = node.op == "call_module" and node.target == "_guards_fn"
        check = node.op == "call_function" and \
            getattr(node.target, "overloadpacket", node.target) in _CHECK_TARGETS
        if guard or check:
            graph.erase_node(node)
    if hasattr(gm, "_guards_fn"):
        try:
            gm.delete_submodule("_guards_fn")
        except AttributeError:
            pass
    graph.lint()
    gm.recompile()


def _rebind_to_originals(gm: torch.fx.GraphModule, model: nn.Module) -> None:
    """Make every parameter/buffer of ``gm`` the very object the user's model holds.

    ``ExportedProgram.module()`` currently shares them already; we re-bind by name anyway so
    a torch version that copies cannot break optimizers, state_dicts or tied weights.
    """
    for kind, named in (("_parameters", model.named_parameters(remove_duplicate=False)),
                        ("_buffers", model.named_buffers(remove_duplicate=False))):
        for qualname, orig in named:
            owner_name, _, attr = qualname.rpartition(".")
            try:
                owner = gm.get_submodule(owner_name) if owner_name else gm
            except AttributeError:
                continue
            table = getattr(owner, kind)
            if attr in table and table[attr] is not orig:
                table[attr] = orig


def _trace_failure(model: nn.Module, errors: list[tuple[str, BaseException]]) -> TracingError:
    """One error for every tracer that failed, each with the line where IT stopped: the two
    stop in different places (symbolic_trace at the first data-dependent branch, export
    further on), and the line of the last one tried is where a fix is still needed."""
    files = _user_files(model)
    wheres = [(name, _failing_line([e], files)) for name, e in errors]
    found = [(name, w) for name, w in wheres if w]
    details = "; ".join(f"{name}: {_short(e)}" for name, e in errors)
    head = f"could not trace {type(model).__name__}"
    if len({w for _, w in found}) == 1:
        head += f" at {found[0][1]}"
    elif found:
        head += " (" + "; ".join(f"{name} stopped at {w}" for name, w in found) + ")"
    return TracingError(
        f"{head} ({details})",
        hint="mark the offending submodule a leaf via leaf_modules=[...], or replace "
             "data-dependent Python control flow with torch.where / torch.cond",
    )


def _assert_same_parameters(gm: torch.fx.GraphModule, model: nn.Module, method: str) -> None:
    mine = dict(model.named_parameters())
    for name, p in gm.named_parameters():
        if mine.get(name) is not p:
            raise TracingError(
                f"{method} produced parameter {name!r} that is not the model's own Parameter",
                hint="report this as an fxpipe bug; try method='symbolic_trace' or 'export'",
            )


def split_inputs(example_inputs: Any,
                 example_kwargs: Mapping[str, Any] | None = None) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``(args, kwargs)`` from what a user passes: a tuple/list of positional inputs, a dict of
    keyword inputs (what a Hugging Face collator yields), or one value; plus ``example_kwargs``."""
    kwargs = dict(example_kwargs or {})
    if isinstance(example_inputs, Mapping):
        overlap = sorted(set(example_inputs) & set(kwargs))
        if overlap:
            raise ConfigError(f"keyword inputs {overlap} given twice",
                              hint="pass each input once, in example_inputs or example_kwargs")
        return (), {**dict(example_inputs), **kwargs}
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs), kwargs
    if example_inputs is None:
        return (), kwargs
    return (example_inputs,), kwargs


def trace(model: nn.Module, example_inputs: Any = (), *, example_kwargs: Mapping[str, Any] | None = None,
          leaf_modules: Sequence[Any] = (), method: str = "auto") -> TracedGraph:
    """Trace ``model`` on example inputs into a trainable GraphModule with shape metadata.

    ``example_inputs``: a tuple of positional arguments, a dict of keyword arguments, or a single
    tensor; ``example_kwargs``: more keyword arguments (``labels=...``).
    ``leaf_modules``: module classes or qualified submodule names kept as single call_module
    nodes (symbolic_trace only; export always inlines).
    ``method``: "auto" (symbolic_trace, then export), "symbolic_trace" or "export".

    A model on the meta device is traced with torch.export on meta inputs (its example inputs
    are moved there): enough to estimate costs and plan a model that does not fit in memory.
    """
    if method not in ("auto", "symbolic_trace", "export"):
        raise ConfigError(f"unknown tracing method {method!r}",
                          hint="use one of 'auto', 'symbolic_trace', 'export'")
    if not isinstance(model, nn.Module):
        raise ConfigError(f"trace() needs an nn.Module, got {type(model).__name__}",
                          hint="pass the model object itself")
    inputs, kwargs = split_inputs(example_inputs, example_kwargs)
    for x in leaf_modules:
        if not isinstance(x, (str, type)):
            raise ConfigError(f"leaf_modules entry {x!r} is neither a class nor a name",
                              hint="pass module classes (nn.LSTM) or qualified names ('enc.rnn')")
    meta = on_meta(model)
    if meta:
        # no values: data-dependent Python (HF mask checks) cannot run eagerly, and symbolic
        # tracing would need a run for shapes; export on meta inputs needs neither
        inputs = tuple(_to_meta(x) for x in inputs)
        kwargs = {k: _to_meta(v) for k, v in kwargs.items()}
        if method == "symbolic_trace":
            raise ConfigError("a model on the meta device can only be traced with torch.export",
                              hint="use tracer='export' (or 'auto')")
    else:
        _check_eager(model, inputs, kwargs)
    with _hf_training_config(model):
        dims = (infer_batch_dims(lambda a, k: model(*a, **k), inputs, kwargs, module=model)
                if not meta else BatchDims(note="a model on the meta device has no values"))

    errors: list[tuple[str, BaseException]] = []
    gm: torch.fx.GraphModule | None = None
    used: Method = "symbolic_trace"
    flat: tuple[Any, ...] = ()
    if method in ("auto", "symbolic_trace") and not meta:
        try:
            gm = _symbolic_trace(model, leaf_modules)
            flat = _flat_inputs(gm, inputs, kwargs)
            propagate_shapes(gm, flat)  # a trace can "succeed" yet not run (e.g. len(proxy))
        except Exception as exc:  # noqa: BLE001
            gm = None
            errors.append(("symbolic_trace", exc))
    if gm is None and method in ("auto", "export"):
        used = "export"
        try:
            with _hf_training_config(model):
                gm = _export(model, inputs, kwargs, dims)
            flat = _flat_inputs(gm, inputs, kwargs)
            propagate_shapes(gm, flat)
        except Exception as exc:  # noqa: BLE001
            gm = None
            errors.append(("export", exc))
    if gm is None:
        raise _trace_failure(model, errors) from None
    _assert_same_parameters(gm, model, used)
    names = tuple(n.name for n in gm.graph.nodes if n.op == "placeholder")
    log.info("traced %s with %s: %d nodes", type(model).__name__, used, len(gm.graph.nodes))
    record_batch_dims(gm, inputs, kwargs, flat, dims)
    return TracedGraph(gm=gm, method=used, input_names=names,
                       io=ModelIO.from_graph_module(gm), flat_inputs=flat, batch_dims=dims)


def _flat_inputs(gm: torch.fx.GraphModule, inputs: tuple[Any, ...],
                 kwargs: Mapping[str, Any]) -> tuple[Any, ...]:
    """The example inputs bound to ``gm``'s placeholders, in order (defaults filled in)."""
    bound = ModelIO.from_graph_module(gm).bind_inputs(inputs, kwargs)
    return tuple(bound.values())
