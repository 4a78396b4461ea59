"""Stale-weight SGD written as plain PyTorch loops: the oracles for the pipelined schedules.

Nothing here imports fxpipe (no schedule, stash, stage or executor): each function is the
training rule a schedule is supposed to implement, from its paper, applied to ``tiny_mlp`` (or
``TiedLM``) written out functionally. The tests compare fxpipe's reference executor with these in
float64, so a wrong weight version anywhere shows up as a difference of order lr * gradient,
far above rounding.

Notation: ``hist[s][j]`` = stage s's weights after j of its updates (version j). ``layer_stage``
gives the stage of each of tiny_mlp's five layers (0: Linear, 1: Tanh, 2: Linear, 3: Tanh,
4: Linear), written out per test from the cuts.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import torch
import torch.nn.functional as F

Weights = dict[str, torch.Tensor]
Batch = tuple[torch.Tensor, torch.Tensor]
LINEAR = (0, 2, 4)


def mlp(w: Weights, x: torch.Tensor, layers: Sequence[int] = range(5)) -> torch.Tensor:
    """tiny_mlp's forward through ``layers`` (in order) with weights ``w``."""
    for i in layers:
        x = F.linear(x, w[f"{i}.weight"], w[f"{i}.bias"]) if i in LINEAR else torch.tanh(x)
    return x


def mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out - y) ** 2).mean()


def names_of(stage: int, layer_stage: Sequence[int]) -> list[str]:
    return [f"{i}.{p}" for i in LINEAR if layer_stage[i] == stage for p in ("weight", "bias")]


def _grads(w: Weights, x: torch.Tensor, y: torch.Tensor) -> tuple[float, Weights]:
    leaves = {n: t.detach().clone().requires_grad_(True) for n, t in w.items()}
    loss = mse(mlp(leaves, x), y)
    gs = torch.autograd.grad(loss, list(leaves.values()))
    return float(loss.detach()), dict(zip(leaves, gs))


