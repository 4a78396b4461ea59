"""torchrun multi-node rendezvous across the emulated hosts: a 2-process gloo all_reduce.

Needs network namespaces (root / CAP_NET_ADMIN and iproute2); skips with the reason otherwise.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tools.cluster import (EmulatedCluster, can_create_namespaces, read_output,  # noqa: E402
                           torchrun_across, wait_all)

pytestmark = [pytest.mark.multiprocess]

_OK, _WHY = can_create_namespaces()

SCRIPT = """
import torch, torch.distributed as dist
dist.init_process_group("gloo")
rank = dist.get_rank()
t = torch.full((1000,), float(rank + 1))
dist.all_reduce(t)
print(f"RESULT rank={rank} world={dist.get_world_size()} sum={t[0].item()} ok={bool((t == t[0]).all())}",
      flush=True)
dist.destroy_process_group()
"""


@pytest.mark.skipif(not _OK, reason=f"emulated cluster unavailable: {_WHY}")
def test_gloo_all_reduce_across_hosts(tmp_path: Path) -> None:
    script = tmp_path / "allreduce.py"
    script.write_text(SCRIPT)
    with EmulatedCluster(2, bandwidth="50Mbit", latency="0.5ms", prefix="fxptr") as c:
        before = [c.link_bytes(h)["tx_bytes"] for h in range(2)]
        procs = torchrun_across(c, [str(script)], log_dir=tmp_path / "logs")
        codes = wait_all(procs, timeout=120)
        outs = [read_output(p) for p in procs]
        assert codes == [0, 0], outs
        for rank, out in enumerate(outs):
            assert f"RESULT rank={rank} world=2 sum=3.0 ok=True" in out, out
        # rendezvous and the all-reduce really crossed the emulated links
        assert all(c.link_bytes(h)["tx_bytes"] - before[h] > 4000 for h in range(2))
