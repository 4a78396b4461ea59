"""`fxpipe.compile`: trace, cost, partition and split an unmodified nn.Module.

    compiled = fxpipe.compile(model, fxpipe.Cluster(workers=8, bandwidth="10Gbps"),
                              example_inputs=(x,), loss_fn=F.cross_entropy)
    compiled.plan.summary(); compiled(x); compiled.export("out/"); compiled.visualize("p.svg")

The pipeline of phases is linear and each phase only records on ``node.meta["fxpipe"]`` or returns
a frozen report; this module wires them together and owns nothing but the glue.
"""
from __future__ import annotations

import copy
import hashlib
import logging
import os
from dataclasses import replace
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import nn

from fxpipe.codegen import StageSpec, draw_plan, export_stages, load_exported, run_stages, split_graph
from fxpipe.costmodel import Cluster, Profile, estimate_graph, get_device, profile_graph, to_profile
from fxpipe.errors import ConfigError, PlanFormatError
from fxpipe.passes import Plan, partition
from fxpipe.tracing import TracedGraph, trace

log = logging.getLogger("fxpipe")

LossFn = Callable[[Any, Any], torch.Tensor]


def model_fingerprint(gm: torch.fx.GraphModule) -> str:
    """A hash of the graph's structure and parameter shapes: ties a plan to the model it was made
    for, so a plan cannot be silently applied to a different model."""
    h = hashlib.sha256()
    for node in gm.graph.nodes:
        h.update(f"{node.op}|{node.name}|{getattr(node.target, '__name__', node.target)}\n".encode())
    for name, p in gm.named_parameters():
        h.update(f"{name}:{tuple(p.shape)}:{p.dtype}\n".encode())
    return h.hexdigest()[:16]


def _batch_size(example_inputs: tuple[Any, ...]) -> int | None:
    for x in example_inputs:
        if isinstance(x, torch.Tensor) and x.dim() > 0:
            return int(x.shape[0])
    return None


def _as_cluster(cluster: Cluster | int | None) -> Cluster:
    if cluster is None:
        return Cluster(workers=1)
    if isinstance(cluster, Cluster):
        return cluster
    if isinstance(cluster, int) and not isinstance(cluster, bool):
        return Cluster(workers=cluster)
    raise ConfigError(f"cluster must be an fxpipe.Cluster or a number of workers, got {cluster!r}",
                      "e.g. fxpipe.Cluster(workers=8, bandwidth='10Gbps')")


def stage_assignment(plan: Plan) -> dict[str, int]:
    """Node name -> stage index, from a plan (the decision; graph surgery is codegen's)."""
    return {name: st.index for st in plan.stages for name in st.nodes}


