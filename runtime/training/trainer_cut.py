"""How the Trainer reads and cuts a loader minibatch, and the block that tells the user.

A mixin of :class:`~.trainer.Trainer`. The ranks computing the loss check the first minibatch
(:mod:`.first_check`) and, where minibatches are cut (``auto`` on 2+ workers, or ``split=``), find
its batch dimensions and loss rule (:func:`.loss_split.probe`); all ranks cut or stop alike."""
from __future__ import annotations

import contextlib
import logging
from typing import Any, Sequence

import torch

from fxpipe.codegen.pipeline import run_stages
from fxpipe.errors import FxpipeError
from fxpipe.tracing.batchdims import BatchDims, as_call, infer_batch_dims

from ..errors import RuntimeConfigError
from ..execution.contract import Batch
from ..execution.trainer_backends import DistributedBackend
from ..execution.wire import make_wire_plan
from ..replica.stage_call import modes
from ..replica.weighted import Weighted
from ..schedules.localsgd import LOCALSGD
from ..schedules.spec import AUTO
from .data import PartStream, take
from .first_check import check_first
from .loss_split import LossRule, cut_segment, piece_sizes, probe, units
from .minibatch import BATCH_DIMS_HINT, CutSpec, minibatch_size, user_dims

log = logging.getLogger("fxpipe.runtime.training.trainer")


def check_split(split: int | None, kind: str, microbatches: int | None) -> int:
    """``split=`` (microbatches each loader minibatch is cut into, one update per minibatch)
    for a named schedule: a flushing kind, without ``microbatches``; 1 when not given."""
    if split is None:
        return 1
    if not isinstance(split, int) or isinstance(split, bool) or split < 1:
        raise RuntimeConfigError(f"split={split!r}", "use a positive number of microbatches "
                                 "per minibatch")
    if split > 1 and (kind in (AUTO, "pipedream") or microbatches is not None):
        raise RuntimeConfigError(
            f"split={split} with schedule {kind!r} and microbatches={microbatches}",
            "split= cuts each minibatch for a flushing schedule (1f1b-flush, gpipe, zb-h1, "
            "...) named without microbatches=; auto chooses its own cut, pipedream updates "
            "after every minibatch")
    return split


def whole_model(stages: Sequence[Any], inputs: Any) -> Any:
    """``stages`` run in order on a batch's ``inputs`` in eval mode, without gradients (the
    modes given back after)."""
    args, kwargs = as_call(inputs)
    with contextlib.ExitStack() as stack:
        for st in stages:
            stack.enter_context(modes(st.gm, training=False))
        stack.enter_context(torch.no_grad())
        return run_stages(stages, args, kwargs)


def find_cut(stages: Sequence[Any], loss_fn: Any, part: Batch, batch_dims: Any = None,
             input_dims: BatchDims | None = None) -> tuple[CutSpec, LossRule, int]:
    """The cut of ``part`` (a whole minibatch) and its loss's rule (see the module doc):
    the inputs' batch dimensions from ``batch_dims`` (the user's), else ``input_dims`` (the
    compiled graph's), else tested on ``stages`` now; and the minibatch's size."""
    args, kwargs = as_call(part[0])
    if batch_dims is not None and not (isinstance(batch_dims, (tuple, list))
                                       and len(batch_dims) == 2):
        raise RuntimeConfigError(f"batch_dims={batch_dims!r}", BATCH_DIMS_HINT)
    if batch_dims is not None:
        in_dims = user_dims(batch_dims[0], (args, kwargs), "inputs")
    else:
        found = input_dims
        if found is None or not found.known:
            found = infer_batch_dims(lambda a, k: whole_model(stages, k if k else a),
                                     args, kwargs)
        if not found.known:
            raise RuntimeConfigError(f"cannot tell which dimension of the model inputs is the "
                                     f"batch: {found.note}", BATCH_DIMS_HINT)
        in_dims = found.input_dims()
    target_dims = (user_dims(batch_dims[1], part[1], "target")
                   if batch_dims is not None and part[1] is not None else None)
    spec, rule = probe(lambda inputs: whole_model(stages, inputs), loss_fn, part, in_dims,
                       target_dims)
    return spec, rule, minibatch_size(part, spec)


