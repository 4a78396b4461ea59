"""Write a benchmark's results as its own page, ``benchmarks/<name>.md``, one page per section.

Each page is owned by the script that writes it, so re-running one benchmark replaces only
its own page and the others (measured by other commands, possibly on other days) stay as they
were; a page's hand-written notes (its last section, :data:`NOTES`) survive the rewrite.
BENCHMARKS.md at the repository root is the table of pages: one row per page with its command,
headline and date, kept by hand (tests/bench/test_benchmark_pages.py checks it).

The markdown a script hands over is what it used to put between its markers in BENCHMARKS.md:
a heading, the command that produced it, the results. Two things change on the way to the page:
its headings move up so the first one is the page's ``# Title`` (``## Planning speed`` becomes
``# Planning speed``, a ``###`` under it ``##``), and relative links and images, written from the
repository root as before (``docs/figures/x.png``), are made relative to the page
(``../docs/figures/x.png``). Fenced code blocks are left alone.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "BENCHMARKS.md"  # the index
PAGES = ROOT / "benchmarks"

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
_HEADING = re.compile(r"^(#{1,6})(?=\s)")
_FENCE = re.compile(r"^\s*(```|~~~)")
_LINK = re.compile(r"(\]\()([^)\s]+)")  # [text](target and ![alt](target
_NOT_RELATIVE = re.compile(r"^(?:[a-zA-Z][\w+.-]*:|#|/|\.\./)")  # scheme:, #anchor, /abs, ../


def page_path(name: str, folder: Path | None = None) -> Path:
    """Where the section ``name`` lives: ``folder/<name>.md`` (``folder``: benchmarks/)."""
    if not _NAME.fullmatch(name):
        raise ValueError(f"a page name is letters, digits, '_', '.', '-': {name!r}")
    return Path(PAGES if folder is None else folder) / f"{name}.md"


def as_page(markdown: str) -> str:
    """``markdown`` as a page: first heading at ``#``, links relative to ``benchmarks/``."""
    lines, fenced, shift = markdown.rstrip().splitlines(), False, None
    out = []
    for line in lines:
        if _FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            m = _HEADING.match(line)
            if m:
                if shift is None:
                    shift = len(m.group(1)) - 1
                level = max(1, len(m.group(1)) - shift)
                line = "#" * level + line[len(m.group(1)):]
            line = _LINK.sub(lambda k: k.group(1) + (k.group(2) if _NOT_RELATIVE.match(k.group(2))
                                                     else "../" + k.group(2)), line)
        out.append(line)
    return "\n".join(out) + "\n"


NOTES = "## Notes (by hand)"
"""A page's last section, written by hand (what a run showed, why a figure moved): kept when
the script writes the page again."""


def notes_of(text: str) -> str:
    """The hand-written notes at the end of a page (from :data:`NOTES` on), or ""."""
    i = text.find(f"\n{NOTES}\n")
    return text[i + 1:] if i >= 0 else ""


def write_section(name: str, markdown: str, folder: Path | None = None) -> None:
    """Write the page ``folder/<name>.md`` (``folder``: benchmarks/) atomically, replacing only
    that page: the text goes to a temporary file beside it, renamed over the page once whole.
    The page's hand-written notes (:data:`NOTES` to the end) stay at its end, as written; notes
    at the end of ``markdown`` (a page rewritten from itself) replace them."""
    path = page_path(name, folder)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    given = notes_of(markdown)
    notes = given or (notes_of(path.read_text()) if path.exists() else "")
    page = as_page(markdown[:len(markdown) - len(given)] if given else markdown)
    if notes:
        page = page.rstrip() + "\n\n" + notes.rstrip() + "\n"
    try:
        tmp.write_text(page)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def publish(name: str, markdown: str, out: str | None = None) -> None:
    """A benchmark's last step: its page benchmarks/<name>.md (or ``out``), and to stdout."""
    if out:
        Path(out).write_text(markdown.rstrip() + "\n")
    else:
        write_section(name, markdown)
    print(markdown)
