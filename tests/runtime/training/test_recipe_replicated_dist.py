"""The default trainer on replicated plans under torchrun equals plain PyTorch (2 and 3 ranks).

The job (recipe_replicated_job.py) compiles each loss onto plan ``[2]`` (data parallelism, 2
ranks), ``[2, 1]`` or ``[1, 2]`` (3 ranks) and trains it with nothing named; the oracle is
test_recipe_replicated.py's plain PyTorch, one step per loader minibatch."""
from __future__ import annotations

import sys

import pytest
import torch
from test_recipe_replicated import LOSSES, PLANS, plain
from rt_procs import HERE, _port, _run

pytestmark = [pytest.mark.multiprocess]


@pytest.mark.parametrize("plan", list(PLANS))
def test_default_on_torchrun_equals_plain_pytorch(plan: str, tmp_path) -> None:
    nproc = sum(PLANS[plan][1])
    res = _run([sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
                "--master-addr=127.0.0.1", f"--master-port={_port()}",
                str(HERE / "recipe_replicated_job.py"), str(tmp_path), plan, *LOSSES], timeout=400)
    assert res.returncode == 0, res.stdout[-3000:]
    for name, loss in LOSSES.items():
        got = torch.load(tmp_path / f"{name}.pt", weights_only=False)
        assert got["replicas"] == PLANS[plan][1]
        want = plain(loss)
        assert got["state"].keys() == want.keys()
        for k, v in want.items():
            torch.testing.assert_close(got["state"][k], v, rtol=1e-5, atol=1e-5,
                                       msg=f"{name} {k}")
        assert got["recipe"].startswith("schedule: 1f1b-flush, chosen by auto")
        assert f"each minibatch into {nproc} microbatches" in got["recipe"]
