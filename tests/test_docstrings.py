"""Module docstrings say what a module does and why in a few lines, and package docstrings name
their modules.

The reasoning in full, the figures that decided it and the issue it came from live in
docs/design-notes.md, DESIGN.md and the benchmark pages, which are kept current with them;
numbers in a docstring go stale unseen. Checked on every module of the product (the five
phases and the facade): the median docstring is at most 5 lines and none quotes a measured
figure, an issue number or a benchmark path; every package's ``__init__`` names each of its
modules (``name``) and no module it does not have.
"""
from __future__ import annotations

import ast
import re
import statistics
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ["fxpipe", "fxpipe/models", "tracing", "costmodel", "passes", "codegen", "runtime",
            "runtime/schedules", "runtime/pricing", "runtime/replica", "runtime/execution",
            "runtime/training"]
FIGURE = re.compile(r"\b\d+(?:\.\d+)?\s?(?:ms|us|µs|GB|MB|KB|GiB|MiB|Mbit/s|Gbps)\b"
                    r"|\b\d+(?:\.\d+)?\s?%|\b\d+(?:\.\d+)?x\b|measured on (?:the|a|this)\b")
ISSUE = re.compile(r"\bissue \d+", re.I)
BENCH = re.compile(r"\bbench(?:marks)?/\w")


def modules() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).glob("*.py"))


def doc(path: Path) -> str:
    return ast.get_docstring(ast.parse(path.read_text())) or ""


def test_module_docstrings_are_short() -> None:
    lengths = {p: len(doc(p).splitlines()) for p in modules()}
    assert statistics.median(lengths.values()) <= 5, sorted(lengths.items(), key=lambda x: -x[1])
    assert all(n >= 1 for n in lengths.values()), [p for p, n in lengths.items() if n == 0]


@pytest.mark.parametrize("path", modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_module_docstring_quotes_a_figure_an_issue_or_a_benchmark(path: Path) -> None:
    text = doc(path)
    found = FIGURE.findall(text) + ISSUE.findall(text) + BENCH.findall(text)
    assert not found, f"{path.relative_to(ROOT)}: {found} (move it to docs/design-notes.md)"


@pytest.mark.parametrize("package", PACKAGES)
def test_a_package_docstring_names_its_modules(package: str) -> None:
    """Every module of the package as ``name``; any other ``name`` is a subpackage or a name
    the package exports (``fxpipe.compile``), never a module that is not there."""
    folder = ROOT / package
    have = {p.stem for p in folder.glob("*.py") if p.stem != "__init__"}
    subpackages = {p.name for p in folder.iterdir() if (p / "__init__.py").is_file()}
    text = doc(folder / "__init__.py")
    named = set(re.findall(r"``(\w+)``", text))
    assert not have - named, f"{package}/__init__.py does not name {sorted(have - named)}"
    init = ast.parse((folder / "__init__.py").read_text())
    exported = {n.id for n in ast.walk(init) if isinstance(n, ast.Name)} | {
        a.asname or a.name for n in ast.walk(init) if isinstance(n, ast.ImportFrom)
        for a in n.names} | set(re.findall(r'"(\w+)"', (folder / "__init__.py").read_text()))
    absent = named - have - subpackages - exported
    assert not absent, f"{package}/__init__.py names modules it does not have: {sorted(absent)}"
