"""``fxpipe.compile``: trace, cost, partition and split an unmodified nn.Module into stages.

It returns a :class:`CompiledModel` (stages, plan and profile: runnable, trainable, exportable);
:func:`choose_plan` and :func:`load` are its parts for a profile or an export. Each phase records
on ``node.meta["fxpipe"]`` or returns a frozen report; this module only wires them together.
"""
from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, Sequence

import torch
from torch import nn

from fxpipe.codegen import (StageSpec, draw_overview, draw_plan, export_stages, load_exported,
                            run_stages, split_graph)
from fxpipe.codegen.visualize import module_span
from fxpipe.costmodel import Cluster, Profile, estimate_graph, get_device, profile_graph, to_profile
from fxpipe.costmodel.overheads import Overheads, with_overheads
from fxpipe.errors import ConfigError, PlanFormatError
from fxpipe.passes import Plan
# planning is runtime.pricing's (torch-free); its entry points stay importable from here
from fxpipe.runtime.pricing.choose import CHOOSERS, choose_fitted_plan, choose_plan  # noqa: F401
from fxpipe.tracing import TracedGraph, trace
from fxpipe.tracing.trace import on_meta

if TYPE_CHECKING:
    from fxpipe.runtime.training.config import (CheckpointConfig, DataConfig, LrSchedulerConfig,
                                                MetricsConfig, PrecisionConfig, ReplanConfig,
                                                RunConfig, ScheduleConfig)
    from fxpipe.runtime.training.trainer import Trainer

log = logging.getLogger("fxpipe")

