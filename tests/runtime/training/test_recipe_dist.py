"""The default trainer on 2 torchrun ranks equals plain PyTorch (issue 23): a sum loss over an
uneven cut and a short last minibatch, a time-major nn.LSTM with T == B, and a Hugging Face
Llama (torch.export graph, its batch dimension free) with -100 padding of uneven length. The
job (recipe_job.py) names no schedule; the oracle below is plain PyTorch, one optimizer step
per minibatch, on the same models and data."""
from __future__ import annotations

import sys

import pytest
import torch
from recipe_job import CASES, sgd
from rt_procs import HERE, _port, _run

pytestmark = [pytest.mark.multiprocess]


def plain(name: str) -> dict[str, torch.Tensor]:
    make_model, make_data, loss = CASES[name]
    model = make_model()
    opt = sgd(model.parameters())
    for x, y in make_data():
        opt.zero_grad()
        out = model(**x) if isinstance(x, dict) else model(x)
        (loss(out, y) if loss is not None else out.loss).backward()
        opt.step()
    return model.state_dict()


@pytest.mark.parametrize("name", ["sum", "lstm", "llama"])
def test_default_trainer_on_two_ranks_equals_plain_pytorch(name: str, tmp_path) -> None:
    if name == "llama":
        pytest.importorskip("transformers")
    res = _run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
                "--master-addr=127.0.0.1", f"--master-port={_port()}",
                str(HERE / "recipe_job.py"), str(tmp_path), name])
    assert res.returncode == 0, res.stdout[-3000:]
    got = torch.load(tmp_path / f"{name}.pt", weights_only=False)
    want = plain(name)
    assert got["state"].keys() == want.keys()
    for k, v in want.items():
        torch.testing.assert_close(got["state"][k], v, rtol=2e-5, atol=2e-5)
    assert "schedule: 1f1b-flush, chosen by auto" in got["recipe"]
    assert "each minibatch into 2 microbatches" in got["recipe"]