class CutMixin:
    """Cut methods of the Trainer (it provides the attributes declared here)."""

    stages: list[Any]
    replicas: list[int]
    kind: str
    split: int
    microbatches: int | None
    need_targets: bool
    backend: Any
    seed: int
    loss_fn: Any
    user_loss_fn: Any
    batch_dims: Any
    input_batch_dims: BatchDims | None
    cut_spec: CutSpec | None
    loss_rule: LossRule | None
    _bn_warned: bool
    _first_checked: bool
    _bns: list[str] | None
    _probe_size: int
    schedule_name: str
    on_recipe: Any
    need_inputs: bool
    index: int
    options: Any
    _wire_cache: Any
    _wire: Any
    _samples: int
    _share: list[float]
    _sizes_read: list[int]

    def _may_cut(self) -> bool:
        """Will (or, under auto, may) this run cut minibatches?"""
        return (sum(self.replicas) > 1 and self.microbatches is None
                and (self.kind == AUTO or self.split > 1))

    def _check_first(self, first: Batch | None) -> None:
        """Before any step: on the ranks that compute the loss, the loader's first whole
        minibatch ``first`` (None on the other ranks) must run through the model and the loss
        (:func:`.first_check.check_first`), and where this run cuts minibatches, the cut and
        the loss rule are found on it (see the module doc). The verdict (or the error) is
        exchanged, so every rank goes on or stops alike; every rank calls it at the same
        point. Once per trainer, and again only for a cut a re-plan made necessary."""
        probe = self.cut_spec is None and self._may_cut()
        if self._first_checked and not probe:
            return
        verdict: Any = None
        if isinstance(first, FxpipeError):  # reading it failed (the loader's shape)
            verdict = ("error", type(first), first.message, first.hint)
        elif self.need_targets and first is not None:
            try:
                if not self._first_checked:
                    check_first(self.stages, self.user_loss_fn, first,
                                lambda inputs: whole_model(self.stages, inputs))
                verdict = ("ok",) + (self._probe(first) if probe else (None, None, 0))
            except FxpipeError as err:
                verdict = ("error", type(err), err.message, err.hint)
        got = next((v for v in self.backend.exchange(verdict, "first minibatch check")
                    if v is not None), None)
        if got is None:  # nothing was read (an empty epoch): nothing to check yet
            return
        if got[0] == "error":
            raise got[1](got[2], got[3])
        self._first_checked = True
        if got[1] is not None:
            self.cut_spec, self.loss_rule, self._probe_size = got[1], got[2], got[3]

    def _probe(self, part: Batch) -> tuple[CutSpec, LossRule, int]:
        return find_cut(self.stages, self.user_loss_fn, part, self.batch_dims,
                        self.input_batch_dims)

    def _cut(self, parts: list[Batch], sizes: Sequence[int]) -> tuple[list[Batch], list[float]]:
        """A segment's minibatches cut into :attr:`split` microbatches each (their targets
        weighted on the ranks that compute the loss), and each one's share of its minibatch."""
        if self.split == 1 or not parts:
            return parts, [1.0] * len(parts)
        if self.cut_spec is None:
            raise RuntimeConfigError("a cut was asked for before fit() tested how to cut",
                                     "report this as an fxpipe bug")
        self._check_batchnorm(sizes)
        return cut_segment(parts, sizes, self.split, self.cut_spec,
                           self.loss_rule if self.need_targets else None, self.user_loss_fn)

    def _sizes(self, parts: Sequence[Batch]) -> list[int]:
        """Samples of each minibatch (rank 0 holds the inputs; it sizes them for everyone)."""
        from .data import batch_size_of

        if self.cut_spec is None:
            return [batch_size_of(p[0]) for p in parts]
        return [minibatch_size(p, self.cut_spec) for p in parts]

    def batchnorms(self) -> list[str]:
        """Names of the BatchNorm layers in train mode (modules, or export's aten calls)."""
        out = []
        for st in self.stages:
            for name, m in st.gm.named_modules():
                if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.training:
                    out.append(name)
            for n in st.gm.graph.nodes:
                if n.op == "call_function" and "batch_norm" in str(n.target) and st.gm.training:
                    stack = n.meta.get("nn_module_stack") or {}
                    out.append(next(reversed(stack.values()))[0] if stack else n.name)
        return list(dict.fromkeys(out))

    def _check_batchnorm(self, sizes: Sequence[int]) -> None:
        if self._bns is None:
            self._bns = self.batchnorms()
        if not self._bns or not any(sizes):
            return
        smallest = min(min(piece_sizes(n, min(self.split, n))) for n in sizes if n)
        named = ", ".join(self._bns[:4]) + (" ..." if len(self._bns) > 4 else "")
        if smallest < 2:
            raise RuntimeConfigError(
                f"a cut into {self.split} microbatches leaves BatchNorm ({named}) {smallest} "
                "sample: it cannot normalise one sample in train mode",
                "give minibatches of at least 2 samples per microbatch, or name a schedule "
                "with microbatches= (each loader minibatch one microbatch)")
        if not self._bn_warned:
            self._bn_warned = True
            log.warning("BatchNorm in train mode (%s) normalises each microbatch (%d samples or "
                        "more) with its own statistics, not the %d-sample minibatch's, so "
                        "training differs from the unsplit minibatch's; name a schedule with "
                        "microbatches= to keep minibatches whole", named, smallest, max(sizes))

    def _tell(self) -> bool:
        """Log :meth:`recipe` (and hand it to ``on_recipe``: ``compiled.summary()``)."""
        text = self.recipe()
        log.info("fxpipe trains:\n%s", text)
        if self.on_recipe is not None:
            self.on_recipe(text)
        return True

    def recipe(self) -> str:
        """What fit trains, in plain words: the schedule (and why auto chose it), how each
        loader minibatch is shared among the stages' replicas, and what an update is (logged at
        the start of fit, shown by ``compiled.summary()``)."""
        decision = getattr(self, "auto_decision", None)
        replicas = list(getattr(self, "replicas", [1] * len(self.stages)))
        lines = [f"schedule: {self.schedule_name}"
                 + (f", chosen by auto: {decision.reason}" if decision is not None else "")]
        who = "; ".join(f"stage {s}: {r} replicas" for s, r in enumerate(replicas) if r > 1)
        if self.split > 1 and self.cut_spec is not None:
            n = self._probe_size
            sizes = f" ({n} samples -> {piece_sizes(n, self.split)})" if n else ""
            share = (f"; each stage's replicas take the microbatches in turn ({who}) and their "
                     "gradients are summed by each one's share of the minibatch" if who else "")
            lines += [f"cut: each minibatch into {self.split} microbatches{sizes}, along "
                      f"{self.cut_spec.describe()}{share}",
                      "update: one per minibatch on every stage, the whole minibatch's gradient "
                      f"(the loss is {self.loss_rule.describe() if self.loss_rule else '?'}); "
                      "the logged loss is the minibatch's"]
        elif self.kind == LOCALSGD:
            r, h = replicas[0], getattr(self, "average_every", None)
            lines.append(f"no cut: {r} copies of the pipeline take the minibatches in turn, each "
                         "updating after every minibatch of its own; the copies' weights are "
                         f"averaged after every {h} of their updates and at the end of each "
                         "epoch (each keeps its own optimizer state); a plan's figures are for "
                         f"one pipeline, not for these {r} copies on {r * len(replicas)} "
                         "workers, which the planner does not price")
        elif self.kind == "pipedream" and self.microbatches is None:
            if who:
                lines.append(f"no cut: each minibatch trains whole on one replica of each stage; "
                             f"a stage's replicas take minibatches in turn ({who}), so an "
                             "update of such a stage averages as many minibatches' gradients "
                             "(a larger batch, fewer updates than plain PyTorch's step per "
                             "minibatch); a stage on one worker updates after every minibatch")
            else:
                lines.append("no cut: an update after every minibatch, on every stage")
        elif (self.microbatches or sum(replicas)) == 1:
            lines.append("no cut: an update after every minibatch, on every stage")
        else:
            m = self.microbatches or sum(replicas)
            lines.append(f"no cut: each minibatch is one microbatch and an update averages the "
                         f"gradients of {m} minibatches (gradient accumulation: {m} times the "
                         "loader's batch per update)")
        noam = self._noam() if hasattr(self, "_noam") else None
        if noam is not None:
            how = f"noam={noam}" if isinstance(self._noam_spec, int) else \
                "the fewest that hide the plan's round trips"
            lines.append(f"in flight: {noam} minibatches at the input stage ({how}; PipeDream's "
                         f"NOAM would be {-(-sum(replicas) // replicas[0])})")
        return "\n".join(lines)

    # ------------------------------------------------------------------ reading
    def _lead(self, it: PartStream, n: int, what: str, wire: bool = True, split: bool = True
              ) -> tuple[list[Batch], int]:
        """Every rank that reads data takes up to ``n`` minibatches itself (all at the same
        time); then the ranks exchange how many they read and their fingerprints (one message
        each), rank 0 adding the wire shapes and the minibatches' sizes. ``split``: cut each into
        :attr:`split` microbatches (:meth:`~.trainer_cut.CutMixin._cut`), which ``schedule="auto"``
        sets when it picks a microbatched schedule and the user gave no ``microbatches``: an
        update still covers one of the loader's minibatches, as pipedream's does. Ranks that
        read different data stop here. Returns the parts and how many minibatches were read."""
        reads = self.need_inputs or self.need_targets
        parts = take(it, n) if reads else []
        if not self._first_checked or (split and self.split > 1 and self.cut_spec is None):
            self._check_first(it.first_whole() if parts else None)  # once, before any step
        read, plan, samples, sizes = len(parts), None, 0, None
        share = [1.0] * len(parts)
        if self.index == 0:  # rank 0 reads the inputs: it sizes the minibatches for all
            sizes = self._sizes(parts)
            parts, share = self._cut(parts, sizes) if split else (parts, share)
            plan = (make_wire_plan(self.stages, [p[0] for p in parts], cache=self._wire_cache,
                                   precision=self.options.precision,
                                   device=self.backend.device.type)
                    if wire and parts and isinstance(self.backend, DistributedBackend) else None)
            samples = sum(sizes)
        mine = (read, it.digest(), plan, samples, sizes) if reads else None
        infos = self.backend.exchange(mine, f"{what} size")
        count, digest0, plan, samples, sizes = infos[0]
        for i, info in enumerate(infos):
            if info is None:
                continue
            if info[0] != count:
                raise RuntimeConfigError(f"rank {i} read {info[0]} minibatches of {what}, rank 0 "
                                         f"read {count}", "the loader must yield the same "
                                         "minibatches on every rank (deterministic)")
            if info[1] != digest0:
                raise RuntimeConfigError(
                    f"rank {i} read different minibatches of {what} than rank 0 (fingerprint "
                    f"{info[1]} vs {digest0}): its inputs or targets would be paired with "
                    "another minibatch's", "give every rank the same deterministic loader over "
                    "the whole dataset (no DistributedSampler, no per-rank seed or shard): "
                    "fxpipe decides which replica trains on which minibatch")
        if not reads:
            parts, share = [(None, None)] * (count * (self.split if split else 1)), []
        elif self.index != 0 and split:
            parts, share = self._cut(parts, sizes)
        self._wire, self._samples, self._share = plan, samples, share
        self._sizes_read = list(sizes or [])
        return parts, count

    def _counted(self, parts: list[Batch], sizes: Sequence[int]) -> list[Batch]:
        """``parts`` (whole minibatches) with each target saying what its loss counts for in a
        mean over the data (:class:`~fxpipe.runtime.execution.contract.Weighted`): its samples
        (a mean loss, weighted by them; a sum, once), or its valid labels under a token-mean
        rule, on the ranks that compute the loss."""
        if not self.need_targets or len(sizes) != len(parts):
            return parts
        rule = self.loss_rule
        out = []
        for part, n in zip(parts, sizes):
            count = float(n)
            if rule is not None and rule.kind == "token":
                try:
                    count = units(rule, part, n)
                except (KeyError, TypeError, AttributeError):  # labels not on this rank
                    pass
            weight = 1.0 if rule is not None and rule.kind == "sum" else count
            out.append((part[0], Weighted(part[1], weight, count)))
        return out
