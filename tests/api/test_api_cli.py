"""The `fxpipe` command: plans from zoo names, files and profiles; user errors without tracebacks."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from fxpipe.cli import main

PROFILES = Path(__file__).resolve().parents[2] / "data" / "pipedream-profiles"  # vendored, MIT


def test_plan_zoo_model_exports_and_draws(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    svg = tmp_path / "p.svg"
    rc = main(["plan", "alexnet", "--workers", "4", "--bandwidth", "10Gbps", "--export",
               str(tmp_path / "out"), "--svg", str(svg)])
    out = capsys.readouterr().out
    assert rc == 0
    assert "predicted speedup" in out and "data-parallel" in out
    assert (tmp_path / "out" / "plan.json").is_file()
    assert (tmp_path / "out" / "stage_0.py").is_file()
    assert svg.read_text().lstrip().startswith(("<?xml", "<svg"))


def test_plan_from_factory_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "mymodel.py"
    f.write_text(textwrap.dedent("""
        import torch
        def factory():
            m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
            return m, (torch.randn(4, 8),)
    """))
    assert main(["plan", f"{f}:factory", "--workers", "2", "--stages", "2"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()]
    assert [r[0] for r in rows if r and r[0].isdigit() and len(r) > 3] == ["0", "1"]  # two stages


def test_plan_pipedream_profile_vgg16_is_7_1(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["plan", str(PROFILES / "vgg16" / "graph.txt"), "--workers", "8", "--bandwidth",
               "10Gbps", "--sync", "parameter-server"])
    assert rc == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()]
    stages = [r for r in rows if r and r[0].isdigit() and len(r) > 3]
    assert [int(r[3]) for r in stages] == [7, 1]  # PipeDream's published 7-1 plan


@pytest.mark.parametrize("argv, needle", [
    (["plan", "nosuchmodel", "--workers", "2"], "unknown model 'nosuchmodel'"),
    (["plan", "alexnet", "--workers", "0"], "workers must be a positive integer"),
    (["plan", "alexnet", "--workers", "2", "--bandwidth=-3Gbps"], "bandwidth must be positive"),
    (["plan", "alexnet", "--workers", "2", "--device", "TPU9"], "unknown device 'TPU9'"),
    (["plan", "alexnet", "--workers", "2", "--stages", "9"], "stages"),
])
def test_bad_input_is_one_clear_line(argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err
    assert "Traceback" not in err


def test_console_script_installed() -> None:
    exe = Path(sys.executable).parent / "fxpipe"
    r = subprocess.run([str(exe), "plan", "nosuchmodel", "--workers", "2"], capture_output=True,
                       text=True, timeout=120, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert r.returncode == 2
    assert "unknown model" in r.stderr and "Traceback" not in r.stderr
