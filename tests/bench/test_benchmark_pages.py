"""BENCHMARKS.md is a table of benchmarks/: one row per page, every link a page, every quoted
headline copied from its page; bench._report writes one page, atomically, keeping its notes."""
from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from bench import _report

ROOT = Path(__file__).resolve().parents[2]
INDEX = ROOT / "BENCHMARKS.md"
PAGES = ROOT / "benchmarks"
LINK = re.compile(r"\]\((benchmarks/[^)#\s]*)(#[^)\s]*)?\)")
ENTRY = re.compile(r"^\| \[[^\]]+\]\((benchmarks/[^)#\s]+\.md)\) \|")
DATE = re.compile(r"\| (\d{4}-\d{2}-\d{2}) \|$")


def test_every_page_is_linked_from_the_index() -> None:
    linked = {m.group(1) for m in LINK.finditer(INDEX.read_text())}
    pages = sorted(PAGES.glob("*.md"))
    assert pages, "benchmarks/ has no pages"
    missing = [p.name for p in pages if f"benchmarks/{p.name}" not in linked]
    assert not missing, f"pages BENCHMARKS.md does not link: {missing}"


def test_every_index_link_exists() -> None:
    for m in LINK.finditer(INDEX.read_text()):
        assert (ROOT / m.group(1)).exists(), m.group(0)


def test_each_page_has_one_row_whose_quoted_headlines_are_in_it() -> None:
    entries = [ENTRY.match(line) for line in INDEX.read_text().splitlines()]
    entries = [(m.group(1), m.string) for m in entries if m]
    assert sorted(page for page, _ in entries) == sorted(f"benchmarks/{p.name}"
                                                          for p in PAGES.glob("*.md"))
    for page, line in entries:
        text = (ROOT / page).read_text()
        quoted = re.findall(r'"([^"]+)"', line)
        assert quoted, f"no quoted headline for {page}"
        for q in quoted:
            assert q in text, f"{page} does not say {q!r}"
        assert line.count(" | ") == 3 and DATE.search(line), f"not page | command | headline | date: {line}"


def test_each_rows_command_is_a_module_here() -> None:
    modules = re.findall(r"`python -m ([\w.]+)", INDEX.read_text())
    assert len(modules) >= len(list(PAGES.glob("*.md")))
    for module in modules:
        path = ROOT.joinpath(*module.split("."))
        assert path.with_suffix(".py").exists() or (path / "__main__.py").exists(), module


def test_pages_are_pages() -> None:
    """A page starts with its own title; its relative links resolve from benchmarks/."""
    for page in PAGES.glob("*.md"):
        text = page.read_text()
        assert text.startswith("# "), page.name
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"^(?:[a-zA-Z][\w+.-]*:|#)", target):
                continue
            assert (PAGES / target.split("#")[0]).resolve().exists(), (page.name, target)


def test_write_section_writes_only_its_page_atomically(tmp_path: Path, monkeypatch) -> None:
    folder = tmp_path / "benchmarks"
    _report.write_section("other", "## Other\n\nkept\n", folder)
    other = (folder / "other.md").read_text()

    replaced: list[tuple[str, str]] = []
    real_replace = os.replace

    def spy(src, dst):  # the page appears whole, by a rename inside its own folder
        assert Path(src).parent == Path(dst).parent == folder
        assert Path(src).read_text().startswith("# Speed")
        replaced.append((Path(src).name, Path(dst).name))
        real_replace(src, dst)

    monkeypatch.setattr(_report.os, "replace", spy)
    md = ("## Speed\n\nCommand: `.venv/bin/python bench/x.py --fast`\n\n### Detail\n\n"
          "![plot](docs/figures/x.png) [up](../README.md) [web](https://example.com)\n"
          "[here](#detail)\n"
          "```\n## not a heading\n[raw](docs/raw.md)\n```\n")
    _report.write_section("speed", md, folder)
    assert replaced == [(".speed.md.tmp", "speed.md")]
    assert (folder / "speed.md").read_text() == (
        "# Speed\n\nCommand: `.venv/bin/python bench/x.py --fast`\n\n## Detail\n\n"
        "![plot](../docs/figures/x.png) [up](../README.md) [web](https://example.com)\n"
        "[here](#detail)\n"
        "```\n## not a heading\n[raw](docs/raw.md)\n```\n")

    _report.write_section("speed", "## Speed\n\nsecond run\n", folder)  # replaces, not appends
    assert (folder / "speed.md").read_text() == "# Speed\n\nsecond run\n"
    assert (folder / "other.md").read_text() == other
    assert sorted(p.name for p in folder.iterdir()) == ["other.md", "speed.md"]  # no temp left


def test_a_rewritten_page_keeps_its_notes(tmp_path: Path) -> None:
    _report.write_section("speed", "## Speed\n\nold figure\n", tmp_path)
    page = tmp_path / "speed.md"
    page.write_text(page.read_text() + "\n## Notes (by hand)\n\nthe link was shared\n")
    _report.write_section("speed", "## Speed\n\nnew figure\n", tmp_path)
    assert page.read_text() == ("# Speed\n\nnew figure\n\n"
                                "## Notes (by hand)\n\nthe link was shared\n")
    _report.write_section("speed", "## Speed\n\nthird\n\n## Notes (by hand)\n\nnew notes\n",
                          tmp_path)  # notes the script hands over replace the old ones
    assert page.read_text().endswith("## Notes (by hand)\n\nnew notes\n")
    assert page.read_text().count("## Notes (by hand)") == 1


def test_every_page_ends_with_its_notes() -> None:
    for page in PAGES.glob("*.md"):
        notes = _report.notes_of(page.read_text())
        assert notes.startswith(_report.NOTES) and notes.strip() != _report.NOTES, page.name


def test_a_failed_write_leaves_the_old_page(tmp_path: Path, monkeypatch) -> None:
    _report.write_section("speed", "# Speed\n\nold\n", tmp_path)

    def boom(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(_report.os, "replace", boom)
    with pytest.raises(OSError):
        _report.write_section("speed", "# Speed\n\nnew\n", tmp_path)
    assert (tmp_path / "speed.md").read_text() == "# Speed\n\nold\n"
    assert [p.name for p in tmp_path.iterdir()] == ["speed.md"]


def test_a_page_is_what_its_section_was(tmp_path: Path) -> None:
    """Rewriting a page from itself changes nothing: the pages are what write_section writes."""
    for page in PAGES.glob("*.md"):
        _report.write_section(page.stem, page.read_text(), tmp_path)
        assert (tmp_path / page.name).read_text() == page.read_text(), page.name


@pytest.mark.parametrize("name", ["", "../x", "a/b", ".hidden"])
def test_a_page_name_is_a_plain_file_name(name: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        _report.write_section(name, "# x\n", tmp_path)


def test_publish_writes_the_page_or_out(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setattr(_report, "PAGES", tmp_path / "pages")
    _report.publish("p", "## P\n\n1.00x\n")
    assert (tmp_path / "pages" / "p.md").read_text() == "# P\n\n1.00x\n"
    out = tmp_path / "out.md"
    _report.publish("p", "## P\n\n2.00x\n", str(out))
    assert out.read_text() == "## P\n\n2.00x\n"  # --out: the markdown as the script made it
    assert (tmp_path / "pages" / "p.md").read_text() == "# P\n\n1.00x\n"
    assert "2.00x" in capsys.readouterr().out
