"""Shared helpers for the codegen tests: fxpipe metadata, stage assignment, tiny models.

A plain module (imported as ``_codegen_helpers``; pytest puts this folder on sys.path) because
tests/ has no packages and ``conftest`` names clash across folders."""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from fxpipe.codegen.split import placed_nodes, value_kind

_STATIC = (int, float, bool, type(None), torch.Size)


def _static(v: Any) -> bool:
    if isinstance(v, (tuple, list)) and not isinstance(v, torch.Size):
        return all(_static(x) for x in v)
    return isinstance(v, _STATIC)


def _nbytes(v: Any) -> int:
    if isinstance(v, torch.Tensor):
        return v.numel() * v.element_size()
    if isinstance(v, (tuple, list)):
        return sum(_nbytes(x) for x in v)
    return 0


class _Recorder(fx.Interpreter):
    def run_node(self, n: fx.Node) -> Any:
        out = super().run_node(n)
        meta: dict[str, Any] = {"bytes": _nbytes(out), "is_tensor": isinstance(out, torch.Tensor),
                                "shape": tuple(out.shape) if isinstance(out, torch.Tensor) else None}
        if isinstance(out, torch.Tensor):
            meta["sendable"] = True
        elif _static(out):
            meta["static_value"] = out
            meta["sendable"] = True
        else:
            meta["sendable"] = False
        n.meta["fxpipe"] = meta
        return out


def annotate(gm: fx.GraphModule, *flat_args: Any) -> fx.GraphModule:
    """Fill node.meta["fxpipe"] like tracing.shapes would (runs the graph once, no grad)."""
    with torch.no_grad():
        _Recorder(gm).run(*flat_args)
    return gm


def chunk_stage_of(gm: fx.GraphModule, num_stages: int) -> dict[str, int]:
    """Contiguous chunks of program order, never cutting while an unsendable value is live."""
    nodes = placed_nodes(gm)
    stage = {n.name: min(i * num_stages // len(nodes), num_stages - 1) for i, n in enumerate(nodes)}
    for n in nodes:  # consumers of a tuple of tensors join its producer's stage
        for inp in n.all_input_nodes:
            if inp.name in stage and inp.op != "placeholder" and value_kind(inp)[0] == "unsendable":
                stage[n.name] = stage[inp.name]
        ins = [stage[i.name] for i in n.all_input_nodes if i.name in stage]
        stage[n.name] = max([stage[n.name]] + ins)
    used = sorted(set(stage.values()))
    renum = {s: i for i, s in enumerate(used)}
    return {k: renum[v] for k, v in stage.items()}


class ResCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.bn1(self.conv1(x)))
        h = F.relu(self.conv2(h) + h)
        return self.fc(torch.flatten(self.pool(h), 1))


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 16), nn.GELU(),
                                    nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


class Reused(nn.Module):
    """The same Linear applied at two depths."""

    def __init__(self) -> None:
        super().__init__()
        self.fc0, self.shared, self.fc1, self.fc2 = (nn.Linear(8, 8) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.shared(self.fc0(x)))
        x = torch.relu(self.fc1(x))
        x = torch.sigmoid(self.shared(x))
        return self.fc2(x)


class Block(nn.Module):
    def __init__(self, c: int, heads: int, t: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(c), nn.LayerNorm(c)
        self.qkv, self.proj = nn.Linear(c, 3 * c), nn.Linear(c, c)
        self.fc, self.out = nn.Linear(c, 4 * c), nn.Linear(4 * c, c)
        self.heads, self.scale = heads, 1.0 / math.sqrt(c // heads)
        self.register_buffer("mask", torch.tril(torch.ones(t, t)).view(1, 1, t, t))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.size(0), x.size(1), x.size(2)
        parts = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (p.view(b, t, self.heads, c // self.heads).transpose(1, 2)
                   for p in (parts[0], parts[1], parts[2]))
        att = (q @ k.transpose(-2, -1)) * self.scale
        att = att.masked_fill(self.mask == 0, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(b, t, c)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TinyGPT(nn.Module):
    """Tied input/output embeddings: wte (first stage) and lm_head (last stage) share a weight."""

    def __init__(self, vocab: int = 50, c: int = 16, t: int = 8, layers: int = 2) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, c), nn.Embedding(t, c)
        self.blocks = nn.ModuleList(Block(c, 2, t) for _ in range(layers))
        self.ln_f = nn.LayerNorm(c)
        self.lm_head = nn.Linear(c, vocab, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor) -> dict[str, torch.Tensor]:
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for blk in self.blocks:
            x = blk(x)
        logits = self.lm_head(self.ln_f(x))
        return {"logits": logits, "hidden": x}
