"""tests/gpu/one_gpu_check.py on the CPU (``--dry``): every section runs and reports, the
reference executor given a device equals the one without, and the memory section's walked peak
is where the live-tensor counter puts it. This proves the script a lent GPU would run, not the
GPU."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.multiprocess]

ROOT = Path(__file__).resolve().parents[2]


def test_dry_run_reports_every_section(tmp_path: Path) -> None:
    out = tmp_path / "one.md"
    proc = subprocess.run([sys.executable, "-m", "tests.gpu.one_gpu_check", "--dry", "--out",
                           str(out)], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    text = out.read_text()
    for head in ("### 1. Costs", "### 2. The reference executor", "### 3. One stage",
                 "### 4. Memory"):
        assert head in text
    assert "Failed" not in text
    # 2: the replicas on a named device (the CPU here) compute exactly what they do without one
    rows = re.findall(r"^\| [24] \| (?:1f1b-flush|pipedream) \| (\S+) \| (\S+) \|$", text, re.M)
    assert len(rows) == 4 and all(float(a) == 0.0 and float(b) == 0.0 for a, b in rows)
    # 3: a throughput per precision
    spread = r"[\d.]+ \[[\d.]+-[\d.]+\]"  # median [range] of the rounds
    assert len(re.findall(rf"^\| (?:fp32|bf16|fp16) \| {spread} \| {spread} \| [\d.]+ \|$",
                          text, re.M)) == 3
    # 4: measured / walked per schedule and recompute, and gpipe's recomputation saves
    walked = [float(x) for x in re.findall(r"^\| [\w-]+ \| (?:never|always) \|.* \| ([\d.]+) \|$",
                                           text, re.M)]
    assert len(walked) == 10 and all(0.5 < w < 1.5 for w in walked)
    saving = float(re.search(r"gpipe: measured ([\d.]+)", text).group(1))
    assert saving < 0.6
