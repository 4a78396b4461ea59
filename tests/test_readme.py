"""CI runs exactly the README's two commands: keep them in sync."""
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ci_runs_the_readme_commands() -> None:
    readme = ROOT.joinpath("README.md").read_text().splitlines()
    ci = [line for line in ROOT.joinpath(".ci", "run").read_text().splitlines()
          if line.strip() and not line.startswith(("#", "set ", "cd ", "export "))]
    assert len(ci) == 2, ci
    for command in ci:
        assert command in readme, f".ci/run runs a command the README does not give: {command}"


def test_readme_files_exist_in_a_clone() -> None:
    """Every repository file the README's commands read (the vendored PipeDream profiles) is in
    the repository itself: the commands work from a fresh clone, with nothing beside it."""
    import re

    text = ROOT.joinpath("README.md").read_text()
    paths = set(re.findall(r"(?<![\w/.])(data/[\w./-]+)", text))
    assert paths, "the README names no data files any more: drop this test"
    assert "../shared" not in text
    for p in sorted(paths):
        assert ROOT.joinpath(p).is_file(), p
