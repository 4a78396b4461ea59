"""export_stages / load_exported: fresh-process round trip, malformed files, no clobbering."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.fx as fx

from fxpipe.codegen import export_stages, load_exported, run_stages, split_graph
from fxpipe.errors import ConfigError, PlanFormatError

from _codegen_helpers import ResCNN, TinyGPT, annotate, chunk_stage_of

ROOT = Path(__file__).resolve().parents[2]

CHILD = textwrap.dedent("""
    import sys, torch
    from fxpipe.codegen import load_exported, run_stages
    import torch.utils._pytree as pytree
    for case in sys.argv[1:]:
        plan, stages = load_exported(case + "/export")
        saved = torch.load(case + "/expected.pt", weights_only=False)
        assert plan == saved["plan"], (plan, saved["plan"])
        out = run_stages(stages, saved["args"], saved["kwargs"])
        assert type(out) is type(saved["out"]), (type(out), type(saved["out"]))
        assert pytree.tree_structure(out) == pytree.tree_structure(saved["out"])
        for a, b in zip(pytree.tree_leaves(out), pytree.tree_leaves(saved["out"])):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        for st in stages:
            for name, t in list(st.gm.named_parameters()) + list(st.gm.named_buffers()):
                if name in saved["weights"]:  # re-tracing may add _tensor_constantN
                    torch.testing.assert_close(t, saved["weights"][name], rtol=0, atol=0)
        print("OK", case, len(stages))
""")


def _case(tmp: Path, name: str, gm: fx.GraphModule, args: tuple, kwargs: dict | None,
          num_stages: int) -> Path:
    stages = split_graph(gm, chunk_stage_of(gm, num_stages))
    case = tmp / name
    plan = {"stages": num_stages, "model": name}
    export_stages(stages, case / "export", plan_json=plan)
    with torch.no_grad():
        out = run_stages(stages, args, kwargs)
    weights = {k: v.detach().clone() for k, v in gm.state_dict(keep_vars=True).items()}
    torch.save({"args": args, "kwargs": kwargs, "out": out, "plan": plan, "weights": weights},
               case / "expected.pt")
    return case


@pytest.mark.multiprocess
def test_round_trip_in_fresh_process(tmp_path: Path) -> None:
    cnn = ResCNN().eval()
    x = torch.randn(2, 3, 8, 8)
    cases = [_case(tmp_path, "cnn", annotate(fx.symbolic_trace(cnn), x), (x,), None, 3)]
    gpt, ids = TinyGPT(), torch.randint(0, 50, (2, 8))
    cases.append(_case(tmp_path, "gpt", annotate(fx.symbolic_trace(gpt), ids), (ids,), None, 3))
    exported = torch.export.export(gpt, (ids,), strict=False).module()
    cases.append(_case(tmp_path, "gpt_export", exported, (ids,), None, 2))
    text = (tmp_path / "gpt" / "export" / "stage_0.py").read_text()
    assert "from the model input" in text or "model input" in text
    assert "class Stage0(torch.nn.Module)" in text and "def forward(self, idx)" in text
    manifest = json.loads((tmp_path / "gpt" / "export" / "stages.json").read_text())
    assert manifest["stages"][0]["sources"] == [-1]
    res = subprocess.run([sys.executable, "-c", CHILD, *map(str, cases)], cwd=ROOT,
                         capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.count("OK") == len(cases)


def test_in_process_load_keeps_ties_and_training(tmp_path: Path) -> None:
    gpt, ids = TinyGPT(), torch.randint(0, 50, (2, 8))
    gm = annotate(fx.symbolic_trace(gpt), ids)
    stages = split_graph(gm, {k: 0 for k in chunk_stage_of(gm, 1)})
    export_stages(stages, tmp_path / "e")
    plan, loaded = load_exported(tmp_path / "e")
    assert plan is None and len(loaded) == 1
    m = loaded[0].gm
    assert m.lm_head.weight is m.wte.weight and m.training
    torch.testing.assert_close(run_stages(loaded, (ids,))["logits"], gpt(ids)["logits"])


def _export_small(directory: Path) -> None:
    cnn, x = ResCNN(), torch.randn(1, 3, 8, 8)
    gm = fx.symbolic_trace(cnn)
    export_stages(split_graph(gm, chunk_stage_of(gm, 2)), directory, plan_json={"a": 1})


@pytest.mark.parametrize("damage, culprit", [
    (lambda d: (d / "stages.json").unlink(), "stages.json"),
    (lambda d: (d / "stages.json").write_text("{not json"), "stages.json"),
    (lambda d: (d / "stages.json").write_text('{"format": "fxpipe-stages"}'), "stages.json"),
    (lambda d: (d / "plan.json").write_text("[1,"), "plan.json"),
    (lambda d: (d / "stage_1.pt").unlink(), "stage_1.pt"),
    (lambda d: (d / "stage_1.pt").write_bytes(b"garbage"), "stage_1.pt"),
    (lambda d: (d / "stage_0.py").write_text("def broken(:\n"), "stage_0.py"),
    (lambda d: (d / "stage_0.py").unlink(), "stage_0.py"),
])
def test_malformed_files_raise_plan_format_error(tmp_path: Path, damage, culprit: str) -> None:
    d = tmp_path / "e"
    _export_small(d)
    damage(d)
    with pytest.raises(PlanFormatError, match=culprit):
        load_exported(d)


def test_never_clobbers_user_files(tmp_path: Path) -> None:
    d = tmp_path / "e"
    d.mkdir()
    (d / "notes.txt").write_text("mine")
    _export_small(d)
    assert (d / "notes.txt").read_text() == "mine"
    assert not [p for p in d.iterdir() if "tmp" in p.name]
    # a re-export with fewer stages removes its own stale files, nothing else
    cnn = ResCNN()
    gm = fx.symbolic_trace(cnn)
    export_stages(split_graph(gm, chunk_stage_of(gm, 1)), d)
    assert sorted(p.name for p in d.iterdir()) == ["notes.txt", "stage_0.pt", "stage_0.py",
                                                   "stages.json"]
    other = tmp_path / "other"
    other.mkdir()
    (other / "stage_0.py").write_text("# the user's own file")
    with pytest.raises(ConfigError, match="stage_0.py"):
        _export_small(other)
    assert (other / "stage_0.py").read_text() == "# the user's own file"
