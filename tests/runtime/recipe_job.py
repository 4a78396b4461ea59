"""The default trainer on 2 torchrun ranks, for tests/runtime/training/test_recipe_dist.py.

    torchrun --nproc-per-node 2 recipe_job.py OUT_DIR CASE [CASE ...]

Each CASE (see :data:`CASES`: a model, its loader, its loss) is compiled on every rank into 2
stages and trained with ``compiled.trainer(optimizer=...)`` and nothing else named: the default
schedule ("auto"), the distributed executor. Rank 0 writes ``OUT_DIR/CASE.pt`` with the trained
state dict, the history and what fit said it trains. The models and data are built here so the
test's plain-PyTorch oracle trains on exactly the same ones.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn as nn


def sgd(ps: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(ps, lr=0.05, momentum=0.9)


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                         nn.Linear(16, 3))


def _sum_data() -> list:
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(23, 4, generator=g), torch.randint(0, 3, (23,), generator=g)
    return [(x[i:i + 5], y[i:i + 5]) for i in range(0, 23, 5)]  # 5, 5, 5, 5, 3


class TimeMajor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.rnn, self.head = nn.LSTM(3, 8), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(x)
        return self.head(torch.tanh(out[-1]))


def _lstm_data() -> list:
    g = torch.Generator().manual_seed(5)
    return [(torch.randn(4, 4, 3, generator=g), torch.randint(0, 2, (4,), generator=g))
            for _ in range(5)]  # T == B == 4


def _llama() -> nn.Module:
    import transformers

    transformers.utils.logging.set_verbosity_error()
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=50, max_position_embeddings=64))


def _lm_data() -> list:
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(4):
        ids = torch.randint(0, 50, (4, 8), generator=g)
        lengths = torch.randint(2, 9, (4,), generator=g)
        mask = torch.arange(8)[None] < lengths[:, None]
        out.append(({"input_ids": ids, "attention_mask": mask.long(),
                     "labels": ids.masked_fill(~mask, -100)}, None))
    return out


def hf_loss(out: Any, target: Any) -> torch.Tensor:
    return out["loss"] if isinstance(out, dict) else out.loss


CASES: dict[str, tuple[Callable[[], nn.Module], Callable[[], list], Any]] = {
    "sum": (_mlp, _sum_data, nn.CrossEntropyLoss(reduction="sum")),
    "lstm": (TimeMajor, _lstm_data, nn.CrossEntropyLoss()),
    "llama": (_llama, _lm_data, None),  # the model's own loss (labels in the batch)
}


def main() -> None:
    import fxpipe

    out, names = Path(sys.argv[1]), sys.argv[2:]
    torch.set_num_threads(1)
    for name in names:
        make_model, make_data, loss = CASES[name]
        data = make_data()
        example = data[0][0] if isinstance(data[0][0], dict) else (data[0][0],)
        compiled = fxpipe.compile(make_model(), fxpipe.Cluster.from_env(), example_inputs=example,
                                  loss_fn=loss, stages=2, straight=True, repeats=1)
        trainer = compiled.trainer(optimizer=sgd, progress=False, timeout_s=60)
        history = trainer.fit(data)
        state = trainer.state_dict()
        if trainer.index == 0:
            torch.save({"state": state, "history": history,
                        "recipe": getattr(compiled, "recipe", "")}, out / f"{name}.pt")
        trainer.close()


if __name__ == "__main__":
    main()
