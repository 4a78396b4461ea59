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


def test_what_the_pages_plan_is_shipped_inside_the_package() -> None:
    """Every ``pipedream:<name>`` the README and the docs pages plan is a profile shipped inside
    the ``fxpipe`` package (pyproject's package data names its files, licence included), so the
    commands work after a plain install, from any folder, without a clone; no page reads a file
    from beside the repository."""
    import fnmatch
    import re
    import tomllib

    from fxpipe.models import pipedream

    shipped = tomllib.loads(ROOT.joinpath("pyproject.toml").read_text())["tool"]["setuptools"][
        "package-data"]["fxpipe.models"]
    files = [p.relative_to(pipedream.PROFILES.parent).as_posix()
             for p in pipedream.PROFILES.rglob("*") if p.is_file()]
    assert "pipedream_profiles/LICENSE.txt" in files
    for f in files:
        assert any(fnmatch.fnmatch(f, pat) for pat in shipped), f"{f} is not package data"
    named = set()
    for page in PAGES:
        text = page.read_text()
        assert "../shared" not in text and "data/pipedream-profiles" not in text, page
        named |= set(re.findall(r"pipedream:(\w+)", text))
    assert "vgg16" in named
    for name in named - {"name"}:
        assert pipedream.profile_path(name).is_file(), name