class CompiledModel:
    """The result of :func:`compile`: a plan plus the stage GraphModules that realise it.

    Calling it runs the stages in order in this process (the same numbers as the model). The
    stages hold the model's own Parameter objects, so gradients land on the user's model.
    """

    def __init__(self, model: nn.Module, traced: TracedGraph, profile: Profile, plan: Plan,
                 specs: list[StageSpec], loss_fn: LossFn | None, cluster: Cluster) -> None:
        self.model = model
        self.traced = traced
        self.profile = profile
        self.plan = plan
        self.stage_specs = specs
        self.loss_fn = loss_fn
        self.cluster = cluster

    # --- running in this process -------------------------------------------------------------
    @property
    def stages(self) -> list[torch.fx.GraphModule]:
        return [s.gm for s in self.stage_specs]

    def __call__(self, *args: Any) -> Any:
        return run_stages(self.stage_specs, args)

    def loss(self, *args: Any, target: Any) -> torch.Tensor:
        """The training loss, computed in the last stage as the runtime does."""
        if self.loss_fn is None:
            raise ConfigError("this model was compiled without loss_fn",
                              "pass loss_fn=... to fxpipe.compile (e.g. F.cross_entropy)")
        return self.loss_fn(self(*args), target)

    def train(self, mode: bool = True) -> CompiledModel:
        for s in self.stages:
            s.train(mode)
        self.model.train(mode)
        return self

    def eval(self) -> CompiledModel:
        return self.train(False)

    # --- parameters: the model's own names -----------------------------------------------------
    def _aliases(self) -> dict[str, str]:
        """Original-model name -> the name the stages know the same tensor by (export may keep
        only one name of a tied pair)."""
        by_id: dict[int, str] = {}
        for s in self.stages:
            for n, t in s.state_dict(keep_vars=True).items():
                by_id.setdefault(id(t), n)
        out = {}
        for n, t in self.model.state_dict(keep_vars=True).items():
            if id(t) in by_id:
                out[n] = by_id[id(t)]
        return out

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """Each parameter once, under the model's own name, in stage order."""
        seen: set[int] = set()
        for s in self.stages:
            for n, p in s.named_parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    yield n, p

    def parameters(self) -> Iterator[nn.Parameter]:
        return (p for _, p in self.named_parameters())

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Weights and buffers from the stages under the model's own names (tied names included),
        loadable with ``model.load_state_dict``."""
        tensors: dict[str, torch.Tensor] = {}
        for s in self.stages:
            tensors.update({n: t.detach() for n, t in s.state_dict(keep_vars=True).items()})
        for orig, known in self._aliases().items():
            tensors.setdefault(orig, tensors[known])
        return tensors

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Copy ``state`` (e.g. ``model.state_dict()``) into the stages, in place."""
        targets: dict[str, torch.Tensor] = {}
        for s in self.stages:
            targets.update(s.state_dict(keep_vars=True))
        aliases = self._aliases()
        missing = [n for n in targets if n not in state and n not in aliases.values()]
        if missing:
            raise PlanFormatError(f"state dict lacks {len(missing)} entries, e.g. {missing[:3]}",
                                  "pass a state dict of the model this was compiled from")
        with torch.no_grad():
            for name, value in state.items():
                dst = targets.get(name) if name in targets else targets.get(aliases.get(name, ""))
                if dst is None:
                    raise PlanFormatError(f"unexpected key {name!r} in state dict",
                                          "pass a state dict of the model this was compiled from")
                dst.copy_(value)

    # --- training ------------------------------------------------------------------------------
    def trainer(self, **kwargs: Any) -> Any:
        """A pipeline trainer for this plan: ``trainer(optimizer=lambda ps: SGD(ps, lr=0.05),
        schedule="pipedream", checkpoint_dir="ckpt/").fit(loader, epochs=3)``; see
        :class:`fxpipe.runtime.trainer.Trainer` for every option."""
        from fxpipe.runtime.trainer import make_trainer

        return make_trainer(self, **kwargs)

    # --- artefacts -----------------------------------------------------------------------------
    def export(self, directory: str | os.PathLike[str]) -> None:
        """Readable ``stage_k.py`` + weights per stage, plus ``plan.json``."""
        export_stages(self.stage_specs, directory, plan_json=self.plan.to_dict())

    def visualize(self, path: str | os.PathLike[str]) -> None:
        """Draw the partitioned graph (.svg, .png or .dot by suffix)."""
        info = [dict(replicas=st.replicas, compute_s=st.compute_s, comm_s=st.comm_s,
                     memory_bytes=st.memory_bytes, stage_time_s=st.stage_time_s)
                for st in self.plan.stages]
        draw_plan(self.stage_specs, path, stage_info=info)

    def __repr__(self) -> str:
        return (f"CompiledModel({type(self.model).__name__}, stages={len(self.stage_specs)}, "
                f"replicas={self.plan.replicas}, traced_with={self.traced.method})")


