"""How the whole model's inputs map onto placeholders and how its output is rebuilt.

Splitting a graph loses the ``forward`` signature and the output structure (tuple, dict, a Hugging
Face ``ModelOutput``); :class:`ModelIO` keeps both, JSON-serialisable, so ``run_stages`` and stages
loaded in a fresh process return what the original ``GraphModule`` returns.
"""
from __future__ import annotations

import importlib
import json
import logging
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.fx._pytree import tree_flatten_spec
from torch.fx.graph import _PyTreeCodeGen

from fxpipe.errors import InputMismatchError, PlanFormatError

log = logging.getLogger(__name__)

_NO_DEFAULT = object()


@dataclass(frozen=True)
class ValueRef:
    """A leaf of the output template: "the value named ``name``" (a node of the original graph)."""

    name: str


@dataclass(frozen=True)
class ModelIO:
    """The model's calling convention, detached from any stage.

    ``output_template`` mirrors the original output node's argument with every node replaced by a
    :class:`ValueRef` (lists/tuples/dicts made plain). ``in_spec``/``out_spec`` are the pytree specs
    of a ``torch.export`` module (None for symbolically traced graphs). ``fixed_shapes``: the
    tensor inputs' shapes a torch.export graph was specialised to (it bakes sizes into views and
    masks), checked by :meth:`bind_inputs`; empty for symbolically traced graphs.
    """

    input_names: tuple[str, ...]
    arg_names: tuple[str, ...]
    defaults: tuple[tuple[str, Any], ...]
    output_template: Any
    in_spec: pytree.TreeSpec | None = None
    out_spec: pytree.TreeSpec | None = None
    fixed_shapes: tuple[tuple[str, tuple[int | None, ...]], ...] = ()

    @staticmethod
    def from_graph_module(gm: fx.GraphModule) -> "ModelIO":
        """Capture the calling convention of ``gm`` (symbolic_trace or torch.export module)."""
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        defaults = tuple((n.name, n.args[0]) for n in placeholders if n.args)
        outputs = [n for n in gm.graph.nodes if n.op == "output"]
        template = _to_template(outputs[0].args[0]) if outputs else None
        codegen = gm.graph._codegen
        in_spec = out_spec = None
        fixed: tuple[tuple[str, tuple[int | None, ...]], ...] = ()
        if isinstance(codegen, _PyTreeCodeGen) and codegen.pytree_info is not None:
            in_spec = codegen.pytree_info.in_spec
            out_spec = codegen.pytree_info.out_spec
            # a dimension export kept symbolic (the batch, see tracing.batchdims) is free: None
            fixed = tuple((n.name, tuple(d if isinstance(d, int) else None
                                         for d in n.meta["val"].shape))
                          for n in placeholders if isinstance(n.meta.get("val"), torch.Tensor))
        return ModelIO(input_names=tuple(n.name for n in placeholders),
                       arg_names=tuple(str(n.target) for n in placeholders),
                       defaults=defaults, output_template=template,
                       in_spec=in_spec, out_spec=out_spec, fixed_shapes=fixed)

    def bind_inputs(self, args: Sequence[Any], kwargs: Mapping[str, Any] | None = None
                    ) -> dict[str, Any]:
        """Map the user's ``(args, kwargs)`` onto placeholder names, like the original forward."""
        kwargs = dict(kwargs or {})
        if self.in_spec is not None:
            flat = self._flatten_with_spec(list(args), kwargs)
        else:
            flat = self._bind_positional(list(args), kwargs)
        if len(flat) != len(self.input_names):
            raise InputMismatchError(
                f"the model takes {len(self.input_names)} inputs {list(self.input_names)}, "
                f"got {len(flat)}", hint="pass the same arguments as to the original model")
        bound = dict(zip(self.input_names, flat))
        for name, shape in self.fixed_shapes:
            value = bound[name]
            if isinstance(value, torch.Tensor) and not _fits(tuple(value.shape), shape):
                free = [d for d, n in enumerate(shape) if n is None]
                traced = tuple("*" if n is None else n for n in shape)
                who = (f"fxpipe exported it with dimension(s) {free} free (the batch) and the "
                       "others fixed, so the other dimensions of your batch differ from the "
                       "example's" if free else
                       "fxpipe could not leave its batch dimension free (no dimension of the "
                       "example splits, or torch.export specialised it), so every dimension "
                       "is fixed")
                raise InputMismatchError(
                    f"input {name!r} has shape {tuple(value.shape)}, but the model was traced with "
                    f"torch.export for shape {traced}: {who}",
                    hint="feed batches whose non-batch dimensions match the example (pad "
                         "sequences to a fixed length), or compile with example inputs of the "
                         "shape you train on" + ("" if free else " (at least 2 samples)"))
        return bound

    @property
    def _spec_has_kwargs(self) -> bool:
        """The exported signature is ``(args, kwargs)`` (else positional arguments only)."""
        spec = self.in_spec
        return (spec is not None and spec.type is tuple and spec.num_children == 2
                and spec.child(0).type is tuple and spec.child(1).type is dict)

    def call_args(self, flat: Sequence[Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The graph module's call arguments for its placeholders' values ``flat`` (the inverse
        of :meth:`bind_inputs`' flattening): an exported module takes them as the model did
        (``input_ids=..., labels=...``), a symbolic trace positionally."""
        if self.in_spec is None:
            return tuple(flat), {}
        tree = pytree.tree_unflatten(list(flat), self.in_spec)
        if self._spec_has_kwargs:
            return tuple(tree[0]), dict(tree[1])
        return tuple(tree), {}

    def _flatten_with_spec(self, args: list[Any], kwargs: dict[str, Any]) -> list[Any]:
        spec = self.in_spec
        assert spec is not None
        try:
            if self._spec_has_kwargs:
                return list(tree_flatten_spec((args, kwargs), spec))
            if kwargs:
                raise InputMismatchError(f"unexpected keyword arguments {sorted(kwargs)}")
            return list(tree_flatten_spec(args, spec))
        except (RuntimeError, KeyError, IndexError, TypeError, AssertionError) as exc:
            raise InputMismatchError(f"inputs do not match the exported signature {spec}: {exc}",
                                     hint="pass the same arguments as at export time") from exc

    def _bind_positional(self, args: list[Any], kwargs: dict[str, Any]) -> list[Any]:
        defaults = dict(self.defaults)
        flat: list[Any] = []
        for i, (name, arg) in enumerate(zip(self.input_names, self.arg_names)):
            if i < len(args):
                flat.append(args[i])
            elif arg in kwargs:
                flat.append(kwargs.pop(arg))
            elif name in defaults:
                flat.append(defaults[name])
            else:
                raise InputMismatchError(f"missing model input {arg!r}",
                                         hint=f"the model takes {list(self.arg_names)}")
        if len(args) > len(self.input_names) or kwargs:
            raise InputMismatchError(
                f"too many inputs: {len(args)} positional, extra keywords {sorted(kwargs)}",
                hint=f"the model takes {list(self.arg_names)}")
        return flat

    def build_output(self, values: Mapping[str, Any]) -> Any:
        """Rebuild the model's output from the computed values (by name)."""
        out = _fill(self.output_template, values)
        if self.out_spec is not None:
            if not isinstance(out, (list, tuple)):
                out = [out]
            out = pytree.tree_unflatten(list(out), self.out_spec)
        return out

    def output_names(self) -> list[str]:
        """Names of the values the model output refers to, in order, without duplicates."""
        names: list[str] = []
        _collect_refs(self.output_template, names)
        return list(dict.fromkeys(names))

    # ------------------------------------------------------------------ JSON
    def to_json(self) -> dict[str, Any]:
        """A JSON-able description (pytree specs via ``treespec_dumps``)."""
        return {"input_names": list(self.input_names), "arg_names": list(self.arg_names),
                "defaults": [[k, _encode(v)] for k, v in self.defaults],
                "output_template": _encode(self.output_template),
                "in_spec": _dump_spec(self.in_spec, "in_spec"),
                "out_spec": _dump_spec(self.out_spec, "out_spec"),
                "fixed_shapes": [[n, list(shape)] for n, shape in self.fixed_shapes]}

    @staticmethod
    def from_json(data: Mapping[str, Any], path: str) -> "ModelIO":
        """Inverse of :meth:`to_json`; malformed data raises PlanFormatError naming ``path``."""
        try:
            return ModelIO(
                input_names=tuple(str(x) for x in data["input_names"]),
                arg_names=tuple(str(x) for x in data["arg_names"]),
                defaults=tuple((str(k), _decode(v, path)) for k, v in data["defaults"]),
                output_template=_decode(data["output_template"], path),
                in_spec=_load_spec(data["in_spec"]), out_spec=_load_spec(data["out_spec"]),
                fixed_shapes=tuple((str(n), tuple(None if d is None else int(d) for d in shape))
                                   for n, shape in data.get("fixed_shapes", [])))
        except PlanFormatError:
            raise
        except Exception as exc:  # noqa: BLE001 - any malformation becomes one clear error
            raise PlanFormatError(f"{path}: malformed model I/O description: {exc!r}",
                                  hint="re-export the stages") from exc


def _to_template(a: Any) -> Any:
    """Replace nodes by ValueRef and fx's immutable containers by plain ones."""
    if isinstance(a, fx.Node):
        return ValueRef(a.name)
    if isinstance(a, tuple) and hasattr(a, "_fields"):
        return type(a)(*(_to_template(x) for x in a))
    if isinstance(a, tuple):
        return tuple(_to_template(x) for x in a)
    if isinstance(a, list):
        return [_to_template(x) for x in a]
    if isinstance(a, dict):
        return {k: _to_template(v) for k, v in a.items()}
    return a


def _fill(t: Any, values: Mapping[str, Any]) -> Any:
    if isinstance(t, ValueRef):
        return values[t.name]
    if isinstance(t, tuple) and hasattr(t, "_fields"):
        return type(t)(*(_fill(x, values) for x in t))
    if isinstance(t, tuple):
        return tuple(_fill(x, values) for x in t)
    if isinstance(t, list):
        return [_fill(x, values) for x in t]
    if isinstance(t, dict):
        return {k: _fill(v, values) for k, v in t.items()}
    return t


def _collect_refs(t: Any, out: list[str]) -> None:
    if isinstance(t, ValueRef):
        out.append(t.name)
    elif isinstance(t, (tuple, list)):
        for x in t:
            _collect_refs(x, out)
    elif isinstance(t, dict):
        for x in t.values():
            _collect_refs(x, out)


def _dump_spec(spec: pytree.TreeSpec | None, what: str) -> str | None:
    if spec is None:
        return None
    try:
        return pytree.treespec_dumps(spec)
    except Exception as exc:  # noqa: BLE001 - an unregistered type: degrade, do not fail
        log.warning("cannot serialise the model's %s (%s); loaded stages return flat outputs",
                    what, exc)
        return None


def _load_spec(text: str | None) -> pytree.TreeSpec | None:
    """``treespec_loads``, importing the modules of the spec's types first (a fresh process has
    not imported e.g. ``transformers.modeling_outputs``, whose import registers ModelOutputs)."""
    if text is None:
        return None
    try:
        return pytree.treespec_loads(text)
    except Exception:  # noqa: BLE001 - retry once after importing the types' modules
        types: list[str] = []
        _collect_types(json.loads(text), types)
        for name in types:
            mod = name.rpartition(".")[0]
            if mod and mod != "builtins":
                try:
                    importlib.import_module(mod)
                except ImportError:
                    log.warning("cannot import %s, needed by an output spec", mod)
        return pytree.treespec_loads(text)


def _collect_types(obj: Any, out: list[str]) -> None:
    if isinstance(obj, dict):
        if isinstance(obj.get("type"), str):
            out.append(obj["type"])
        for v in obj.values():
            _collect_types(v, out)
    elif isinstance(obj, list):
        for v in obj:
            _collect_types(v, out)


def _encode(v: Any) -> Any:
    """JSON encoding of a template/constant; containers are tagged to survive the round trip."""
    if isinstance(v, ValueRef):
        return {"ref": v.name}
    if v is None or isinstance(v, (bool, int, float, str)):
        return {"const": v}
    if isinstance(v, tuple) and hasattr(v, "_fields"):
        cls = type(v)
        return {"namedtuple": f"{cls.__module__}:{cls.__qualname__}",
                "items": [_encode(x) for x in v]}
    if isinstance(v, tuple):
        return {"tuple": [_encode(x) for x in v]}
    if isinstance(v, list):
        return {"list": [_encode(x) for x in v]}
    if isinstance(v, dict):
        return {"dict": [[_encode(k), _encode(x)] for k, x in v.items()]}
    if isinstance(v, torch.dtype):
        return {"dtype": str(v).removeprefix("torch.")}
    if isinstance(v, torch.device):
        return {"device": str(v)}
    raise PlanFormatError(f"cannot write the constant {v!r} ({type(v).__name__}) of the model "
                          "output to JSON", hint="return tensors or plain Python values")


def _decode(d: Any, path: str) -> Any:
    if not isinstance(d, dict) or len(d) not in (1, 2):
        raise PlanFormatError(f"{path}: bad encoded value {d!r}", hint="re-export the stages")
    if "ref" in d:
        return ValueRef(str(d["ref"]))
    if "const" in d:
        return d["const"]
    if "tuple" in d:
        return tuple(_decode(x, path) for x in d["tuple"])
    if "list" in d:
        return [_decode(x, path) for x in d["list"]]
    if "dict" in d:
        return {_decode(k, path): _decode(x, path) for k, x in d["dict"]}
    if "dtype" in d:
        return getattr(torch, d["dtype"])
    if "device" in d:
        return torch.device(d["device"])
    if "namedtuple" in d:
        items = [_decode(x, path) for x in d["items"]]
        mod, _, qual = str(d["namedtuple"]).partition(":")
        try:
            cls: Any = importlib.import_module(mod)
            for part in qual.split("."):
                cls = getattr(cls, part)
            return cls(*items)
        except (ImportError, AttributeError) as exc:
            log.warning("%s: cannot import %s (%s); using a plain tuple", path, d["namedtuple"], exc)
            return tuple(items)
    raise PlanFormatError(f"{path}: unknown encoded value {d!r}", hint="re-export the stages")


def _fits(shape: tuple[int, ...], traced: tuple[int | None, ...]) -> bool:
    """``shape`` matches ``traced`` (None: any size)."""
    return len(shape) == len(traced) and all(t is None or t == n for n, t in zip(shape, traced))
