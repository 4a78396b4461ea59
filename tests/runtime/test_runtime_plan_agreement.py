"""Ranks that planned differently fail at start on every rank, with the remedy, not a hang."""
from __future__ import annotations

import sys

from test_runtime_trainer_dist import HERE, _port, _run


def test_ranks_with_different_plans_all_fail_at_start() -> None:
    res = _run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
                "--master-addr=127.0.0.1", f"--master-port={_port()}",
                str(HERE / "plan_disagree_job.py")], timeout=120)
    assert res.returncode != 0
    for rank in (0, 1):
        assert f"rank {rank}: ranks [1] planned a different pipeline than rank 0" in res.stdout
    assert "Plan.load" in res.stdout and "no error" not in res.stdout
