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
from fxpipe.units import format_bytes, format_seconds

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


def test_the_overview_draws_the_plan_at_a_glance(tmp_path: Path) -> None:
    """Stages left to right, each box with what it holds, its replicas (a double border when
    replicated), its compute (sync included, as the summary's column) and memory; the red edge
    into a stage carries its input bytes each way and their time; the caption the speedups."""
    from fxpipe.codegen import draw_overview
    from fxpipe.costmodel.hardware import Cluster
    from fxpipe.costmodel.profile import Profile, ProfileNode
    from fxpipe.passes import plan_for

    nodes = tuple(ProfileNode(name=f"n{i}", op="call_module", target="m", forward_s=0.01,
                              backward_s=0.0, activation_bytes=1e6, parameter_bytes=5e7,
                              inputs=(f"n{i - 1}",) if i else ()) for i in range(4))
    plan = plan_for(Profile(nodes=nodes, batch_size=8), Cluster(workers=3, bandwidth=1.25e8),
                    [0, 2], [2, 1])
    src = draw_overview(plan, tmp_path / "p.dot", spans=["layers.0..layers.1", ""]).read_text()
    boxes = re.findall(r'^\s*(stage\d) \[label="([^"]*)"([^]]*)\]', src, re.M)
    assert [b[0] for b in boxes] == ["stage0", "stage1"]
    s0, s1 = plan.stages
    assert boxes[0][1].splitlines() == [
        "stage 0", "layers.0..layers.1 (2 nodes)", "2 replicas",
        f"compute {format_seconds(s0.compute_s + s0.sync_s)}",
        f"memory {format_bytes(s0.memory_bytes)}"]
    assert "peripheries=2" in boxes[0][2] and "peripheries=1" in boxes[1][2]
    assert boxes[1][1].splitlines()[1] == "n2..n3 (2 nodes)"  # no span: first..last node
    cut = re.findall(r"stage0 -> stage1 \[([^]]*)\]", src)
    assert len(cut) == 1 and "color=red" in cut[0]
    assert f'label="{format_bytes(s1.input_bytes)} each way\n{format_seconds(s1.comm_s)}"' \
        in cut[0]
    assert f"{plan.speedup_over_data_parallel:.2f}x over data parallelism" in src


def test_a_stage_span_names_its_modules_not_the_exporters_or_an_earlier_stages() -> None:
    """torch.export puts the batch size it reads from an input under a placeholder module path
    (``_empty_nn_module_stack_from_metadata_hook``), and a stage makes again some values an
    earlier stage made (``<name>_here``): neither names the stage's own modules."""
    import fxpipe
    from fxpipe.codegen.visualize import module_span

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln = torch.nn.LayerNorm(16)
            self.attn = torch.nn.MultiheadAttention(16, 2, batch_first=True)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.ln(x)
            return x + self.attn(h, h, h, need_weights=False)[0]

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.emb = torch.nn.Embedding(50, 16)
            self.blocks = torch.nn.ModuleList([Block() for _ in range(4)])
            self.head = torch.nn.Linear(16, 50)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            x = self.emb(ids)
            for b in self.blocks:
                x = b(x)
            return self.head(x)

    compiled = fxpipe.compile(Net(), fxpipe.Cluster(workers=2),
                              example_inputs=(torch.randint(0, 50, (4, 8)),), stages=2,
                              straight=True, repeats=1, overheads="off", tracer="export")
    spans = [module_span(st.gm) for st in compiled.stage_specs]
    assert spans[0].startswith("emb..blocks.") and spans[1].startswith("blocks.")
    assert spans[1].endswith("..head") and "_empty" not in " ".join(spans)
    assert all(sp.split("..")[0] != "blocks.0.attn" for sp in spans[1:])  # not stage 0's work
    assert "_empty" not in compiled.summary()