LossFn = Callable[[Any, Any], torch.Tensor]
OptimizerArg = Callable[..., torch.optim.Optimizer] | torch.optim.Optimizer | None


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

    @property
    def tracer(self) -> str:
        """Which tracer captured the model: "symbolic_trace" or "export"."""
        return self.traced.method

    def _needs_values(self, what: str) -> None:
        if on_meta(self.model):
            raise ConfigError(
                f"cannot {what}: the model is on the meta device (shapes, no values), so it can "
                "be planned and drawn but not run, exported or trained",
                "build it with real weights (or model.to_empty(device='cpu') and load a "
                "checkpoint), then compile it again, e.g. with plan=compiled.plan")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the stages in order on the model's own arguments (positional and keyword)."""
        self._needs_values("run the stages")
        return run_stages(self.stage_specs, args, kwargs)

    def loss(self, *args: Any, target: Any = None, **kwargs: Any) -> torch.Tensor:
        """The training loss, computed in the last stage as the runtime does."""
        if self.loss_fn is None:
            raise ConfigError("this model was compiled without loss_fn",
                              "pass loss_fn=... to fxpipe.compile (e.g. F.cross_entropy)")
        return self.loss_fn(self(*args, **kwargs), target)

    def train(self, mode: bool = True) -> CompiledModel:
        for s in self.stages:
            s.train(mode)
        self.model.train(mode)
        return self

    def eval(self) -> CompiledModel:
        return self.train(False)

    # --- parameters: the model's own names -----------------------------------------------------
    def state_locations(self) -> dict[str, tuple[int, str] | None]:
        """``model.state_dict()`` key -> (stage, name in that stage's GraphModule) of the stage
        holding that very tensor (the first, for a tensor several stages share), or None for a
        tensor no stage uses (an unused parameter keeps the model's own value).

        Why by identity: the stages hold the model's own tensors, but not always under the same
        name (one name of a tied pair survives export), and they also hold tensors that are not
        the model's state: non-persistent buffers (rotary ``inv_freq``, BERT's ``position_ids``)
        and constants torch.export lifted (``lifted_tensor_0``)."""
        where: dict[int, tuple[int, str]] = {}
        for st in self.stage_specs:
            for n, t in st.gm.state_dict(keep_vars=True).items():
                where.setdefault(id(t), (st.index, n))
        return {k: where.get(id(t)) for k, t in self.model.state_dict(keep_vars=True).items()}

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
        """Exactly ``model.state_dict()``'s keys (tied aliases included, non-persistent buffers
        and lifted constants not), with the stages' values: ``model.load_state_dict`` takes it
        strictly, and so does ``save_pretrained`` through the user's model."""
        own = self.model.state_dict(keep_vars=True)
        stage_states = [st.gm.state_dict(keep_vars=True) for st in self.stage_specs]
        return {key: (own[key] if loc is None else stage_states[loc[0]][loc[1]]).detach()
                for key, loc in self.state_locations().items()}

    def load_state_dict(self, state: Mapping[str, torch.Tensor], strict: bool = True) -> Any:
        """Copy ``state`` (e.g. ``model.state_dict()``, or a trainer's) into the stages and the
        model, in place. ``strict``: the keys must be exactly ``model.state_dict()``'s, else
        :class:`PlanFormatError` naming the missing and unexpected ones; not strict: returns
        ``(missing_keys, unexpected_keys)`` as torch does."""
        locations = self.state_locations()
        missing = [k for k in locations if k not in state]
        unexpected = [k for k in state if k not in locations]
        if strict and (missing or unexpected):
            raise PlanFormatError(
                f"state dict does not match the model: missing {missing[:5]}"
                f"{' ...' if len(missing) > 5 else ''} ({len(missing)}), unexpected "
                f"{unexpected[:5]}{' ...' if len(unexpected) > 5 else ''} ({len(unexpected)})",
                "pass model.state_dict() of the model this was compiled from (or a trainer's "
                "state_dict()), or strict=False to load the matching keys")
        own = self.model.state_dict(keep_vars=True)
        stage_states = [st.gm.state_dict(keep_vars=True) for st in self.stage_specs]
        with torch.no_grad():
            for key, loc in locations.items():
                if key not in state:
                    continue
                targets = {id(own[key]): own[key]}
                if loc is not None:
                    t = stage_states[loc[0]][loc[1]]
                    targets.setdefault(id(t), t)
                for t in targets.values():
                    if tuple(t.shape) != tuple(state[key].shape):
                        raise PlanFormatError(f"{key!r} has shape {tuple(state[key].shape)}, the "
                                              f"model's is {tuple(t.shape)}",
                                              "pass a state dict of the model this was compiled "
                                              "from")
                    t.copy_(state[key])
        return nn.modules.module._IncompatibleKeys(missing, unexpected)

    # --- training ------------------------------------------------------------------------------
    def trainer(self, optimizer: OptimizerArg = None, *, loss_fn: LossFn | None = None,
                schedule: ScheduleConfig | str | None = None, data: DataConfig | None = None,
                checkpoint: CheckpointConfig | None = None,
                precision: PrecisionConfig | str | None = None,
                metrics: MetricsConfig | None = None, run: RunConfig | None = None,
                lr_scheduler: LrSchedulerConfig | Callable[..., Any] | None = None,
                replan: ReplanConfig | str | None = None, **aliases: Any) -> Trainer:
        """A pipeline trainer for this plan: ``trainer(lambda ps: SGD(ps, lr=0.05),
        checkpoint=fxpipe.CheckpointConfig(dir="ckpt/")).fit(loader, epochs=3)``. Its options
        come in sections (:mod:`fxpipe.runtime.training.config`, every one exported by
        ``fxpipe``): ``schedule``, ``data``, ``checkpoint``, ``precision``, ``metrics``, ``run``,
        ``lr_scheduler``, ``replan``; ``aliases``: the flat keywords of earlier releases
        (``checkpoint_dir=``, ``executor=`` ...), kept for one release. The schedule defaults
        to ``"auto"`` (a pilot on the first minibatches and this plan's simulated throughput pick
        it, see :mod:`fxpipe.runtime.training.auto`; :meth:`summary` then says what and why); pass
        ``schedule="pipedream"`` (or another) to skip the pilot. ``recompute`` defaults to the
        plan's per-stage flags (``plan.recompute``), whose memory the plan was priced with, and
        ``run.shard`` to the plan's (``plan.shard``; ``"never"`` trains it unsharded).
        ``loss_fn``: the one given to :func:`compile` unless given here."""
        from fxpipe.runtime.training.config import flat_options
        from fxpipe.runtime.training.trainer import make_trainer

        self._needs_values("train")
        kwargs = flat_options({"schedule": schedule, "data": data, "checkpoint": checkpoint,
                               "precision": precision, "metrics": metrics, "run": run,
                               "lr_scheduler": lr_scheduler, "replan": replan}, aliases)
        if optimizer is None:
            raise ConfigError("no optimizer: compiled.trainer() needs one",
                              "pass a factory of the parameters' optimizer, e.g. "
                              "compiled.trainer(lambda ps: torch.optim.SGD(ps, lr=0.1))")
        kwargs["optimizer"] = optimizer
        if loss_fn is not None:
            kwargs["loss_fn"] = loss_fn
        if kwargs.get("recompute") is None and any(self.plan.recompute):
            kwargs["recompute"] = self.plan.recompute
        if kwargs.get("shard") is None and self.plan.shard is not None:
            kwargs["shard"] = self.plan.shard  # the memory the plan was priced with
        return make_trainer(self, **kwargs)

    def calibrate_stages(self, batches: Any, optimizer: Any, *, schedule: str = "pipedream"
                         ) -> Any:
        """The plan priced on its stages as the runtime runs them, before any distributed run:
        ``batches`` (a few (inputs, target) minibatches per update) trained in this process on
        copies of the weights, the profile rescaled to the measured stage times
        (:mod:`fxpipe.runtime.training.stage_calibration`); ``.time_per_minibatch``,
        ``.factors`` (measured / profiled per stage), ``.plan``."""
        from fxpipe.runtime.training.stage_calibration import calibrate_stages

        self._needs_values("calibrate the stages")
        if self.loss_fn is None:
            raise ConfigError("this model was compiled without loss_fn",
                              "pass loss_fn=... to fxpipe.compile (e.g. F.cross_entropy)")
        return calibrate_stages(self.stage_specs, self.plan, self.profile, self.loss_fn,
                                optimizer, list(batches), schedule=schedule)

    def memory_check(self, trainer: Trainer) -> tuple[Any, ...]:
        """Predicted against measured memory per stage, after ``trainer`` (made with
        ``measure_memory=True``) has trained a segment: the plan's bytes per replica split into
        its rule's terms next to the largest measured peak of live tensors among the stage's
        replicas (:func:`fxpipe.runtime.pricing.memory.check_memory`; ``memory_table`` prints
        them). Every rank gets every stage's peak; the parts of the peak only for its own."""
        from fxpipe.runtime.pricing.memory import check_memory

        measured = trainer.measured_memory()
        if measured is None:
            raise ConfigError("the trainer has measured no memory",
                              "make it with compiled.trainer(optimizer, metrics="
                              "fxpipe.MetricsConfig(measure_memory=True)) under torchrun and "
                              "call fit before memory_check")
        return check_memory(self.plan, measured, trainer.memory_parts,
                            trainer.walked_peaks(self.plan, self.profile))

    def torch_stages(self, rank: int, world_size: int, *, placement: str = "loop",
                     device: Any = None, group: Any = None) -> Any:
        """This rank's stages as ``torch.distributed.pipelining.PipelineStage`` s, so torch's own
        schedules (Schedule1F1B, ScheduleInterleaved1F1B, ScheduleZBVZeroBubble, ...) train
        fxpipe's automatic split: skip connections carried through the stages in between, tied
        weights summed over the ranks holding them (``.sync_tied_grads()``). See
        :mod:`fxpipe.runtime.execution.torch_pipelining`; every rank calls it, with
        torch.distributed initialised."""
        from fxpipe.runtime.execution.torch_pipelining import torch_stages

        self._needs_values("build torch pipeline stages")
        return torch_stages(self.stage_specs, rank, world_size, placement=placement,
                            device=device, group=group)

    # --- artefacts -----------------------------------------------------------------------------
    def export(self, directory: str | os.PathLike[str]) -> None:
        """Readable ``stage_k.py`` + weights per stage, plus ``plan.json``."""
        self._needs_values("export the stages")
        export_stages(self.stage_specs, directory, plan_json=self.plan.to_dict())

    def visualize(self, path: str | os.PathLike[str], nodes: bool = False) -> None:
        """Draw the plan (.svg, .png or .dot by suffix): its stages left to right with their
        modules, replicas, compute, memory and the bytes crossing each cut; ``nodes=True``: the
        partitioned graph node by node (one cluster per stage)."""
        if not nodes:
            spans = [module_span(st.gm) for st in self.stage_specs]
            draw_overview(self.plan, path, spans if all(spans) else None)
            return
        info = [dict(replicas=st.replicas, compute_s=st.compute_s + st.sync_s, comm_s=st.comm_s,
                     memory_bytes=st.memory_bytes) for st in self.plan.stages]
        draw_plan(self.stage_specs, path, stage_info=info)

    def summary(self, detail: bool = False) -> str:
        """The plan's table (:meth:`Plan.summary`, ``detail`` as there), each stage described
        by the modules it covers (``model.layers.3..model.layers.7``) where the tracer recorded
        them; once a trainer's ``fit`` started, also what it trains (the schedule, why auto
        chose it, the cut), with auto's pilot table under ``detail``."""
        spans = [module_span(st.gm) for st in self.stage_specs]
        text = self.plan.summary(spans if all(spans) else None, detail=detail)
        decision = getattr(self, "auto_decision", None)  # set by a trainer's schedule="auto"
        recipe = getattr(self, "recipe", None)  # what a trainer's fit trains (trainer_cut)
        parts = [text] + ([f"fxpipe trains:\n{recipe}"] if recipe else [])
        if decision is not None and (detail or not recipe):
            parts.append(decision.summary())
        return "\n\n".join(parts)

    def __repr__(self) -> str:
        return (f"CompiledModel({type(self.model).__name__}, stages={len(self.stage_specs)}, "
                f"replicas={self.plan.replicas}, traced_with={self.traced.method})")


