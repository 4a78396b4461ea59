"""One ablation run: a task, a pipeline depth, a schedule variant, an optimizer and a seed.

Everything runs on fxpipe's reference executor (the single-process oracle of the distributed
runtime), in one schedule over the whole budget, so the asynchronous variants never drain. The
model is scored every ``eval_every`` updates with the weights every stage holds at that moment
(the moment the input stage finishes that many updates; LocalSGD: the replicas' mean).

Samples per update are the same for every variant (the task's batch B): pipedream and its
options update after each minibatch of B; 1f1b-flush, gpipe and 2bw after S microbatches of
B / S; LocalSGD's S replicas each take a local step on B / S samples per round (one round counts
as one update). The k-th update sees the same samples in every variant.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.func import functional_call

import fxpipe
from fxpipe.codegen.split import split_graph
from fxpipe.runtime.schedules.localsgd import make_localsgd_schedule
from fxpipe.runtime.execution.localsgd_executor import LocalSGDExecutor
from fxpipe.runtime.execution.reference import ReferenceExecutor
from fxpipe.runtime.schedules.kinds import make_schedule
from fxpipe.runtime.replica.stage import model_env
from fxpipe.tracing import trace

from .tasks import Task, sgd_lr

VARIANTS = ("1f1b-flush", "gpipe", "2bw", "pipedream", "pipedream-nostash", "pipedream+vsync",
            "localsgd", "pipedream+lr_scale", "pipedream+predict", "pipedream+dc",
            "pipedream+momentum", "pipedream+predict+momentum", "pipedream+nesterov")
MICROBATCHED = ("1f1b-flush", "gpipe", "2bw", "localsgd")
OPTIMIZERS = ("sgd0", "sgd0.5", "sgd0.9", "adamw", "muon")
LOCALSGD_EVERY = 4
# commodity cluster of the time-to-target prediction (see report.py)
CLUSTER = dict(bandwidth="10Gbps", device="cpu", latency=20e-6)


class Diverged(Exception):
    """The loss became NaN or infinite."""


def muon_factory(task: Task, stages: list[Any]) -> Callable[..., torch.optim.Optimizer]:
    """Muon (momentum 0.95, Nesterov, its step scaled to AdamW's RMS so AdamW's lr serves) on
    the 2-D hidden matrices, AdamW as the ``adamw`` runs have it on embeddings, the head, norms
    and biases; by the names of the model's parameters (a stage's are the model's), the head
    found from the model (``embedding_and_head_names``)."""
    from fxpipe.runtime.replica.muon import MuonWithAdamW
    from fxpipe.runtime.training.param_names import embedding_and_head_names, muon_exempt

    not_muon = embedding_and_head_names(task.build())
    names = {s: [n for n, p in st.gm.named_parameters() if p.requires_grad]
             for s, st in enumerate(stages)}

    def make(ps: list[torch.Tensor], stage: int) -> torch.optim.Optimizer:
        rest = [muon_exempt(n, p) or n in not_muon for p, n in zip(ps, names[stage])]
        return MuonWithAdamW([{"params": [p for p, r in zip(ps, rest) if not r]}],
                             [{"params": [p for p, r in zip(ps, rest) if r]}],
                             muon={"lr": task.adamw_lr, "weight_decay": 0.01, "momentum": 0.95,
                                   "nesterov": True, "adjust_lr_fn": "match_rms_adamw"},
                             rest={"lr": task.adamw_lr, "weight_decay": 0.01})
    return make


def optimizer_factory(task: Task, opt: str, stages: list[Any] | None = None
                      ) -> Callable[..., torch.optim.Optimizer]:
    if opt == "adamw":
        return lambda ps: torch.optim.AdamW(ps, lr=task.adamw_lr, weight_decay=0.01)
    if opt == "muon":
        if stages is None:
            raise ValueError("muon needs the stages (its groups are by parameter name)")
        return muon_factory(task, stages)
    m = float(opt[3:])
    return lambda ps: torch.optim.SGD(ps, lr=sgd_lr(task, m), momentum=m)


_ASSIGNMENTS: dict[tuple[str, int], dict[str, int]] = {}


def assignment(task: Task, S: int) -> dict[str, int]:
    """Node -> stage of the S-stage straight plan fxpipe makes for the task on the commodity
    cluster (estimated costs, so it is the same on every machine); made once per (task, S)."""
    key = (task.name, S)
    if key not in _ASSIGNMENTS:
        torch.manual_seed(0)
        compiled = fxpipe.compile(task.build(), fxpipe.Cluster(workers=S, **CLUSTER),
                                  example_inputs=(task.example(task.batch)[0],),
                                  loss_fn=task.loss_fn, stages=S, straight=True,
                                  tracer="symbolic_trace")
        _ASSIGNMENTS[key] = compiled.plan.stage_of()
    return _ASSIGNMENTS[key]


def stages_for(task: Task, S: int, seed: int) -> list[Any]:
    torch.manual_seed(seed)
    model = task.build()
    traced = trace(model, (task.example(2)[0],), method="symbolic_trace")
    return split_graph(traced.gm, assignment(task, S))


def forward_fn(stages: list[Any], weights: list[dict], buffers: list[dict]
               ) -> Callable[[torch.Tensor], torch.Tensor]:
    """The model's forward with the given per-stage weights and buffers (evaluation mode)."""
    def forward(x: torch.Tensor) -> torch.Tensor:
        env = model_env(stages, x)
        for st, w, b in zip(stages, weights, buffers):
            mode = st.gm.training
            st.gm.eval()
            try:
                out = functional_call(st.gm, {**w, **b}, tuple(env[n] for n in st.inputs))
            finally:
                st.gm.train(mode)
            env.update(zip(st.outputs, out))
        last = stages[-1]
        return last.io.build_output({n: env[n] for n in last.outputs})
    return forward


