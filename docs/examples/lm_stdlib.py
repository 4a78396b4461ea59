"""A small GPT language model on the Python standard library's own source, as bytes: the model
and data factories of the ``fxpipe train`` demonstration (README, benchmarks/lm_demo.md).

    fxpipe train docs/examples/lm_stdlib.py:model --data docs/examples/lm_stdlib.py:loaders ...

Every rank calls the same factories and gets the same data: the corpus is the first
``CORPUS_BYTES`` bytes of the standard library's ``.py`` files in sorted path order (a fixed
text on a given Python version); the last 10% is the validation split. A training "epoch" is
``STEPS`` updates of randomly drawn windows (a ``RandomSampler`` with replacement, which draws
its order from torch's global generator, seeded by the trainer per epoch identically on every
rank); validation is a fixed set of windows, in minibatches of the training size (a traced graph
has fixed shapes). ``loaders`` yields microbatches of ``MICRO``
sequences (4 per update under 1f1b-flush); ``loaders_full`` yields the same samples in
minibatches of ``MICRO * 4`` (one per update under pipedream).
"""
from __future__ import annotations

import sysconfig
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, RandomSampler

from fxpipe.models import ModelSpec
from fxpipe.models.gpt import GPT

CORPUS_BYTES = 1 << 20
SEQ = 32
MICRO = 8
ACCUM = 4  # microbatches per update
STEPS = 15  # updates per epoch
VAL_WINDOWS = 64


def corpus() -> torch.Tensor:
    """The corpus as a uint8 tensor (bytes 0..255 are the vocabulary)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out, size = [], 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        out.append(data)
        size += len(data)
        if size >= CORPUS_BYTES:
            break
    return torch.frombuffer(bytearray(b"".join(out)[:CORPUS_BYTES]), dtype=torch.uint8)


class Windows(Dataset):
    """Sample i: tokens [i*SEQ, i*SEQ + SEQ) as inputs, shifted by one as targets."""

    def __init__(self, data: torch.Tensor) -> None:
        self.data = data.long()

    def __len__(self) -> int:
        return (len(self.data) - 1) // SEQ

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.data[i * SEQ:i * SEQ + SEQ + 1]
        return chunk[:-1], chunk[1:]


def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), target.reshape(-1))


def _model(batch: int) -> ModelSpec:
    """The traced graph fixes the batch size (the attention's reshapes): one per loader."""
    torch.manual_seed(0)
    gpt = GPT(vocab_size=256, block_size=SEQ, n_layer=4, n_head=4, n_embd=32)
    x = torch.zeros(batch, SEQ, dtype=torch.long)
    return ModelSpec(name="gpt-stdlib", size="custom", model=gpt, example_inputs=(x,),
                     loss_fn=lm_loss, make_batch=None, batch_size=batch)


def model() -> ModelSpec:
    """For :func:`loaders` (microbatches of MICRO sequences)."""
    return _model(MICRO)


def model_full() -> ModelSpec:
    """For :func:`loaders_full` (minibatches of MICRO * ACCUM sequences)."""
    return _model(MICRO * ACCUM)


def _splits() -> tuple[Windows, Windows]:
    data = corpus()
    cut = len(data) * 9 // 10
    return Windows(data[:cut]), Windows(data[cut:])


def _make(batch: int) -> tuple[DataLoader, DataLoader]:
    train, val = _splits()
    sampler = RandomSampler(train, replacement=True, num_samples=STEPS * ACCUM * MICRO)
    val_idx = list(range(min(VAL_WINDOWS, len(val))))
    return (DataLoader(train, batch_size=batch, sampler=sampler, drop_last=True),
            DataLoader(torch.utils.data.Subset(val, val_idx), batch_size=batch))


def loaders() -> tuple[DataLoader, DataLoader]:
    """Microbatches of MICRO sequences (ACCUM per update: 1f1b-flush, eager accumulation)."""
    return _make(MICRO)


def loaders_full() -> tuple[DataLoader, DataLoader]:
    """The same samples in minibatches of MICRO * ACCUM (one per update: pipedream)."""
    return _make(MICRO * ACCUM)
