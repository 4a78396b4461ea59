"""draw_plan: clusters per stage, red cut edges, rendered SVG."""
from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch
import torch.fx as fx

from fxpipe.codegen import draw_plan, split_graph
from fxpipe.errors import ConfigError

from _codegen_helpers import ResCNN, annotate, chunk_stage_of


def _stages():
    x = torch.randn(2, 3, 8, 8)
    gm = annotate(fx.symbolic_trace(ResCNN()), x)
    return split_graph(gm, chunk_stage_of(gm, 3))


def test_dot_has_clusters_and_red_cut_edges(tmp_path: Path) -> None:
    stages = _stages()
    info = [{"replicas": 7, "compute_s": 0.012, "comm_s": 0.001, "memory_bytes": 2e9}] * 3
    path = draw_plan(stages, tmp_path / "plan.dot", stage_info=info)
    src = path.read_text()
    assert len(re.findall(r"subgraph cluster_\d+", src)) == 3
    assert "x7 replicas" in src and "12 ms" in src and "2 GB" in src
    cut_edges = [line for line in src.splitlines() if "->" in line and "color=red" in line]
    num_cuts = sum(sum(1 for s in st.sources if s >= 0) for st in stages)
    assert len(cut_edges) >= num_cuts >= 2
    assert any(re.search(r'label="\d', line) for line in cut_edges)  # bytes on cut edges
    assert "get_attr" not in src and "conv1\\nConv2d" in src


def test_svg(tmp_path: Path) -> None:
    path = draw_plan(_stages(), tmp_path / "plan.svg")
    head = path.read_bytes()[:200].lstrip()
    assert head.startswith(b"<?xml") or head.startswith(b"<svg")


def test_missing_dot_binary_is_clear(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shutil, "which", lambda _name: None)
    with pytest.raises(ConfigError, match="apt-get install graphviz"):
        draw_plan(_stages(), tmp_path / "plan.png")
    with pytest.raises(ConfigError, match="suffix"):
        draw_plan(_stages(), tmp_path / "plan.jpg")
