"""The recipe trains the modes and gradients of plain PyTorch (issue 23, "Modes and gradients as
in PyTorch"), each case against an eager loop written here (no fxpipe code in the oracle: the same
model copy, the same batches, ``opt.step()`` once per loader minibatch, or per M minibatches of
``loss / M`` for a named flushing schedule with ``microbatches=M``):

* a parameter that gets no gradient (its Linear's output is ``.detach()``ed) is not stepped, as
  torch.optim skips ``grad=None``: AdamW's weight decay and SGD's momentum + weight decay leave it
  exactly in place; in the same stage as the detach, in the stage before it (the gradient message
  is not sent at all), and tied across two stages (no step only when no holder had a gradient);
* a BatchNorm the user put in ``eval()`` keeps its running statistics bit for bit (fit does not
  call ``train()``), graphs from ``torch.export`` included, where a dropout in eval (a module's,
  and Hugging Face's functional ``F.dropout(..., training=self.training)``) stays off.

Every schedule where it applies (the default ``"auto"``, ``1f1b-flush``, ``gpipe``, ``zb-h1``,
``pipedream``) on the reference executor, and the distributed executor in ONE torchrun job of 2
gloo ranks (this file is its script: ``python -m torch.distributed.run ... THIS OUTDIR``), over
its three update paths: a lone replica's local update, the bucketed replica all-reduce and the
flat one (with tied segments). pipedream on 2 stages of one replica is asynchronous, so there it
is compared only on what staleness cannot change (the parameter stays exactly, the statistics
stay exactly) and on one stage, where it is plain SGD (2 replicas: one update per 2 minibatches).
"""
from __future__ import annotations

import copy
import functools
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

import fxpipe
from fxpipe.codegen.split import placed_nodes, split_graph
from fxpipe.runtime.replica.stage import tied_parameters
from fxpipe.runtime.training.trainer import Trainer

CLUSTER = {"workers": 2, "device": "V100"}  # estimated costs: every rank plans the same cut
adamw = functools.partial(torch.optim.AdamW, lr=0.01, weight_decay=0.1)
sgd_wd = functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9, weight_decay=0.1)
OPTIMIZERS = {"adamw": adamw, "sgd": sgd_wd}
FLUSHING = ("1f1b-flush", "gpipe", "zb-h1")
M = 2  # microbatches of a named flushing schedule: loader minibatches per update
NO_PILOT = {"pilot": 0}  # auto without a pilot: 1f1b-flush, each minibatch cut in 2


