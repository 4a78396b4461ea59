"""Write stages as readable Python plus weights, and load them back in a fresh process.

Per stage ``stage_<k>.py`` and its tensors ``stage_<k>.pt``, with ``stages.json`` (routing, ties,
I/O) and ``plan.json``, written atomically: code, not pickles, so users can audit what runs.
"""
from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
import torch.fx as fx

from fxpipe.errors import ConfigError, PlanFormatError

from fxpipe.tracing.modelio import ModelIO
from .sourcegen import module_source, tensor_inventory
from .split import StageSpec, model_io

log = logging.getLogger(__name__)

MANIFEST = "stages.json"
PLAN = "plan.json"
FORMAT = "fxpipe-stages"
VERSION = 1


def _stage_files(k: int) -> tuple[str, str]:
    return f"stage_{k}.py", f"stage_{k}.pt"


def export_stages(stages: Sequence[StageSpec], directory: str | os.PathLike[str],
                  plan_json: Mapping[str, Any] | None = None) -> Path:
    """Write ``stages`` (and ``plan_json``) to ``directory``; return its path.

    An existing directory is updated in place: files of a previous fxpipe export are replaced,
    stale stage files it listed are removed, and any other file is left alone. Refuses to
    overwrite a ``stage_*``/``stages.json``/``plan.json`` file that no fxpipe manifest owns.
    """
    io = model_io(stages, "export_stages")
    directory = Path(directory)
    manifest: dict[str, Any] = {"format": FORMAT, "version": VERSION, "num_stages": len(stages),
                                "model_io": io.to_json(), "stages": []}
    files: dict[str, bytes | str] = {}
    weights: dict[str, dict[str, torch.Tensor]] = {}
    for st in stages:
        py_name, pt_name = _stage_files(st.index)
        inv = tensor_inventory(st.gm)
        files[py_name] = module_source(st, len(stages), pt_name, inv)
        weights[pt_name] = inv.tensors
        manifest["stages"].append({
            "index": st.index, "module": py_name, "class": f"Stage{st.index}",
            "weights": pt_name, "inputs": list(st.inputs), "sources": list(st.sources),
            "outputs": list(st.outputs), "consumers": [list(c) for c in st.consumers],
            "parameters": sorted(inv.parameters), "buffers": sorted(inv.buffers),
            "frozen": sorted(inv.frozen), "aliases": dict(sorted(inv.aliases.items())),
            "training": bool(st.gm.training)})
    if plan_json is not None:
        files[PLAN] = json.dumps(plan_json, indent=2, sort_keys=True)
    files[MANIFEST] = json.dumps(manifest, indent=2)  # last: it commits the export

    new_names = set(files) | set(weights)
    old_names = _previous_export_files(directory, new_names)
    directory.parent.mkdir(parents=True, exist_ok=True)
    fresh = not directory.exists()
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.fxpipe-tmp-",
                                dir=directory.parent if fresh else directory))
    try:
        for name, tensors in weights.items():
            torch.save(tensors, tmp / name)
        for name, text in files.items():
            (tmp / name).write_text(text) if isinstance(text, str) else (tmp / name).write_bytes(text)
        if fresh:
            os.rename(tmp, directory)
        else:
            order = [n for n in files if n != MANIFEST] + list(weights) + [MANIFEST]
            for name in order:
                os.replace(tmp / name, directory / name)
            for name in sorted(old_names - new_names):
                (directory / name).unlink(missing_ok=True)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    log.info("exported %d stages to %s", len(stages), directory)
    return directory


def _previous_export_files(directory: Path, new_names: set[str]) -> set[str]:
    """Files the existing export in ``directory`` owns; refuse to clobber unowned ones."""
    if not directory.exists():
        return set()
    if not directory.is_dir():
        raise ConfigError(f"{directory} exists and is not a directory",
                          hint="choose another export directory")
    owned: set[str] = set()
    manifest = directory / MANIFEST
    if manifest.exists():
        try:
            old = json.loads(manifest.read_text())
            if old.get("format") != FORMAT:
                raise ValueError("not an fxpipe manifest")
            owned = {MANIFEST, PLAN} | {f for s in old["stages"] for f in (s["module"], s["weights"])}
        except (ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"{manifest} exists but is not an fxpipe stages manifest ({exc})",
                              hint="export to an empty or new directory") from exc
    clash = sorted(n for n in new_names if (directory / n).exists() and n not in owned)
    if clash:
        raise ConfigError(f"refusing to overwrite files fxpipe did not write in {directory}: {clash}",
                          hint="export to an empty or new directory")
    return {n for n in owned if "/" not in n and not n.startswith(".")}


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError as exc:
        raise PlanFormatError(f"{path}: missing", hint="export the stages first") from exc
    except (OSError, ValueError) as exc:
        raise PlanFormatError(f"{path}: not valid JSON ({exc})", hint="re-export the stages") from exc