def _scored(base: type, task: Task, evals: list[tuple[int, float]], S: int) -> type:
    """``base`` executor that scores the model after every ``eval_every``-th input-stage update."""
    class Scored(base):  # type: ignore[misc, valid-type]
        def _update(self, ranks: list, recs: dict, *args: Any) -> None:
            super()._update(ranks, recs, *args)
            if ranks[0][0] != 0:
                return
            u = self.workers[ranks[0]].stash.version
            if u % task.eval_every and u != self._budget:
                return
            reps = self.replicas[0]
            weights, buffers = [], []
            for s in range(S):
                ws = [self.workers[(s, j)] for j in range(reps)]
                weights.append({n: torch.stack([w.stash.latest[n].detach() for w in ws]).mean(0)
                                for n in ws[0].stash.latest})
                buffers.append(ws[0].buffers)
            value = task.evaluate(forward_fn(self.stages, weights, buffers))
            if not math.isfinite(value) or not all(bool(t.isfinite().all()) for w in weights
                                                   for t in w.values()):
                raise Diverged(f"metric {value} after {u} updates")
            evals.append((u, value))
    return Scored


@dataclass
class Run:
    task: str
    S: int
    variant: str
    opt: str
    seed: int

    @property
    def key(self) -> str:
        return f"{self.task}|{self.S}|{self.variant}|{self.opt}|{self.seed}"


def run_one(task: Task, run: Run) -> dict[str, Any]:
    """Train one configuration; returns its record (evaluations, final metric, time)."""
    S, v = run.S, run.variant
    stages = stages_for(task, S, run.seed)
    evals: list[tuple[int, float]] = [(0, task.evaluate(forward_fn(
        stages, [dict(st.gm.named_parameters()) for st in stages],
        [dict(st.gm.named_buffers()) for st in stages])))]
    micro = v in MICROBATCHED
    if micro and task.batch % S:
        raise ValueError(f"batch {task.batch} is not a multiple of S={S}")
    size, count = (task.batch // S, task.updates * S) if micro else (task.batch, task.updates)
    data = task.minibatches(run.seed, size, count)
    factory = optimizer_factory(task, run.opt, stages)
    t0 = time.perf_counter()
    if v == "localsgd":
        ex: Any = _scored(LocalSGDExecutor, task, evals, S)(
            stages, make_localsgd_schedule(S, S, count, average_every=LOCALSGD_EVERY),
            task.loss_fn, factory)
    else:
        kind, _, extra = v.replace("-nostash", "").partition("+")
        sched = make_schedule(kind, [1] * S, count, microbatches=S if micro else None)
        ex = _scored(ReferenceExecutor, task, evals, S)(
            stages, [1] * S, sched, task.loss_fn, factory, stashing=not v.endswith("-nostash"),
            vertical_sync=extra == "vsync",
            mitigation=extra if extra not in ("", "vsync") else None)
    ex._budget = task.updates
    diverged = None
    losses: list[float] = []
    try:
        losses = ex.run(data).losses
    except Diverged as err:
        diverged = str(err)
    per = S if micro else 1  # minibatch losses -> one mean per update
    per_update = [sum(losses[i:i + per]) / per for i in range(0, len(losses) - per + 1, per)]
    train = [x for x in losses if math.isfinite(x)]
    return {"key": run.key, "task": run.task, "S": S, "variant": v, "opt": run.opt,
            "seed": run.seed, "evals": evals, "final": evals[-1][1], "diverged": diverged,
            "train_loss_last10pct": (sum(train[-max(1, len(train) // 10):]) /
                                     max(1, len(train[-max(1, len(train) // 10):]))
                                     if train else None),
            "train_losses": [round(x, 5) if math.isfinite(x) else None for x in per_update],
            "seconds": round(time.perf_counter() - t0, 2),
            "torch": torch.__version__}