# ----------------------------------------------------------------------------- models
class Detached(nn.Module):
    """``frozen``'s output is detached: plain PyTorch leaves ``frozen`` with ``grad=None``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.frozen = nn.Linear(4, 8), nn.Linear(4, 8)
        self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x)) + self.frozen(x).detach()
        return self.c(torch.tanh(self.b(h)))


class FrozenNorm(nn.Module):
    """Linear, BatchNorm, tanh, Linear, dropout, Linear; :func:`frozen_norm` puts the BatchNorm
    (and the dropout) in ``eval()``, as a user freezing pretrained statistics does."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.bn = nn.Linear(4, 8), nn.BatchNorm1d(8)
        self.b, self.drop, self.c = nn.Linear(8, 8), nn.Dropout(0.5), nn.Linear(8, 2)
        with torch.no_grad():  # statistics that differ from any batch's
            self.bn.running_mean.uniform_(-1.0, 1.0)
            self.bn.running_var.uniform_(0.5, 2.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(self.drop(torch.tanh(self.b(self.bn(self.a(x))))))


class Attention(nn.Module):
    """A Hugging Face style block: its dropout is functional, following ``self.training``."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + F.dropout(torch.tanh(self.proj(h)), p=0.5, training=self.training)


class FrozenHF(nn.Module):
    """For ``torch.export``: a BatchNorm, a dropout module and a functional dropout, all three
    in ``eval()`` while the rest of the model is in train mode."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.bn = nn.Linear(4, 8), nn.BatchNorm1d(8)
        self.attn, self.drop, self.c = Attention(), nn.Dropout(0.5), nn.Linear(8, 2)
        with torch.no_grad():
            self.bn.running_mean.uniform_(-1.0, 1.0)
            self.bn.running_var.uniform_(0.5, 2.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(self.drop(self.attn(self.bn(self.a(x)))))


class TiedDetach(nn.Module):
    """``shared`` and ``both`` are called on both stages of cut [8]: ``shared``'s first use is
    detached and its second is not (a gradient, from stage 1 only); both uses of ``both`` are
    detached (no gradient anywhere: no step)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.shared = nn.Linear(4, 6), nn.Linear(6, 6)
        self.both, self.out = nn.Linear(6, 6), nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        h = h + self.shared(h).detach() + self.both(h).detach()
        h2 = torch.tanh(h)
        return self.out(h2 + self.shared(h2) + self.both(h2).detach())


def frozen_norm(cls: type[nn.Module] = FrozenNorm) -> nn.Module:
    model = cls()
    model.bn.eval()  # type: ignore[union-attr]
    model.drop.eval()  # type: ignore[union-attr]
    if isinstance(model, FrozenHF):
        model.attn.eval()
    return model


def data(n: int = 8, batch: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(batch, 4, generator=g), torch.randn(batch, 2, generator=g))
            for _ in range(n)]


# ----------------------------------------------------------------------------- the oracle
def plain(model: nn.Module, batches: list, optimizer: Callable[..., torch.optim.Optimizer],
          accumulate: int = 1) -> dict[str, torch.Tensor]:
    """Eager PyTorch on a copy: one step per ``accumulate`` minibatches (their ``loss /
    accumulate`` backwarded in turn), gradients set to None after each step, modes untouched."""
    m = copy.deepcopy(model)
    opt = optimizer(m.parameters())
    for i in range(0, len(batches), accumulate):
        for x, y in batches[i:i + accumulate]:
            (F.mse_loss(m(x), y) / accumulate).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {n: t.detach().clone() for n, t in m.state_dict().items()}


# ----------------------------------------------------------------------------- fxpipe runs
def compiled_trainer(model: nn.Module, schedule: str, optimizer: Callable[..., Any], *,
                     stages: int = 2, workers: int = 2, executor: str = "reference",
                     tracer: str = "auto", **kwargs: Any) -> tuple[Any, Trainer]:
    """``fxpipe.compile`` then ``compiled.trainer`` as a user writes them; ``schedule="auto"``
    is the default (not passed), a named flushing kind gets ``microbatches=M``."""
    compiled = fxpipe.compile(model, fxpipe.Cluster(**{**CLUSTER, "workers": workers}),
                              example_inputs=(data()[0][0],), loss_fn=F.mse_loss, stages=stages,
                              straight=stages > 1, tracer=tracer)  # one stage: all replicas
    if schedule == "auto":
        kwargs.setdefault("auto_options", NO_PILOT)
    else:
        kwargs["schedule"] = schedule
        if schedule in FLUSHING:
            kwargs["microbatches"] = M
    return compiled, compiled.trainer(optimizer=optimizer, executor=executor, progress=False,
                                      **kwargs)


def hand_split(model: nn.Module, cut: int) -> list:
    """Stages 0 and 1 of ``model``, split after placed node ``cut`` (placeholders count)."""
    gm = fx.symbolic_trace(model)
    return split_graph(gm, {n.name: int(i > cut) for i, n in enumerate(placed_nodes(gm))})


def split_trainer(model: nn.Module, cut: int, schedule: str, optimizer: Callable[..., Any], *,
                  executor: str = "reference") -> Trainer:
    return Trainer(hand_split(model, cut), [1, 1], F.mse_loss, optimizer, schedule=schedule,
                   microbatches=M if schedule in FLUSHING else None, executor=executor,
                   progress=False)


def modes(model: nn.Module) -> list[tuple[str, bool]]:
    return [(n, m.training) for n, m in model.named_modules()]


def accumulation(schedule: str, replicas: int = 1) -> int:
    """Loader minibatches per update: M for a named flushing kind, else one per replica."""
    return M if schedule in FLUSHING else replicas


def assert_like_plain(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor],
                      what: str) -> None:
    assert set(got) == set(want), what
    for n, t in want.items():
        torch.testing.assert_close(got[n], t, rtol=1e-5, atol=1e-6, msg=f"{what}: {n}")


def assert_in_place(got: dict[str, torch.Tensor], before: dict[str, torch.Tensor],
                    prefixes: tuple[str, ...], what: str) -> None:
    """Exactly the values of before training, bit for bit (no step was taken)."""
    names = [n for n in before if n.startswith(prefixes)]
    assert names, what
    for n in names:
        assert torch.equal(got[n], before[n]), f"{what}: {n} moved"


FROZEN_STATS = ("bn.running_mean", "bn.running_var", "bn.num_batches_tracked")


# ----------------------------------------------------------------------------- reference executor
@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
@pytest.mark.parametrize("schedule", ["auto", *FLUSHING])
def test_a_detached_parameter_is_not_stepped(schedule: str, opt: str) -> None:
    model, batches = Detached(), data()
    before = copy.deepcopy(model.state_dict())
    want = plain(model, batches, OPTIMIZERS[opt], accumulation(schedule))
    _, trainer = compiled_trainer(copy.deepcopy(model), schedule, OPTIMIZERS[opt])
    trainer.fit(batches)
    got = trainer.state_dict()
    assert_in_place(got, before, ("frozen.",), schedule)
    assert_like_plain(got, want, f"{schedule}, {opt}")


@pytest.mark.parametrize("workers, stages, replicas", [(1, 1, [1]), (2, 1, [2]), (2, 2, [1, 1])])
def test_pipedream_leaves_a_detached_parameter_in_place(workers: int, stages: int,
                                                        replicas: list[int]) -> None:
    """One stage (one replica, or two summing each round of 2) is plain SGD: all of it is
    compared; on 2 stages only what staleness cannot change."""
    model, batches = Detached(), data()
    before = copy.deepcopy(model.state_dict())
    compiled, trainer = compiled_trainer(copy.deepcopy(model), "pipedream", adamw,
                                         stages=stages, workers=workers)
    assert list(compiled.plan.replicas) == replicas
    trainer.fit(batches)
    got = trainer.state_dict()
    assert_in_place(got, before, ("frozen.",), "pipedream")
    if stages == 1:
        assert_like_plain(got, plain(model, batches, adamw, workers), "pipedream, one stage")


@pytest.mark.parametrize("schedule", ["auto", *FLUSHING, "pipedream"])
def test_a_batch_norm_in_eval_keeps_its_statistics(schedule: str) -> None:
    model, batches = frozen_norm(), data()
    before, was = copy.deepcopy(model.state_dict()), modes(model)
    compiled, trainer = compiled_trainer(copy.deepcopy(model), schedule, sgd_wd)
    assert modes(compiled.model) == was  # compile left the user's modes as they were
    trainer.fit(batches, eval_loader=batches[:2])
    got = trainer.state_dict()
    assert modes(compiled.model) == was
    assert_in_place(got, before, FROZEN_STATS, schedule)
    if schedule != "pipedream":  # 2 stages of pipedream are stale: statistics only
        assert_like_plain(got, plain(model, batches, sgd_wd, accumulation(schedule)), schedule)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["auto", "1f1b-flush"])
def test_export_traced_modules_in_eval_train_as_in_eager(schedule: str) -> None:
    """torch.export bakes modes into the graph; tracing/modes.py gives each op back the mode of
    the module it came from, and compile leaves the user's modules in their modes."""
    model, batches = frozen_norm(FrozenHF), data()
    before, was = copy.deepcopy(model.state_dict()), modes(model)
    compiled, trainer = compiled_trainer(copy.deepcopy(model), schedule, sgd_wd, tracer="export")
    assert compiled.tracer == "export"
    assert modes(compiled.model) == was
    trainer.fit(batches)
    got = trainer.state_dict()
    assert_in_place(got, before, FROZEN_STATS, schedule)
    assert_like_plain(got, plain(model, batches, sgd_wd, accumulation(schedule)), schedule)


@pytest.mark.slow
@pytest.mark.parametrize("where", ["pipeline", "copies"])
def test_the_default_with_a_pilot_keeps_modes_and_skips_the_detached_parameter(where: str
                                                                                ) -> None:
    """schedule="auto" with a real pilot (on the job's pipeline, the default, or on copies of the
    stages; in the user's modes): whatever it picks, what no schedule may change stays
    exactly."""
    batches = data(12)
    for model, names in ((Detached(), ("frozen.",)), (frozen_norm(), FROZEN_STATS)):
        before, was = copy.deepcopy(model.state_dict()), modes(model)
        compiled, trainer = compiled_trainer(
            copy.deepcopy(model), "auto", adamw,
            auto_options={"pilot": 6, "min_pilot": 4, "max_fraction": 1.0, "max_cost": None,
                          "where": where})
        trainer.fit(batches)
        assert trainer.auto_decision is not None and trainer.auto_decision.pilot_minibatches
        assert_in_place(trainer.state_dict(), before, names, trainer.auto_decision.schedule)
        assert modes(compiled.model) == was


@pytest.mark.parametrize("schedule", ["1f1b-flush", "pipedream"])
def test_a_tied_parameter_is_stepped_when_any_holder_has_a_gradient(schedule: str) -> None:
    """Across the tie as across replicas: ``shared`` (a gradient on stage 1 only) is stepped
    on both stages alike, ``both`` (no gradient on either) on neither. pipedream delays the
    tied rounds (asynchronous): compared only on ``both``."""
    model, batches = TiedDetach(), data()
    before = copy.deepcopy(model.state_dict())
    trainer = split_trainer(copy.deepcopy(model), 8, schedule, adamw)
    tied = {n for t in tied_parameters(trainer.stages) for n in t.names.values()}
    assert {"shared.weight", "both.weight"} <= tied
    trainer.fit(batches)
    got = trainer.state_dict()
    assert_in_place(got, before, ("both.",), schedule)
    copies = [trainer.local[(s, 0)].stash.latest["shared.weight"] for s in (0, 1)]
    assert torch.equal(*copies) and not torch.equal(copies[0], before["shared.weight"])
    if schedule != "pipedream":
        assert_like_plain(got, plain(model, batches, adamw, M), schedule)


@pytest.mark.parametrize("schedule", ["1f1b-flush", "pipedream"])
def test_a_parameter_detached_on_the_next_stage_gets_no_gradient(schedule: str) -> None:
    """Cut [3]: ``frozen`` on stage 0, its ``.detach()`` the first thing stage 1 does with it.
    Stage 1 computes no gradient for it, none is sent, and ``frozen`` is not stepped (a zero
    gradient sent back would let AdamW's weight decay move it)."""
    model, batches = Detached(), data()
    stages = hand_split(copy.deepcopy(model), 3)
    assert "frozen" in stages[1].inputs and "frozen" in stages[0].outputs
    before = copy.deepcopy(model.state_dict())
    trainer = split_trainer(copy.deepcopy(model), 3, schedule, adamw)
    trainer.fit(batches)
    got = trainer.state_dict()
    assert_in_place(got, before, ("frozen.",), schedule)
    if schedule != "pipedream":
        assert_like_plain(got, plain(model, batches, adamw, M), schedule)


# ----------------------------------------------------------------------------- torchrun
@dataclass(frozen=True)
class Case:
    """One run of the distributed job and what plain PyTorch says of it: ``model_fn`` builds the
    model, trained with ``optimizer`` under ``schedule``; ``per``: loader minibatches per update
    of the oracle; ``keep``: state that must stay exactly; ``whole``: compare everything with
    the oracle (False: asynchronous, ``keep`` only)."""

    model_fn: Callable[[], nn.Module]
    schedule: str
    optimizer: Callable[..., Any]
    per: int
    keep: tuple[str, ...]
    whole: bool = True
    stages: int = 2
    cut: int | None = None  # a hand split after this placed node (else fxpipe.compile's)
    flat: bool = False  # one flat all-reduce of the replicas instead of buckets

    def trainer(self, executor: str) -> Trainer:
        if self.cut is not None:
            return split_trainer(self.model_fn(), self.cut, self.schedule, self.optimizer,
                                 executor=executor)
        trainer = compiled_trainer(self.model_fn(), self.schedule, self.optimizer,
                                   stages=self.stages, executor=executor)[1]
        if self.flat:  # the executor's flat path: read at every update, so set before fit
            trainer.backend.ex.overlap_allreduce = False
        return trainer


CASES = {
    "detached, auto": Case(Detached, "auto", adamw, 1, ("frozen.",)),
    "detached, 1f1b-flush, sgd": Case(Detached, "1f1b-flush", sgd_wd, M, ("frozen.",)),
    "detached, one stage x 2, buckets": Case(Detached, "pipedream", adamw, 2, ("frozen.",),
                                             stages=1),
    "detached, one stage x 2, flat": Case(Detached, "pipedream", sgd_wd, 2, ("frozen.",),
                                          stages=1, flat=True),
    "detached, pipedream": Case(Detached, "pipedream", adamw, 1, ("frozen.",), whole=False),
    "detached on the next stage, zb-h1": Case(Detached, "zb-h1", adamw, M, ("frozen.",), cut=3),
    "frozen norm, auto": Case(frozen_norm, "auto", sgd_wd, 1, FROZEN_STATS),
    "frozen norm, gpipe": Case(frozen_norm, "gpipe", sgd_wd, M, FROZEN_STATS),
    "frozen norm, pipedream": Case(frozen_norm, "pipedream", sgd_wd, 1, FROZEN_STATS,
                                   whole=False),
    "tied, 1f1b-flush": Case(TiedDetach, "1f1b-flush", adamw, M, ("both.",), cut=8),
    "tied, pipedream": Case(TiedDetach, "pipedream", adamw, 1, ("both.",), whole=False, cut=8),
}


def _job(outdir: str) -> None:
    """Every rank: each case in turn on the distributed executor (one process group for all);
    rank 0 saves what ``trainer.state_dict()`` gathered, the models' modes and which update path
    ran: 2 stages of one replica update locally (or, tied, with the flat buffer and its tied
    segments), one stage of 2 replicas through the gradient buckets or the flat all-reduce."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    out: dict[str, Any] = {}
    for name, case in CASES.items():
        trainer = case.trainer("distributed")
        trainer.fit(data())
        state = trainer.state_dict()
        out[name] = {"state": {n: t.clone() for n, t in state.items()},
                     "modes": [m.training for st in trainer.stages for m in st.gm.modules()],
                     "replicas": list(trainer.replicas),  # which update path ran (see CASES)
                     "buckets": trainer.backend.ex._buckets is not None}
        trainer.close()
    if dist.get_rank() == 0:
        torch.save(out, Path(outdir) / "results.pt")
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.multiprocess
def test_the_distributed_executor_in_one_torchrun_job(tmp_path: Path) -> None:
    from rt_procs import _port, _run

    res = _run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
                "--master-addr=127.0.0.1", f"--master-port={_port()}", __file__, str(tmp_path)],
               timeout=420)
    assert res.returncode == 0, res.stdout[-4000:]
    got = torch.load(tmp_path / "results.pt", weights_only=True)
    assert set(got) == set(CASES)
    batches, failed = data(), {}
    for name, case in CASES.items():  # every case checked, then all failures named at once
        try:
            model, state = case.model_fn(), got[name]["state"]
            assert_in_place(state, model.state_dict(), case.keep, name)
            if case.whole:
                assert_like_plain(state, plain(model, batches, case.optimizer, case.per), name)
            replicated = case.stages == 1
            assert got[name]["replicas"] == ([2] if replicated else [1, 1]), name
            assert got[name]["buckets"] is (replicated and not case.flat), name
            if case.model_fn is frozen_norm:  # the BatchNorm (and dropout) in eval, the rest not
                assert not all(got[name]["modes"]) and any(got[name]["modes"]), name
        except AssertionError as err:
            failed[name] = str(err).splitlines()[0]
    assert not failed, "\n".join(f"{n}: {e}" for n, e in failed.items())


if __name__ == "__main__":  # torchrun's script (see the module doc)
    _job(sys.argv[1])
