"""Named parameters for the optimizer factory: groups built from model-level names train
exactly as the same groups on the unsplit model (oracle: plain torch written out here)."""
from __future__ import annotations

import copy

import torch
from rt_helpers import split
from rt_tied import TiedLM, ce, token_batches

from fxpipe.runtime.training.param_names import model_names, weight_decay_groups
from fxpipe.runtime.training.trainer import Trainer

TIGHT = dict(rtol=1e-6, atol=1e-7)
seen: list[list[str]] = []


def exempt(name: str) -> bool:
    """No weight decay for biases and the (tied) embedding: a rule only names can express."""
    return name.endswith("bias") or name.startswith("wte")


def adamw(params: list[torch.Tensor], names: list[str]) -> torch.optim.Optimizer:
    seen.append(list(names))
    groups = [{"params": [p for p, n in zip(params, names) if not exempt(n)],
               "weight_decay": 0.5},
              {"params": [p for p, n in zip(params, names) if exempt(n)], "weight_decay": 0.0}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=0.05)


def test_groups_from_names_train_as_eager_with_the_same_groups() -> None:
    data, m = token_batches(8), 4
    model = TiedLM()
    seen.clear()
    trainer = Trainer(split(copy.deepcopy(model), [1, 3]), [1, 1, 1], ce, adamw,
                      schedule="1f1b-flush", microbatches=m, executor="reference",
                      progress=False)
    # one name per tensor, the tied copy on stage 2 under the embedding's name
    assert seen == [["wte.weight"], ["mid.weight", "mid.bias"], ["wte.weight"]]
    trainer.fit(data, epochs=2)
    opt = adamw(*zip(*[(p, n) for n, p in model.named_parameters()]))  # type: ignore[arg-type]
    for _ in range(2):
        for b in range(0, len(data), m):
            opt.zero_grad()
            (sum(ce(model(x), y) for x, y in data[b:b + m]) / m).backward()
            opt.step()
    got = trainer.state_dict()
    for name, p in model.named_parameters():
        torch.testing.assert_close(got[name], p.detach(), **TIGHT, msg=name)


def test_model_level_names_come_from_state_keys() -> None:
    """With a compiled model's state keys, a stage's names are the model's own."""
    stages = split(TiedLM(), [1, 3])
    keys = {"emb.w": (0, "wte.weight"), "proj.w": (1, "mid.weight"), "proj.b": (1, "mid.bias"),
            "head.w": (0, "wte.weight")}
    assert model_names(stages, keys) == {0: ["emb.w"], 1: ["proj.w", "proj.b"], 2: ["emb.w"]}


def test_weight_decay_groups_default_rule_is_nanogpts() -> None:
    w, b = torch.zeros(3, 3), torch.zeros(3)
    groups = weight_decay_groups([w, b], ["a.weight", "a.bias"], 0.1)
    assert [(len(g["params"]), g["weight_decay"]) for g in groups] == [(1, 0.1), (1, 0.0)]
    assert groups[0]["params"][0] is w and groups[1]["params"][0] is b
