"""CI runs exactly the README's two commands: keep them in sync."""
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_ci_runs_the_readme_commands() -> None:
    readme = ROOT.joinpath("README.md").read_text().splitlines()
    ci = [line for line in ROOT.joinpath(".ci", "run").read_text().splitlines()
          if line.strip() and not line.startswith(("#", "set ", "cd ", "export "))]
    assert len(ci) == 2, ci
    for command in ci:
        assert command in readme, f".ci/run runs a command the README does not give: {command}"


def test_readme_files_exist_in_a_clone() -> None:
    """Every repository file the README's and the docs pages' commands read (the vendored
    PipeDream profiles) is in the repository itself: the commands work from a fresh clone, with
    nothing beside it."""
    import re

    for page in PAGES:
        text = page.read_text()
        assert "../shared" not in text, page
        for p in sorted(set(re.findall(r"(?<![\w/.])(data/[\w./-]+)", text))):
            assert ROOT.joinpath(p).is_file(), f"{page.relative_to(ROOT)}: {p}"
    readme = ROOT.joinpath("README.md").read_text()
    assert re.findall(r"(?<![\w/.])(data/[\w./-]+)", readme), \
        "the README names no data files any more: drop this test"