def cost_graph(traced: TracedGraph, cluster: Cluster, *, repeats: int = 5,
               optimizer: Callable[..., Any] | None = None) -> Profile:
    """Annotate node costs (measured here, or estimated for ``cluster.device``) and extract them."""
    gm, inputs = traced.gm, traced.flat_inputs
    if cluster.device is None:
        if on_meta(traced.gm):
            raise ConfigError("the model is on the meta device: it has no values to run, so its "
                              "costs cannot be measured",
                              "estimate them for a device: fxpipe.Cluster(..., device='A100')")
        profile_graph(gm, inputs, repeats=repeats, optimizer_factory=optimizer)
        device = "this machine (measured)"
    else:
        estimate_graph(gm, inputs, get_device(cluster.device))
        device = f"{cluster.device} (estimated)"
    profile = to_profile(gm, batch_size=_batch_size(inputs), device=device,
                         source=f"fxpipe:{traced.method}")
    if cluster.device is None:
        profile.meta["threads"] = 1  # profile_graph's default: one thread, as each CPU rank
    return profile


TRACERS = ("auto", "symbolic_trace", "export")
OVERHEADS = ("auto", "measure", "off")


def with_runtime_overheads(profile: Profile, cluster: Cluster,
                           how: str | Overheads | None = None, *, on_cuda: bool = False
                           ) -> Profile:
    """``profile`` recording the runtime overheads the plan is priced with (see
    :func:`compile`'s ``overheads``; None: ``$FXPIPE_OVERHEADS``, else "auto")."""
    if how is None:
        how = os.environ.get("FXPIPE_OVERHEADS", "auto")
    if isinstance(how, Overheads):
        ov = how
    elif how not in OVERHEADS:
        raise ConfigError(f"unknown overheads={how!r}",
                          f"use one of {', '.join(OVERHEADS)}, or an fxpipe.Overheads")
    elif how == "off":
        ov = Overheads(source="off")
    else:
        copy = float(profile.meta.get("stash_copy_s", 0.0))
        if cluster.device is not None or on_cuda:
            where = cluster.device or "CUDA"
            ov = Overheads(stash_copy_s=copy, source=f"the stash's copy only ({where}: the "
                           "runtime's calls and messages are measured on CPUs only)")
        else:
            from fxpipe.runtime.execution.overhead_probe import machine_overheads

            ov = replace(machine_overheads(refresh=how == "measure"), stash_copy_s=copy)
    return replace(profile, meta=with_overheads(profile.meta, ov))


