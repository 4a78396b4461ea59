"""Regenerate the printed output the pages show for deterministic commands.

    .venv/bin/python -m tools.docs           # rewrite each shown output from a fresh run
    .venv/bin/python -m tools.docs --check   # only say which ones moved (exit 1 if any)

The commands are ``tests/test_docs.py``'s ``CHECK_PRINTED`` (estimated costs, published
profiles, simulations: the same figures on every machine); their output blocks are what that
test holds every run against, so after a change that moves a figure this rewrites the pages,
and the diff shows what moved. Runs from a scratch folder as the test does (drawings land
there, not in the checkout).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

from test_docs import ALL_BLOCKS, CHECK_PRINTED, commands, scratch  # noqa: E402


def shown(block_text: str, printed: str) -> str:
    """The printed lines, minus the ones about files written (they name the scratch folder's
    paths, and the page says where its picture is)."""
    keep = [ln.rstrip() for ln in printed.splitlines()
            if not ln.startswith(("drew the plan", "exported stages"))]
    return "\n".join(keep).strip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.docs", description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="only report which outputs moved")
    args = p.parse_args(argv)
    moved = []
    for block in ALL_BLOCKS:
        if block.lang not in ("bash", "sh", "shell") or block.after is None:
            continue
        for command in commands(block):
            if command not in CHECK_PRINTED:
                continue
            env = {k: v for k, v in os.environ.items() if k != "FXPIPE_OVERHEADS"}
            with tempfile.TemporaryDirectory() as work:
                res = subprocess.run(["bash", "-c", command.replace(
                    ".venv/bin/", f"{Path(sys.executable).parent}/")], cwd=scratch(Path(work)),
                    text=True, capture_output=True, timeout=300, env=env)
            if res.returncode != 0:
                print(f"{block.where}: {command!r} failed:\n{res.stderr[-2000:]}")
                return 2
            new = shown(block.after, res.stdout)
            if new != block.after:
                moved.append(block.where)
                if not args.check:
                    text = block.page.read_text()
                    old = f"```\n{block.after}```"
                    assert text.count(old) == 1, f"{block.where}: its output block is not unique"
                    block.page.write_text(text.replace(old, f"```\n{new}```"))
    for where in moved:
        print(f"{'moved' if args.check else 'regenerated'}: {where}")
    return 1 if moved and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