def pipedream_sgd(w0: Weights, layer_stage: Sequence[int], replicas: Sequence[int],
                  data: Sequence[Batch], lr: float, *, vertical_sync: bool = False
                  ) -> tuple[list[float], Weights]:
    """PipeDream's asynchronous 1F1B with weight stashing (Harlap et al. section 3.3).

    Stage s has r_s replicas; minibatch k goes to replica k mod r_s, as that replica's
    i = k div r_s -th minibatch. A replica admits w_s = ceil(workers of stages s.. / r_s)
    minibatches (NOAM for stage 0), then alternates one backward, one forward; the replicas of a
    stage update together after each round of r_s minibatches (update g averages the gradients of
    minibatches g r_s .. g r_s + r_s - 1). So the i-th forward of a replica comes after
    max(0, i - w_s + 1) of its backwards and reads version v_s(k) = max(0, i - w_s + 1); the
    backward uses the same version (stashing). With ``vertical_sync`` every stage uses the
    version stage 0 read for that minibatch (equal replica counts, so versions are comparable).
    """
    S = len(replicas)
    window = [math.ceil(sum(replicas[s:]) / replicas[s]) for s in range(S)]
    hist = [[{n: w0[n] for n in names_of(s, layer_stage)}] for s in range(S)]
    pending: list[Weights] = [{} for _ in range(S)]
    losses = []

    def version(s: int, k: int) -> int:
        return max(0, k // replicas[s] - window[s] + 1)

    for k, (x, y) in enumerate(data):
        used: Weights = {}
        for s in range(S):
            v = version(0 if vertical_sync else s, k)
            used.update(hist[s][v])
        loss, g = _grads(used, x, y)
        losses.append(loss)
        for s in range(S):
            for n in hist[s][0]:
                pending[s][n] = pending[s][n] + g[n] if n in pending[s] else g[n]
            if k % replicas[s] == replicas[s] - 1:  # the round of r_s minibatches is complete
                latest = hist[s][-1]
                hist[s].append({n: latest[n] - lr * pending[s][n] / replicas[s]
                                for n in latest})
                pending[s] = {}
    final: Weights = {}
    for s in range(S):
        final.update(hist[s][-1])
    return losses, final


def two_bw_sgd(w0: Weights, data: Sequence[Batch], m: int, lr: float
               ) -> tuple[list[float], Weights]:
    """PipeDream-2BW (Narayanan et al. 2021, section 3.1): batches of m microbatches, and
    W(t+1) = W(t) - lr * grad f(W(t-1)) with W(-1) = W(0): every microbatch of batch t, on every
    stage, runs forward and backward on W(t-1), and the mean of its gradients updates W(t).
    While batch t runs only W(t-1) and W(t) exist: two versions ("2BW")."""
    hist = [dict(w0)]
    losses: list[float] = []
    for t in range(len(data) // m):
        used = hist[max(0, t - 1)]
        total: Weights = {}
        for x, y in data[t * m:(t + 1) * m]:
            loss, g = _grads(used, x, y)
            losses.append(loss)
            total = {n: total[n] + g[n] for n in g} if total else g
        hist.append({n: hist[t][n] - lr * total[n] / m for n in hist[t]})
    return losses, hist[-1]


def no_stash_sgd(w0: Weights, layer_stage: Sequence[int], data: Sequence[Batch], lr: float
                 ) -> tuple[list[float], Weights]:
    """1F1B on a straight pipeline WITHOUT weight stashing (PipeDream's ablation, section 5.5).

    Stage s's forward of minibatch k reads the latest weights then, version max(0, k-(S-1-s));
    its backward comes after k updates of the stage and uses version k: it recomputes the
    stage's forward with those weights on the input the forward received, and back-propagates
    the gradient the next stage sent (itself computed with that stage's version k)."""
    S = max(layer_stage) + 1
    layers = [[i for i in range(5) if layer_stage[i] == s] for s in range(S)]
    hist = [[{n: w0[n] for n in names_of(s, layer_stage)}] for s in range(S)]
    losses = []
    for k, (x, y) in enumerate(data):
        acts = [x]
        with torch.no_grad():
            for s in range(S):
                acts.append(mlp(hist[s][max(0, k - (S - 1 - s))], acts[s], layers[s]))
            losses.append(float(mse(acts[S], y)))
        grad_out: torch.Tensor | None = None
        for s in reversed(range(S)):
            w = {n: t.detach().clone().requires_grad_(True) for n, t in hist[s][k].items()}
            inp = acts[s].detach().requires_grad_(s > 0)
            out = mlp(w, inp, layers[s])
            wrt = ([inp] if s > 0 else []) + list(w.values())
            if s == S - 1:
                gs = torch.autograd.grad(mse(out, y), wrt)
            else:
                gs = torch.autograd.grad(out, wrt, grad_out)
            grad_out = gs[0] if s > 0 else None
            pg = dict(zip(w, gs[1:] if s > 0 else gs))
            hist[s].append({n: hist[s][k][n] - lr * pg[n] for n in w})
    final: Weights = {}
    for s in range(S):
        final.update(hist[s][-1])
    return losses, final


def plain_sgd(w0: Weights, data: Sequence[Batch], lr: float, m: int = 1
              ) -> tuple[list[float], Weights]:
    """Synchronous SGD, one step per group of m minibatches on the mean of their gradients."""
    w = dict(w0)
    losses = []
    for t in range(0, len(data), m):
        total: Weights = {}
        for x, y in data[t:t + m]:
            loss, g = _grads(w, x, y)
            losses.append(loss)
            total = {n: total[n] + g[n] for n in g} if total else g
        w = {n: w[n] - lr * total[n] / len(data[t:t + m]) for n in w}
    return losses, w


def tied_lm_pipedream_sgd(w0: Weights, data: Sequence[Batch], lr: float, momentum: float, *,
                          tied: bool = True, delay: int = 2) -> tuple[list[float], Weights]:
    """TiedLM (wte -> mid -> tanh -> lm_head, lm_head.weight IS wte.weight) on three straight
    pipedream stages (wte | mid, tanh | lm_head), SGD with momentum written out.

    Stage s is 2 - s updates stale: minibatch k reads stage s's version max(0, k - (2 - s)). The
    embedding is one logical parameter used on stages 0 and 2: round j's gradient is the SUM of
    the two uses' gradients for minibatch j (each use differentiated at the version its stage
    read). Under pipedream that sum is applied ``delay`` updates late (the difference of the
    in-flight windows of the two stages holding it, 3 - 1 = 2 here): a holder's update i steps
    the embedding with round i - delay (nothing before update ``delay``), and the last ``delay``
    rounds are applied at the end of the run as embedding-only steps. So after v updates a copy
    has taken rounds 0 .. v - delay - 1, in order, through its momentum buffer; both copies take
    the same rounds and stay equal. Final weights: every round applied.

    ``tied=False`` is the counterfactual of two separate parameters, each stepped with its own
    use's gradient at every update (no sum, no delay)."""
    E0, mid_w, mid_b = w0["wte.weight"], w0["mid.weight"], w0["mid.bias"]
    d = delay if tied else 0
    # emb[s][u] = stage s's embedding copy after u rounds; mids[v] = stage 1 after v updates
    emb: list[list[torch.Tensor]] = [[E0], [], [E0]]
    ebuf: list[torch.Tensor | None] = [None, None, None]
    mids = [(mid_w, mid_b)]
    mbuf: list[torch.Tensor] = []
    rounds: list[list[torch.Tensor]] = [[], [], []]  # per holder: the gradient of each round

    def step_embedding(s: int) -> None:
        g = rounds[s][len(emb[s]) - 1]
        ebuf[s] = g.clone() if ebuf[s] is None else momentum * ebuf[s] + g
        emb[s].append(emb[s][-1] - lr * ebuf[s])

    losses = []
    for k, (idx, tgt) in enumerate(data):
        v = [max(0, k - (2 - s)) for s in range(3)]   # version (updates) each stage reads
        E_0 = emb[0][max(0, v[0] - d)].detach().clone().requires_grad_(True)
        mw, mb = (t.detach().clone().requires_grad_(True) for t in mids[v[1]])
        E_2 = emb[2][max(0, v[2] - d)].detach().clone().requires_grad_(True)
        h = torch.tanh(F.linear(F.embedding(idx, E_0), mw, mb))      # (batch, seq, hidden)
        loss = F.cross_entropy(F.linear(h, E_2), tgt)
        losses.append(float(loss.detach()))
        g0, gmw, gmb, g2 = torch.autograd.grad(loss, [E_0, mw, mb, E_2])
        rounds[0].append(g0 + g2 if tied else g0)
        rounds[2].append(g0 + g2 if tied else g2)
        # update k of every stage: the middle stage's own step, the embedding's round k - d
        mbuf = [g.clone() for g in (gmw, gmb)] if not mbuf else \
            [momentum * b + g for b, g in zip(mbuf, (gmw, gmb))]
        mids.append(tuple(t - lr * b for t, b in zip(mids[-1], mbuf)))
        for s in (0, 2):
            if k - d >= 0:
                step_embedding(s)
    for s in (0, 2):  # the end of the run: the last d rounds, embedding-only steps
        while len(emb[s]) - 1 < len(data):
            step_embedding(s)
    out = {"wte.weight": emb[0][-1], "mid.weight": mids[-1][0], "mid.bias": mids[-1][1],
           "lm_head.weight": emb[2][-1]}
    return losses, out


def double(data: Sequence[tuple[Any, Any]]) -> list[tuple[Any, Any]]:
    """Float64 copies of float batches (integer token batches are returned as they are)."""
    return [tuple(t.double() if t.is_floating_point() else t for t in b) for b in data]
