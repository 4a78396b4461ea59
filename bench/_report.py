"""Write a benchmark's results into BENCHMARKS.md, as one section per script.

Each script owns the text between its markers, so re-running one benchmark replaces only its own
section and the others (measured by other commands, possibly on other days) stay as they were.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "BENCHMARKS.md"
HEADER = ("# Benchmarks\n\nEach section was written by the command it names, run from the "
          "repository root; timings in one section were measured side by side in one run.\n")


def write_section(name: str, markdown: str, path: Path = BENCHMARKS) -> None:
    """Replace (or append) the section ``name`` of ``path`` atomically."""
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    block = f"{start}\n{markdown.rstrip()}\n{end}\n"
    text = path.read_text() if path.exists() else HEADER
    pattern = re.compile(re.escape(start) + r".*?" + re.escape(end) + r"\n?", re.S)
    text = pattern.sub(lambda _: block, text) if pattern.search(text) else text.rstrip() + "\n\n" + block
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def publish(name: str, markdown: str, out: str | None = None) -> None:
    """A benchmark's last step: its section into BENCHMARKS.md (or ``out``), and to stdout."""
    if out:
        Path(out).write_text(markdown.rstrip() + "\n")
    else:
        write_section(name, markdown)
    print(markdown)