def _meta_copy(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of ``gm`` on the meta device, without copying the real weights (tied ones stay
    tied): the estimator needs shapes and FLOPs, not values, and a paper-size model then costs
    milliseconds instead of a real forward and backward on this CPU."""
    memo: dict[int, Any] = {}
    for t in (*gm.parameters(), *gm.buffers()):
        if id(t) not in memo:
            empty = torch.empty_like(t, device="meta")
            memo[id(t)] = nn.Parameter(empty, t.requires_grad) if isinstance(t, nn.Parameter) else empty
    return copy.deepcopy(gm, memo)


def cost_graph(traced: TracedGraph, example_inputs: tuple[Any, ...], cluster: Cluster,
               *, repeats: int = 5, optimizer: Callable[..., Any] | None = None) -> Profile:
    """Annotate node costs (measured here, or estimated for ``cluster.device``) and extract them."""
    gm = traced.gm
    if cluster.device is None:
        profile_graph(gm, example_inputs, repeats=repeats, optimizer_factory=optimizer)
        device = "this machine (measured)"
    else:
        meta_gm = _meta_copy(gm)
        meta_inputs = tuple(x.to("meta") if isinstance(x, torch.Tensor) else x for x in example_inputs)
        estimate_graph(meta_gm, meta_inputs, get_device(cluster.device))
        costs = {n.name: n.meta.get("fxpipe", {}) for n in meta_gm.graph.nodes}
        for node in gm.graph.nodes:
            node.meta.setdefault("fxpipe", {}).update(costs.get(node.name, {}))
        device = f"{cluster.device} (estimated)"
    return to_profile(gm, batch_size=_batch_size(example_inputs), device=device,
                      source=f"fxpipe:{traced.method}")


def compile(model: nn.Module, cluster: Cluster | int | None = None, *,
            example_inputs: Any, loss_fn: LossFn | None = None, stages: int | None = None,
            straight: bool = False, sync: str = "allreduce", plan: Plan | None = None,
            leaf_modules: Sequence[Any] = (), repeats: int = 5,
            optimizer: Callable[..., Any] | None = None, choose: str = "planner") -> CompiledModel:
    """Compile ``model`` for ``cluster``: trace, cost, partition, split.

    ``stages`` forces the number of stages, ``straight`` one worker per stage, ``plan`` reuses a
    saved plan (it must have been made for this model). Costs are measured on this machine
    unless ``cluster.device`` names a device from the table, in which case they are estimated.
    ``optimizer`` (``lambda params: torch.optim.Adam(params)``) is the optimizer whose step is
    timed per stage (default: SGD with momentum), since every replica steps after each backward.
    ``choose="simulation"`` picks among the planner's candidates by simulating each one
    (:func:`choose_plan`); the default takes the planner's optimum.
    """
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    cluster = _as_cluster(cluster)
    if not isinstance(example_inputs, tuple):
        example_inputs = (example_inputs,)
    traced = trace(model, example_inputs, leaf_modules=leaf_modules)
    fingerprint = model_fingerprint(traced.gm)
    profile = cost_graph(traced, example_inputs, cluster, repeats=repeats, optimizer=optimizer)
    if plan is None:
        plan = choose_plan(profile, cluster, sync=sync, stages=stages, straight=straight,
                           choose=choose)
        plan = replace(plan, model_fingerprint=fingerprint)
    elif plan.model_fingerprint not in (None, fingerprint):
        raise PlanFormatError(
            f"the plan was made for a different model (fingerprint {plan.model_fingerprint}, "
            f"this model is {fingerprint})", "re-plan with fxpipe.compile(model, cluster, ...)")
    assignment = stage_assignment(plan)
    for node in traced.gm.graph.nodes:
        if node.name in assignment:
            node.meta.setdefault("fxpipe", {})["stage"] = assignment[node.name]
    specs = split_graph(traced.gm, assignment)
    log.info("compiled %s into %d stage(s), replicas %s", type(model).__name__, len(specs),
             plan.replicas)
    return CompiledModel(model, traced, profile, plan, specs, loss_fn, cluster)


CHOOSERS = ("planner", "simulation")


def choose_plan(profile: Profile, cluster: Cluster, *, sync: str = "allreduce",
                stages: int | None = None, straight: bool = False,
                choose: str = "planner") -> Plan:
    """``planner``: the analytic optimum (``fxpipe.passes.partition``, milliseconds).
    ``simulation``: the planner's candidates, each event-simulated with its schedule, the fastest
    kept (``fxpipe.runtime.plan_choice``; seconds at 16 workers): it sees the 1F1B start-up and
    replicas waiting for each other, which the analytic bottleneck does not."""
    if choose not in CHOOSERS:
        raise ConfigError(f"unknown choose={choose!r}", f"use one of {', '.join(CHOOSERS)}")
    if choose == "planner":
        return partition(profile, cluster, sync=sync, stages=stages, straight=straight)
    from fxpipe.runtime.plan_choice import choose_by_simulation

    choice = choose_by_simulation(profile, cluster, sync=sync, stages=stages, straight=straight)
    log.info("%s", choice.summary())
    return choice.plan


def load(directory: str | os.PathLike[str]) -> tuple[Plan | None, list[StageSpec]]:
    """Load an exported directory (``compiled.export``) in a fresh process: plan and stages."""
    plan_dict, specs = load_exported(directory)
    return (Plan.from_dict(plan_dict) if plan_dict is not None else None), specs
