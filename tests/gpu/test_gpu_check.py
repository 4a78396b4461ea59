"""The distributed runtime on NCCL against the single-process reference (gpu_check.py's checks).

The ``gpu`` tests need 2-4 CUDA GPUs (rank i on cuda:i) and are skipped, saying why, where
``torch.cuda.is_available()`` is false or too few GPUs are visible; select them with
``-m gpu``. The ``test_dry_*`` tests run one case and the Trainer check of the same code path on
gloo/CPU (what ``python -m tests.gpu.gpu_check --dry`` runs for every case): they prove the
check, not the GPU.
"""
from __future__ import annotations

import pytest
import torch

import gpu_check as g

pytestmark = [pytest.mark.multiprocess]

GPUS = g.gpus()
NO_CUDA = "torch.cuda.is_available() is false: the NCCL check needs 2-4 CUDA GPUs"


def _need(ranks: int) -> None:
    if not torch.cuda.is_available():
        pytest.skip(NO_CUDA)
    if GPUS < ranks:
        pytest.skip(f"{GPUS} CUDA GPU(s) visible: this case needs {ranks} (one per rank)")


@pytest.fixture
def exact_math():
    """TF32 off for the test (as gpu_check's main does), restored after."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    g.exact_math()
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


@pytest.mark.gpu
@pytest.mark.parametrize("case", g.CASES, ids=lambda c: f"{c.kind}-{c.name}".replace(" ", "_"))
def test_nccl_case_equals_reference(case: g.Case, exact_math) -> None:
    _need(case.ranks)
    n, width, batch, rtol = g.settings(dry=False)
    res = g.check_case(case, "cuda", n, width, batch, rtol)
    print(f"{case.kind} {list(case.replicas)} {case.name}: {res['messages']} messages, worst "
          f"loss rel. diff {res['worst_loss_rel']:.1e}, {res['samples_per_s']:.0f} samples/s, "
          f"min busy {res['busy']:.2f}")


@pytest.mark.gpu
def test_trainer_under_torchrun_equals_reference(exact_math) -> None:
    _need(2)
    *_, rtol = g.settings(dry=False)
    print(g.check_trainer("cuda", rtol))


def test_dry_case_on_cpu() -> None:
    """One case of the --dry run: run_distributed on gloo against the reference executor, the
    recorded communication through check_logs, the timed longer run."""
    n, width, batch, rtol = g.settings(dry=True)
    res = g.check_case(g.CASES[0], "cpu", n, width, batch, rtol)
    assert res["messages"] > 0


def test_dry_trainer_on_cpu() -> None:
    """The --dry run's last check: the Trainer under torchrun (2 gloo ranks, this file's helper
    run as the script) against the reference executor's state_dict()."""
    *_, rtol = g.settings(dry=True)
    out = g.check_trainer("cpu", rtol)
    assert len(out["loss"]) == 2
