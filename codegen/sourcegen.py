"""Generate the readable Python source of one stage (used by :mod:`.export`).

Pickle-free, unlike ``GraphModule.to_folder``: submodules rebuilt from checked constructor calls,
``get_attr`` tensors as placeholders filled from ``stage_<k>.pt``, tied parameters tied again.
"""
from __future__ import annotations

import textwrap
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch.fx.graph_module import _format_import_block
from torch.package import sys_importer

from fxpipe.errors import ConfigError
from fxpipe.tracing.leaves import constructor_expr

from .split import MODEL, StageSpec


@dataclass
class TensorInventory:
    """A stage's tensors, deduplicated: the first name of a shared tensor is canonical."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    parameters: set[str] = field(default_factory=set)
    buffers: set[str] = field(default_factory=set)
    frozen: set[str] = field(default_factory=set)
    aliases: dict[str, str] = field(default_factory=dict)


def tensor_inventory(gm: torch.nn.Module) -> TensorInventory:
    """Collect parameters and buffers under their qualified names, recording ties as aliases."""
    inv = TensorInventory()
    seen: dict[int, str] = {}
    named = [(n, t, True) for n, t in gm.named_parameters(remove_duplicate=False)]
    named += [(n, t, False) for n, t in gm.named_buffers(remove_duplicate=False)]
    for name, t, is_param in named:
        if id(t) in seen:
            inv.aliases[name] = seen[id(t)]
            continue
        seen[id(t)] = name
        inv.tensors[name] = t.detach()
        (inv.parameters if is_param else inv.buffers).add(name)
        if is_param and not t.requires_grad:
            inv.frozen.add(name)
    return inv


def _owner_expr(path: str) -> str:
    """Python expression for the module at ``path`` (``self`` for the root)."""
    if not path:
        return "self"
    if all(p.isidentifier() for p in path.split(".")):
        return f"self.{path}"
    return f"self.get_submodule({path!r})"


def _ctor(module: torch.nn.Module, target: str) -> str:
    """``torch.nn.X(...)`` rebuilding ``module`` (its repr), verified by evaluating it; a module
    of fxpipe's own (tracing.modes) says how to build itself (``fxpipe_source()``)."""
    own = getattr(module, "fxpipe_source", None)
    if callable(own) and type(module).__module__.startswith("fxpipe."):
        return str(own())
    expr, why = constructor_expr(module)
    if expr is None:
        raise ConfigError(f"cannot export submodule {target!r} ({type(module).__qualname__}) as "
                          f"code: {why}",
                          hint="it was kept as one node because leaf_modules names it: drop it "
                               "from leaf_modules so its operations are traced into the graph")
    return expr


def _init_lines(gm: fx.GraphModule, inv: TensorInventory) -> list[str]:
    lines: list[str] = []
    created: set[str] = {""}
    covered: list[str] = []  # modules built by a constructor: their tensors come with them

    def ensure(path: str) -> None:
        parts = path.split(".") if path else []
        for i in range(len(parts)):
            sub = ".".join(parts[: i + 1])
            if sub not in created:
                parent = ".".join(parts[:i])
                lines.append(f"{_owner_expr(parent)}.add_module({parts[i]!r}, torch.nn.Module())")
                created.add(sub)

    for node in gm.graph.nodes:
        if node.op != "call_module" or node.target in created:
            continue
        target = str(node.target)
        parent, _, name = target.rpartition(".")
        ensure(parent)
        lines.append(f"{_owner_expr(parent)}.add_module({name!r}, "
                     f"{_ctor(gm.get_submodule(target), target)})")
        created.add(target)
        covered.append(target + ".")
    for node in gm.graph.nodes:
        target = str(node.target)
        if node.op != "get_attr" or target in created or any(target.startswith(c) for c in covered):
            continue
        created.add(target)
        parent, _, name = target.rpartition(".")
        owner = gm.get_submodule(parent)
        value = getattr(owner, name)
        if not isinstance(value, torch.Tensor):
            raise ConfigError(f"cannot export get_attr {target!r} of type {type(value).__name__}",
                              hint="only tensors, parameters and torch.nn modules are exported")
        ensure(parent)
        empty = f"torch.empty({list(value.shape)}, dtype={value.dtype})"
        if isinstance(value, torch.nn.Parameter):
            lines.append(f"{_owner_expr(parent)}.register_parameter({name!r}, torch.nn.Parameter("
                         f"{empty}, requires_grad={value.requires_grad}))")
        else:
            lines.append(f"{_owner_expr(parent)}.register_buffer({name!r}, {empty})")
    for alias, canon in sorted(inv.aliases.items()):
        parent, _, name = alias.rpartition(".")
        getter = "get_parameter" if canon in inv.parameters else "get_buffer"
        lines.append(f"setattr({_owner_expr(parent)}, {name!r}, self.{getter}({canon!r}))"
                     "  # tied")
    return lines or ["pass"]


def _where(sources: int) -> str:
    return "model input" if sources == MODEL else f"from stage {sources}"


def _to(consumers: tuple[int, ...]) -> str:
    parts = [f"stage {c}" for c in consumers if c != MODEL]
    parts += ["the model output"] if MODEL in consumers else []
    return "to " + " and ".join(parts) if parts else "unused"


def module_source(st: StageSpec, num_stages: int, weights_file: str, inv: TensorInventory) -> str:
    """The full text of ``stage_<k>.py``."""
    gm = st.gm
    width = max([len(n) for n in st.inputs + st.outputs] + [4])
    doc = [f"Stage {st.index} of {num_stages}, generated by fxpipe.codegen.export_stages.",
           "", f"forward({', '.join(st.inputs)}) -> ({', '.join(st.outputs)}{',' if len(st.outputs) == 1 else ''})",
           "", "Inputs:"]
    doc += [f"    {n:<{width}}  {_where(s)}" for n, s in zip(st.inputs, st.sources)] or ["    (none)"]
    doc += ["Outputs:"]
    doc += [f"    {n:<{width}}  {_to(c)}" for n, c in zip(st.outputs, st.consumers)] or ["    (none)"]
    doc += ["", f"Weights: {weights_file} ({len(inv.parameters)} parameters, {len(inv.buffers)} "
            "buffers, under the model's own names; torch.load(weights_only=True)):"]
    doc += [f"    {n}  {tuple(inv.tensors[n].shape)}" for n in sorted(inv.tensors)]
    doc += [f"    {a} is tied to {c}" for a, c in sorted(inv.aliases.items())]
    code = gm.graph.python_code(root_module="self")
    imports = _format_import_block(code.globals, sys_importer)
    init = textwrap.indent("\n".join(_init_lines(gm, inv)), " " * 8)
    forward = textwrap.indent(code.src.strip("\n"), " " * 4)
    return (f'"""{chr(10).join(doc)}\n"""\nimport torch\n{imports}\n\n\n'
            f"class Stage{st.index}(torch.nn.Module):\n"
            f'    """Pipeline stage {st.index}: build, load {weights_file}, call forward."""\n\n'
            f"    def __init__(self) -> None:\n        super().__init__()\n{init}\n\n"
            f"{forward}\n")
