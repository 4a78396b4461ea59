"""The `fxpipe` command: plans from zoo names, files and profiles; user errors without tracebacks."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from fxpipe.cli import main
from fxpipe.models import pipedream

PROFILES = pipedream.PROFILES  # PipeDream's published profiles, shipped (MIT)


def test_plan_zoo_model_exports_and_draws(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    svg = tmp_path / "p.svg"
    rc = main(["plan", "alexnet", "--workers", "4", "--bandwidth", "10Gbps", "--export",
               str(tmp_path / "out"), "--svg", str(svg)])
    out = capsys.readouterr().out
    assert rc == 0
    assert "speedup: " in out and "over data parallelism on 4 workers" in out
    assert "over one worker" in out and "costs: measured on this machine" in out
    assert (tmp_path / "out" / "plan.json").is_file()
    assert (tmp_path / "out" / "stage_0.py").is_file()
    assert svg.read_text().lstrip().startswith(("<?xml", "<svg"))
    assert "fxpipe_plan_overview" in svg.read_text()  # the plan at a glance by default
    nodes = tmp_path / "n.dot"
    assert main(["plan", "alexnet", "--workers", "4", "--svg", str(nodes), "--nodes"]) == 0
    assert "cluster_0" in nodes.read_text()  # node by node, one cluster per stage


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


@pytest.mark.parametrize("model", [str(PROFILES / "vgg16" / "graph.txt"), "pipedream:vgg16"])
def test_plan_pipedream_profile_vgg16_is_7_1(model: str, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    """PipeDream's own setting (its profile, 8 workers over 10 Gbps, parameter servers, its
    schedule) gives PipeDream's published 7-1 plan; the shipped profile by name says what the
    paper reports beside it, and draws from the plan alone."""
    rc = main(["plan", model, "--workers", "8", "--bandwidth", "10Gbps", "--sync",
               "parameter-server", "--schedule", "pipedream", "--svg", str(tmp_path / "p.dot")])
    assert rc == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines()]
    stages = [r for r in rows if r and r[0].isdigit() and len(r) > 3]
    assert [int(r[3]) for r in stages] == [7, 1]  # PipeDream's published 7-1 plan
    assert ("speedup: 2.75x over data parallelism on 8 workers (278 ms per minibatch), 6.67x "
            "over one worker (673 ms)") in out.splitlines()
    assert (tmp_path / "p.dot").read_text().count("replica") == 2
    paper = [ln for ln in out.splitlines() if ln.startswith("PipeDream's paper")]
    assert len(paper) == (1 if model.startswith("pipedream:") else 0)
    assert all(ln.endswith("fxpipe's plan here: 2.75x the throughput of data parallelism, "
                           "from PipeDream's own profile") for ln in paper)


def test_a_profile_cannot_be_exported_or_drawn_node_by_node(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "pipedream:vgg16", "--workers", "2", "--nodes", "--svg", "x.svg"]) == 2
    assert "--nodes needs a model, not a profile" in capsys.readouterr().err
    assert main(["plan", "pipedream:nosuch", "--workers", "2"]) == 2
    assert "no PipeDream profile named 'nosuch'" in capsys.readouterr().err


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


@pytest.mark.multiprocess
def test_console_script_installed() -> None:
    exe = Path(sys.executable).parent / "fxpipe"
    r = subprocess.run([str(exe), "plan", "nosuchmodel", "--workers", "2"], capture_output=True,
                       text=True, timeout=120, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert r.returncode == 2
    assert "unknown model" in r.stderr and "Traceback" not in r.stderr