def load_exported(directory: str | os.PathLike[str]) -> tuple[dict[str, Any] | None, list[StageSpec]]:
    """Load an export directory into runnable stages (``run_stages`` works on them).

    Returns ``(plan_json or None, stages)``. Any missing or malformed file raises PlanFormatError
    naming the file.
    """
    directory = Path(directory)
    mpath = directory / MANIFEST
    manifest = _read_json(mpath)
    plan = _read_json(directory / PLAN) if (directory / PLAN).exists() else None
    try:
        if manifest["format"] != FORMAT or manifest["version"] != VERSION:
            raise ValueError(f"format {manifest['format']!r} version {manifest['version']!r}")
        entries = list(manifest["stages"])
        io = ModelIO.from_json(manifest["model_io"], str(mpath))
        if [e["index"] for e in entries] != list(range(len(entries))) or not entries:
            raise ValueError("stage indices are not 0..S-1")
    except PlanFormatError:
        raise
    except (KeyError, TypeError, ValueError) as exc:
        raise PlanFormatError(f"{mpath}: malformed manifest ({exc!r})",
                              hint="re-export the stages") from exc
    stages = [_load_stage(directory, e, io, str(mpath)) for e in entries]
    return plan, stages


def _load_stage(directory: Path, entry: Mapping[str, Any], io: ModelIO, mpath: str) -> StageSpec:
    try:
        k = int(entry["index"])
        py_path = directory / str(entry["module"])
        pt_path = directory / str(entry["weights"])
        cls_name = str(entry["class"])
        inputs = tuple(str(x) for x in entry["inputs"])
        sources = tuple(int(x) for x in entry["sources"])
        outputs = tuple(str(x) for x in entry["outputs"])
        consumers = tuple(tuple(int(c) for c in cs) for cs in entry["consumers"])
        params, buffers = list(entry["parameters"]), list(entry["buffers"])
        frozen, aliases = set(entry["frozen"]), dict(entry["aliases"])
        training = bool(entry["training"])
        if len(sources) != len(inputs) or len(consumers) != len(outputs):
            raise ValueError("inputs/sources or outputs/consumers lengths differ")
    except (KeyError, TypeError, ValueError) as exc:
        raise PlanFormatError(f"{mpath}: malformed stage entry ({exc!r})",
                              hint="re-export the stages") from exc
    module = _instantiate(py_path, cls_name, k)
    try:
        tensors = torch.load(pt_path, weights_only=True, map_location="cpu")
    except FileNotFoundError as exc:
        raise PlanFormatError(f"{pt_path}: missing", hint="re-export the stages") from exc
    except Exception as exc:  # noqa: BLE001 - corrupt archive, unpickling refusal, ...
        raise PlanFormatError(f"{pt_path}: cannot load weights ({exc})",
                              hint="re-export the stages") from exc
    _install_tensors(module, tensors, params, buffers, frozen, aliases, pt_path)
    module.train(training)
    try:
        gm = fx.symbolic_trace(module)
    except Exception as exc:  # noqa: BLE001 - generated code that does not trace is malformed
        raise PlanFormatError(f"{py_path}: the stage code does not trace ({exc})",
                              hint="re-export the stages") from exc
    gm.train(training)
    return StageSpec(index=k, gm=gm, inputs=inputs, sources=sources, outputs=outputs,
                     consumers=consumers, io=io)


def _instantiate(py_path: Path, cls_name: str, k: int) -> torch.nn.Module:
    if not py_path.is_file():
        raise PlanFormatError(f"{py_path}: missing", hint="re-export the stages")
    mod_name = f"_fxpipe_stage_{abs(hash(str(py_path.resolve())))}_{k}"
    try:
        spec = importlib.util.spec_from_file_location(mod_name, py_path)
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return getattr(mod, cls_name)()
    except Exception as exc:  # noqa: BLE001 - syntax errors, missing class, bad ctor args
        raise PlanFormatError(f"{py_path}: cannot build {cls_name} ({exc!r})",
                              hint="re-export the stages") from exc


def _install_tensors(module: torch.nn.Module, tensors: Any, params: list[str],
                     buffers: list[str], frozen: set[str], aliases: Mapping[str, str],
                     pt_path: Path) -> None:
    """Put the saved tensors in place (assign, not copy: dtype/shape come from the file)."""
    if not isinstance(tensors, dict) or set(tensors) != set(params) | set(buffers):
        got = sorted(tensors) if isinstance(tensors, dict) else type(tensors).__name__
        raise PlanFormatError(f"{pt_path}: holds {got}, expected {sorted(params + buffers)}",
                              hint="re-export the stages")
    try:
        for name in params + buffers:
            owner_path, _, attr = name.rpartition(".")
            owner = module.get_submodule(owner_path)
            t = tensors[name]
            if name in params:
                owner._parameters[attr] = torch.nn.Parameter(t, requires_grad=name not in frozen)
            else:
                owner._buffers[attr] = t
        for alias, canon in aliases.items():
            owner_path, _, attr = alias.rpartition(".")
            target = module.get_parameter(canon) if canon in params else module.get_buffer(canon)
            store = "_parameters" if canon in params else "_buffers"
            getattr(module.get_submodule(owner_path), store)[attr] = target
    except (AttributeError, KeyError) as exc:
        raise PlanFormatError(f"{pt_path}: weights do not fit the stage code ({exc})",
                              hint="re-export the stages") from exc
    expected = {n for n, _ in module.named_parameters(remove_duplicate=False)}
    expected |= {n for n, _ in module.named_buffers(remove_duplicate=False)}
    unloaded = sorted(expected - set(params) - set(buffers) - set(aliases))
    if unloaded:
        raise PlanFormatError(f"{pt_path}: no saved value for {unloaded}",
                              hint="re-export the stages")

