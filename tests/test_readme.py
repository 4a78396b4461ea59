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
