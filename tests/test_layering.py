"""The house's import rules, checked over the code's own imports (``ast``; nothing is imported).

Phases import only the phases before them (tracing, costmodel, passes, codegen, runtime) and the
shared leaves (``fxpipe.errors``, ``fxpipe.units``, ``fxpipe.jsonio``, ``fxpipe.host_memory``);
no phase imports the facade (``fxpipe/__init__``, ``fxpipe.api``, the CLI, the zoo). Inside
``runtime/`` five packages import in one direction::

    schedules <- pricing, replica <- execution <- training

(``pricing`` and ``replica`` never import each other; nothing imports ``training``), and the
runtime's shared leaves (``errors``, ``timeline``) import none of the five. No import cycle
anywhere in the product, lazy imports inside functions included. ``torch`` is never imported by
``passes/``, ``runtime/schedules/``, ``runtime/pricing/`` or ``runtime/execution/ports.py``
(directly, or through what they import: checked in a fresh interpreter), and
``torch.distributed`` only by ``runtime/execution/``.

Each rule is also run on a small tree made in the test with one bad import, so the checker is
seen to fail.
"""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parents[1]
PHASES = ("tracing", "costmodel", "passes", "codegen", "runtime")  # in import order
LEAVES = ("fxpipe.errors", "fxpipe.units", "fxpipe.jsonio", "fxpipe.host_memory")
RUNTIME_PACKAGES = ("schedules", "pricing", "replica", "execution", "training")
ALLOWED = {  # runtime sub-package -> the sub-packages it may import
    "schedules": set(),
    "pricing": {"schedules"},
    "replica": {"schedules"},
    "execution": {"schedules", "replica"},
    "training": {"schedules", "pricing", "replica", "execution"},
}
RUNTIME_LEAVES = ("fxpipe.runtime.errors", "fxpipe.runtime.timeline")
TORCH_FREE = ("fxpipe.passes", "fxpipe.runtime.schedules", "fxpipe.runtime.pricing",
              "fxpipe.runtime.execution.ports")  # ports: what `fxpipe train`'s launcher imports
DISTRIBUTED_ONLY_IN = "fxpipe.runtime.execution"


def product_modules(root: Path) -> dict[str, Path]:
    """Module name -> file, for the facade and the five phase folders (pyproject's package-dir:
    ``runtime/`` installs as ``fxpipe.runtime``)."""
    out: dict[str, Path] = {}
    for top, package in [("fxpipe", "fxpipe")] + [(p, f"fxpipe.{p}") for p in PHASES]:
        for path in sorted((root / top).rglob("*.py")):
            parts = list(path.relative_to(root / top).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([package, *parts])] = path
    return out


def _targets(node: ast.AST, module: str, is_package: bool, known: dict[str, Path]) -> list[str]:
    """The modules one import statement names (a name imported from a package counts as its
    submodule when there is one)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    assert isinstance(node, ast.ImportFrom)
    if node.level:
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[:len(base) - node.level + 1]
        where = ".".join(base + ([node.module] if node.module else []))
    else:
        where = node.module or ""
    return [f"{where}.{a.name}" if f"{where}.{a.name}" in known else where for a in node.names]


def imports(root: Path) -> dict[str, set[str]]:
    """Product module -> every module it imports (absolute names, third-party ones included)."""
    known = product_modules(root)
    out: dict[str, set[str]] = {}
    for module, path in known.items():
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                found.update(_targets(node, module, path.name == "__init__.py", known))
        out[module] = found
    return out


def _product(name: str, known: set[str]) -> str | None:
    """The product module an imported name lands in (the longest known prefix), if any."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        if ".".join(parts[:i]) in known:
            return ".".join(parts[:i])
    return None