def model_loss(output: Any, target: Any = None) -> torch.Tensor:
    """The loss a model computed itself (a Hugging Face model given ``labels=``): the default
    ``loss_fn`` when the model's output has a ``loss`` entry. ``target`` is unused: the labels
    are one of the model's inputs."""
    loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
    if loss is None:
        raise ConfigError("the model output has no 'loss' (did the batch include labels?)",
                          "pass labels among the model inputs, or pass loss_fn=...")
    return loss


def _computes_own_loss(traced: TracedGraph) -> bool:
    """Does the model's output structure have a ``loss`` entry (HF models given labels)?"""
    io = traced.io
    if io is None:
        return False
    try:
        out = io.build_output({n: n for n in io.output_names()})
    except Exception:  # noqa: BLE001 - an exotic output structure: no own loss
        return False
    return isinstance(out, Mapping) and "loss" in out


def compile(model: nn.Module, cluster: Cluster | int | None = None, *,
            example_inputs: Any = (), example_kwargs: Mapping[str, Any] | None = None,
            loss_fn: LossFn | None = None, stages: int | None = None,
            straight: bool = False, sync: str = "allreduce", plan: Plan | None = None,
            leaf_modules: Sequence[Any] = (), repeats: int = 5,
            optimizer: Callable[..., Any] | None = None, choose: str = "auto",
            tracer: str = "auto", plan_timeout_s: float = 600.0,
            recompute: str = "never", schedule: str = "auto",
            microbatches: int | None = None,
            master_weights: bool | None = None,
            overheads: str | Overheads | None = None, shard: str = "never") -> CompiledModel:
    """Compile ``model`` for ``cluster``: trace, cost, partition, split.

    ``example_inputs``: a tuple of positional inputs, a dict of keyword inputs (a Hugging Face
    batch: ``{"input_ids": ids, "labels": ids}``) or one tensor; ``example_kwargs``: more
    keyword inputs. ``loss_fn(output, target)`` runs on the last stage; without one, a model
    whose output has a ``loss`` (given ``labels``) trains on that loss.
    ``stages`` forces the number of stages, ``straight`` one worker per stage, ``plan`` reuses a
    saved plan (it must have been made for this model). Costs are measured on this machine
    unless ``cluster.device`` names a device from the table, in which case they are estimated
    (the only way for a model instantiated on the meta device).
    ``optimizer`` (``lambda params: torch.optim.Adam(params)``) is the optimizer whose step is
    timed per stage (default: SGD with momentum), since every replica steps after each backward.
    ``choose="simulation"`` picks among the planner's candidates by simulating each one
    (:func:`choose_plan`); ``"planner"`` takes the planner's optimum; the default (``"auto"``)
    the simulation, except the planner's for ``schedule="pipedream"`` unless it splits tied
    parameters across stages or simulates more than 5% slower than planned (round trips longer
    than PipeDream's window, replicas waiting for each other). Every choice is compared with
    one worker too: a plan uses fewer of the cluster's workers where that is faster.
    ``tracer``: "auto" (torch.fx.symbolic_trace, else torch.export: the first that gives a graph
    that runs, trains and exports), "symbolic_trace" or "export"; ``compiled.tracer`` says which
    one ran. ``recompute``: activation recomputation per stage, "never", "always" or "auto"
    (the planner recomputes where it makes the plan fit in memory or faster; the trainer then
    recomputes in those stages, see ``plan.recompute``). ``schedule`` (and ``microbatches`` per
    update): the schedule the plan is priced for, its time and its memory (default ``"auto"``:
    what the default trainer trains, 1F1B with a flush and each minibatch cut into one
    microbatch per worker, ``runtime.schedules.spec.AUTO_PRICED``; ``"pipedream"``: PipeDream's
    asynchronous 1F1B, whose rule stashes a weight version per minibatch in flight;
    ``plan.memory_rule`` and ``plan.time_source`` say which), and whose peak, walked through
    its actions, each stage must fit too
    (:func:`choose_fitted_plan`; ``plan.stages[s].peak_bytes``, the summary's ``peak``).
    A stage's state is priced as the run keeps it (``runtime/replica/state_size.py``): weights,
    gradients, ``optimizer``'s state measured on stand-ins, and float32 masters for low-precision
    parameters unless ``master_weights=False`` (pass the Trainer the same).
    ``shard``: "never" (default: every replica of a stage keeps its whole optimizer state),
    "optimizer" (each replicated stage splits the optimizer's own state over its replicas,
    ZeRO-1 on torch's ``ZeroRedundancyOptimizer``: less memory, and a broadcast of the new
    weights after each step) or "auto" (sharded only where that makes the plan fit or faster);
    ``plan.shard`` says which, and the trainer shards as the plan was priced.

    ``overheads``: what the runtime pays per stage beyond the nodes' times (its calls, its
    messages, the stash's copy; :mod:`fxpipe.costmodel.overheads`), priced into the plan:
    ``"auto"`` (default, or ``$FXPIPE_OVERHEADS``): on this machine's CPU, measured once by a
    probe on one rank and two and cached (:mod:`fxpipe.runtime.execution.overhead_probe`, some
    seconds the first time); for an estimated device or a model on CUDA only the stash's copy (the
    calls and messages there are not measured); ``"measure"``: probe again; ``"off"``: none
    (the nodes' times alone, the cost model before them); or an :class:`Overheads`.

    In a distributed job (torchrun: ``WORLD_SIZE > 1``) only rank 0 measures costs and plans;
    the other ranks receive its profile and plan (waiting at most ``plan_timeout_s``), so every
    rank runs the same pipeline however differently their cores are loaded.
    """
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if tracer not in TRACERS:
        raise ConfigError(f"unknown tracer={tracer!r}", f"use one of {', '.join(TRACERS)}")
    if loss_fn is not None:
        from fxpipe.runtime.training.first_check import check_loss_fn

        check_loss_fn(loss_fn)
    cluster = _as_cluster(cluster)
    traced = trace(model, example_inputs, example_kwargs=example_kwargs,
                   leaf_modules=leaf_modules, method=tracer)
    if loss_fn is None and _computes_own_loss(traced):
        loss_fn = model_loss
    fingerprint = model_fingerprint(traced.gm)
    if plan is not None and plan.model_fingerprint not in (None, fingerprint):
        raise PlanFormatError(
            f"the plan was made for a different model (fingerprint {plan.model_fingerprint}, "
            f"this model is {fingerprint})", "re-plan with fxpipe.compile(model, cluster, ...)")

    def make() -> dict[str, Any]:
        from fxpipe.runtime.pricing.memory_walk import GRADIENT_WIDTH, LOSS_IN_MODEL
        from fxpipe.runtime.replica.state_size import (gradient_width, state_parts,
                                                       temporaries_for)

        profile = with_runtime_overheads(
            cost_graph(traced, cluster, repeats=repeats, optimizer=optimizer), cluster,
            overheads, on_cuda=any(p.is_cuda for p in traced.gm.parameters()))
        if loss_fn is model_loss:  # its loss is in the graph: no loss outside keeps a copy
            profile = replace(profile, meta={**profile.meta, LOSS_IN_MODEL: True})
        width = gradient_width(list(traced.gm.parameters()), master_weights)
        if width != 1.0:  # gradients summed wider than the weights (float32 for bf16 masters)
            profile = replace(profile, meta={**profile.meta, GRADIENT_WIDTH: width})
        factor, split = state_parts(list(traced.gm.parameters()), optimizer, master_weights)
        if plan is not None:  # the user's plan, as saved
            chosen = plan
        else:  # the cap held against each stage's walked peak, the step's temporaries in it
            temporaries = temporaries_for(traced.gm.parameters(), optimizer, cluster.device,
                                          master_weights)
            chosen = replace(choose_fitted_plan(
                profile, cluster, sync=sync, stages=stages, straight=straight, choose=choose,
                recompute=recompute, schedule=schedule, microbatches=microbatches,
                optimizer_state_factor=factor, temporaries=temporaries, shard=shard,
                sharded_state=split),
                model_fingerprint=fingerprint)
        return {"profile": profile.to_dict(), "plan": chosen.to_dict()}

    from fxpipe.runtime.execution.agree import shared  # a torchrun job: rank 0 plans for every rank

    made = shared(make, "plan", plan_timeout_s)
    profile, plan = Profile.from_dict(made["profile"]), Plan.from_dict(made["plan"])
    if plan.model_fingerprint not in (None, fingerprint):
        raise PlanFormatError(f"rank 0 planned a different model (fingerprint "
                              f"{plan.model_fingerprint}, this rank's is {fingerprint})",
                              "every rank must build the same model with the same example inputs")
    if not plan.staleness:  # every rank derives the same table from the agreed plan
        from fxpipe.runtime.pricing.plansim import with_trainer_window

        plan = with_trainer_window(plan, profile)
    assignment = stage_assignment(plan)
    for node in traced.gm.graph.nodes:
        if node.name in assignment:
            node.meta.setdefault("fxpipe", {})["stage"] = assignment[node.name]
    specs = split_graph(traced.gm, assignment)
    log.info("compiled %s into %d stage(s), replicas %s (traced with %s)", type(model).__name__,
             len(specs), plan.replicas, traced.method)
    return CompiledModel(model, traced, profile, plan, specs, loss_fn, cluster)


def load(directory: str | os.PathLike[str]) -> tuple[Plan | None, list[StageSpec]]:
    """Load an exported directory (``compiled.export``) in a fresh process: plan and stages."""
    plan_dict, specs = load_exported(directory)
    return (Plan.from_dict(plan_dict) if plan_dict is not None else None), specs
