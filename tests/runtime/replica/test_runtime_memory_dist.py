"""Measured memory under torchrun (2 gloo ranks, tests/runtime/memory_job.py): the counted peak
per rank against what the schedule holds by hand, measuring changes no bit of training, and the
peaks reach every rank and the metrics.

The job's MLP (64 -> 512 -> 512 -> 8, batch 4) cuts after the first ReLU: stage 0 holds
P0 = 64 * 512 * 4 + 512 * 4 = 133,120 bytes of parameters, stage 1 P1 = 512 * 512 * 4 + 512 * 4
+ 512 * 8 * 4 + 8 * 4 = 1,067,040. Activations are a few 8 KiB tensors (4 x 512 floats), so the
peaks are the weights' multiples, by hand:

- 1f1b-flush, m = 2 (an update sums two minibatches' gradients): weights, momentum, the first
  minibatch's gradients kept as autograd returned them and the second's, added into the first
  in place (they share memory with nothing): 4 P, plus activations (before the sum was made in
  place when the first gradient was known to be unshared, a new tensor for the largest weight
  made it 4 P + W_largest);
- pipedream: weights, momentum, one minibatch's gradients, and on stage 0 one stashed version
  (2 minibatches in flight there): 3 P (4 P on stage 0), plus activations and the optimizer's
  copy-on-write of one weight.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from rt_procs import HERE, _port, _run

pytestmark = [pytest.mark.multiprocess]

P = (64 * 512 * 4 + 512 * 4, 512 * 512 * 4 + 512 * 4 + 512 * 8 * 4 + 8 * 4)
LARGEST = (64 * 512 * 4, 512 * 512 * 4)
SLACK = 64 * 1024  # activations, receive buffers, the loss: a few 8 KiB tensors


def _job(out: Path, *args: str) -> dict:
    res = _run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
                "--master-addr=127.0.0.1", f"--master-port={_port()}",
                str(HERE / "memory_job.py"), str(out), *args])
    assert res.returncode == 0, res.stdout[-3000:]
    return torch.load(out, weights_only=False)


def test_measured_peaks_by_hand_and_measuring_changes_nothing(tmp_path: Path) -> None:
    measured = _job(tmp_path / "m.pt", "--measure")
    plain = _job(tmp_path / "p.pt")
    for name, t in plain["state"].items():  # not a bit of training changes
        assert torch.equal(measured["state"][name], t), name
    assert plain["peaks"] == {} and plain["per_stage"] is None
    assert all("peak_tensor_bytes" not in r for r in plain["metrics"])

    peaks = measured["per_stage"]
    assert measured["peaks"] == {(0, 0): peaks[0], (1, 0): peaks[1]}
    for s in range(2):
        low = 4 * P[s]
        assert low <= peaks[s] <= low + SLACK < low + LARGEST[s], (s, peaks[s], low)
    # every record carries the peak so far; the last one the run's
    assert measured["metrics"][-1]["peak_tensor_bytes"] == peaks
    seen = [r["peak_tensor_bytes"] for r in measured["metrics"]]
    assert all(a[s] <= b[s] for a, b in zip(seen, seen[1:]) for s in range(2))

    pipedream = _job(tmp_path / "d.pt", "--measure", "--schedule", "pipedream")["per_stage"]
    for s, copies in ((0, 4), (1, 3)):
        low = copies * P[s]
        assert low <= pipedream[s] <= low + LARGEST[s] + SLACK, (s, pipedream[s], low)
    # one stretch for the epoch (pipedream streams across segments): a sent tensor goes once
    # the schedule proves it received, so 4x the minibatches hold no more at the peak (when
    # sends were kept to the stretch's end, every minibatch added its 8 KiB activation and
    # gradient: +288 KiB here)
    longer = _job(tmp_path / "l.pt", "--measure", "--schedule", "pipedream",
                  "--minibatches", "24")["per_stage"]
    assert longer == pipedream, (longer, pipedream)