def _phase(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in PHASES else None


def _runtime_package(module: str) -> str | None:
    parts = module.split(".")
    if len(parts) > 2 and parts[:2] == ["fxpipe", "runtime"] and parts[2] in RUNTIME_PACKAGES:
        return parts[2]
    return None


def violations(root: Path) -> list[str]:
    """Every broken rule of the module doc, one line each (empty: the house is in order)."""
    graph = imports(root)
    known = set(graph)
    bad: list[str] = []
    edges = nx.DiGraph()
    edges.add_nodes_from(known)
    for src, names in sorted(graph.items()):
        for name in sorted(names):
            if name == "torch.distributed" or name.startswith("torch.distributed."):
                if not src.startswith(DISTRIBUTED_ONLY_IN):
                    bad.append(f"{src} imports {name}: only {DISTRIBUTED_ONLY_IN} may")
            free = [p for p in TORCH_FREE if src == p or src.startswith(p + ".")]
            if (name == "torch" or name.startswith("torch.")) and free:
                bad.append(f"{src} imports {name}: {free[0]} is torch-free")
            dst = _product(name, known)
            if dst is None or dst == src:
                continue
            edges.add_edge(src, dst)
            bad.extend(_phase_rule(src, dst) + _runtime_rule(src, dst))
    # one cycle per knot of mutually importing modules (enumerating every cycle of a badly
    # tangled graph is exponential; one per strongly connected component names each knot)
    cycles = []
    for knot in nx.strongly_connected_components(edges):
        if len(knot) > 1:
            cycle = _rotated([a for a, _ in nx.find_cycle(edges.subgraph(knot), source=min(knot))])
            cycles.append("import cycle: " + " -> ".join(cycle + cycle[:1]))
    return bad + sorted(cycles)


def _rotated(cycle: list[str]) -> list[str]:
    """The cycle starting at its smallest name (one spelling per cycle)."""
    i = cycle.index(min(cycle))
    return cycle[i:] + cycle[:i]


def _phase_rule(src: str, dst: str) -> list[str]:
    s, d = _phase(src), _phase(dst)
    if s is None:
        return []  # the facade and the shared leaves may import any phase
    if d is None:
        ok = dst in LEAVES
        return [] if ok else [f"{src} imports {dst}: a phase imports no facade module"]
    if PHASES.index(d) > PHASES.index(s):
        return [f"{src} imports {dst}: phase {s} comes before {d}"]
    return []


def _runtime_rule(src: str, dst: str) -> list[str]:
    if not (src.startswith("fxpipe.runtime.") and dst.startswith("fxpipe.runtime.")):
        return []
    s, d = _runtime_package(src), _runtime_package(dst)
    if d is None or s == d:
        return []
    if s is None:
        if src in RUNTIME_LEAVES:
            return [f"{src} imports {dst}: the runtime's shared leaves import none of the five"]
        return []
    if d not in ALLOWED[s]:
        return [f"{src} imports {dst}: runtime.{s} may import only "
                f"{sorted(ALLOWED[s]) or 'the shared leaves'}"]
    return []


def test_the_house_keeps_its_import_rules() -> None:
    assert violations(ROOT) == []


def test_the_runtime_has_five_packages_and_its_shared_leaves() -> None:
    runtime = ROOT / "runtime"
    assert sorted(p.name for p in runtime.iterdir() if (p / "__init__.py").is_file()) == sorted(
        RUNTIME_PACKAGES)
    assert sorted(p.name for p in runtime.glob("*.py")) == ["__init__.py", "errors.py",
                                                           "timeline.py"]


@pytest.mark.multiprocess
@pytest.mark.parametrize("package", TORCH_FREE)
def test_torch_free_packages_do_not_import_torch_at_run_time(package: str) -> None:
    """What an import really runs (parent packages' ``__init__`` included), in a fresh process."""
    modules = sorted(m for m in product_modules(ROOT) if m == package or m.startswith(package + "."))
    code = ("import importlib, sys\n"
            f"for m in {modules!r}: importlib.import_module(m)\n"
            "print(sorted(k for k in sys.modules if k == 'torch' or k.startswith('torch.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def _tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


GOOD = {
    "fxpipe/__init__.py": "", "fxpipe/errors.py": "", "fxpipe/api.py": "",
    "tracing/__init__.py": "", "costmodel/__init__.py": "", "codegen/__init__.py": "",
    "passes/__init__.py": "", "passes/solve.py": "from fxpipe.errors import X\n",
    "runtime/__init__.py": "", "runtime/errors.py": "", "runtime/timeline.py": "",
    "runtime/schedules/__init__.py": "", "runtime/schedules/schedule.py": "from ..errors import E\n",
    "runtime/pricing/__init__.py": "", "runtime/pricing/sim.py": "from ..schedules import schedule\n",
    "runtime/replica/__init__.py": "", "runtime/replica/stage.py": "import torch\n",
    "runtime/execution/__init__.py": "",
    "runtime/execution/comm.py": "import torch.distributed as dist\nfrom ..replica.stage import S\n",
    "runtime/training/__init__.py": "", "runtime/training/trainer.py": (
        "from ..execution.comm import C\nfrom ..pricing.sim import P\n"),
}


@pytest.mark.parametrize("rel, text, expected", [
    ("runtime/schedules/kinds.py", "from ..replica.stage import S\n",
     "fxpipe.runtime.schedules.kinds imports fxpipe.runtime.replica.stage: runtime.schedules"),
    ("runtime/replica/clip.py", "def f():\n    from fxpipe.runtime.pricing import sim\n",
     "fxpipe.runtime.replica.clip imports fxpipe.runtime.pricing.sim: runtime.replica may"),
    # planning (runtime.pricing: a Profile in, a Plan out) measures nothing and runs nothing
    ("runtime/pricing/choose.py", "from fxpipe.runtime.execution.overhead_probe import m\n",
     "fxpipe.runtime.pricing.choose imports fxpipe.runtime.execution: runtime.pricing may"),
    ("runtime/pricing/choose.py", "def f():\n    from ..replica.state_size import state_factor\n",
     "fxpipe.runtime.pricing.choose imports fxpipe.runtime.replica"),
    ("runtime/pricing/choose.py", "import torch\n",
     "fxpipe.runtime.pricing.choose imports torch: fxpipe.runtime.pricing is torch-free"),
    ("runtime/execution/launch.py", "from fxpipe.runtime.training.trainer import T\n",
     "fxpipe.runtime.execution.launch imports fxpipe.runtime.training.trainer"),
    ("runtime/timeline2.py", "", None),
    ("runtime/errors.py", "from .schedules.schedule import A\n",
     "fxpipe.runtime.errors imports fxpipe.runtime.schedules.schedule: the runtime's shared leaves"),
    ("passes/cuts.py", "import torch\n", "fxpipe.passes.cuts imports torch: fxpipe.passes is torch"),
    ("runtime/schedules/sim.py", "from torch import nn\n", "fxpipe.runtime.schedules.sim imports "
     "torch: fxpipe.runtime.schedules is torch-free"),
    ("runtime/replica/sync.py", "from torch.distributed import all_reduce\n",
     "fxpipe.runtime.replica.sync imports torch.distributed: only fxpipe.runtime.execution may"),
    ("passes/plan.py", "from fxpipe.runtime.schedules import schedule\n",
     "fxpipe.passes.plan imports fxpipe.runtime.schedules.schedule: phase passes comes before"),
    ("codegen/split.py", "from fxpipe.api import compile\n",
     "fxpipe.codegen.split imports fxpipe.api: a phase imports no facade module"),
    ("runtime/schedules/schedule.py", "def f():\n    from . import kinds\n",
     "import cycle: fxpipe.runtime.schedules.kinds -> fxpipe.runtime.schedules.schedule"),
])
def test_the_checker_fails_on_a_bad_import(tmp_path: Path, rel: str, text: str,
                                           expected: str | None) -> None:
    files = dict(GOOD)
    if rel == "runtime/schedules/schedule.py":
        files["runtime/schedules/kinds.py"] = "from .schedule import A\n"
    files[rel] = text
    root = _tree(tmp_path, files)
    assert violations(_tree(tmp_path / "good", GOOD)) == []
    found = violations(root)
    if expected is None:  # a new file at the runtime's root: the layout test's business
        assert found == []
        return
    assert any(line.startswith(expected) for line in found), found
