"""auto decided on the job's own pipeline (runtime/training/auto_pipeline.py): the same curves and
decision as the pilot on copies, and a run whose winner continues from its pilot's end equal to
training the winner by name (with the drain the pilot's end makes)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from rt_helpers import batches, loss_fn, split, tiny_mlp

from fxpipe.runtime.errors import RuntimeConfigError
from fxpipe.runtime.training.auto import AutoOptions
from fxpipe.runtime.training.trainer import Trainer

STAGES = [1, 1, 1]


def trainer(schedule: str, lr: float = 0.05, **kw) -> Trainer:
    return Trainer(split(tiny_mlp(), [1, 3]), STAGES, loss_fn,
                   lambda ps: torch.optim.SGD(ps, lr=lr, momentum=0.5), schedule=schedule,
                   executor="reference", progress=False, **kw)


def options(where: str, candidates: tuple[str, ...], **kw) -> dict:
    return {"pilot": 24, "min_pilot": 8, "max_fraction": 1.0, "max_cost": None,
            "candidates": candidates, "where": where, **kw}


CANDIDATES = ("1f1b-flush", "gpipe", "pipedream", "pipedream+lr_scale", "pipedream+nesterov",
              "2bw")


@pytest.mark.slow
def test_the_pipeline_pilot_sees_what_the_copies_see() -> None:
    """Same minibatches, same weights, same rule: the candidates' minibatches to the level (and
    the level) agree with the pilot on copies to float tolerance."""
    data = batches(40)
    got = {}
    for where in ("copies", "pipeline"):
        t = trainer("auto", auto_options=options(where, CANDIDATES))
        t.fit(data, epochs=1)
        got[where] = t.auto_decision
    a, b = got["copies"], got["pipeline"]
    piloted = {r.schedule: r.piloted for r in b.rows}
    assert b.where == "pipeline" and a.continued == 0
    assert b.continued == piloted[b.schedule]  # the winner goes on from its own pilot's end
    rows = {r.schedule: r for r in a.rows}
    # on copies, flush's seconds give the faster candidates more minibatches (40, all there
    # are); on the pipeline each stops at the end of the segment (8 + 16) where it reached
    # flush's level (auto.can_stop), which leaves the choice as it was
    assert rows["1f1b-flush"].piloted == 24 < rows["pipedream"].piloted == 40
    assert piloted["1f1b-flush"] == 24 and piloted["pipedream"] == 24
    assert b.level == pytest.approx(a.level, rel=1e-6)
    assert {r.schedule for r in b.rows} == set(rows)
    for r in b.rows:
        assert r.minibatches == rows[r.schedule].minibatches, r.schedule
        assert r.period_s == pytest.approx(rows[r.schedule].period_s)
    assert b.schedule == a.schedule
    assert "this job's pipeline, the winner continuing" in b.summary()


@pytest.mark.slow
@pytest.mark.parametrize("candidates,lr,winner", [
    (("1f1b-flush",), 0.05, "1f1b-flush"),
    # zb-h1 updates as flush does (its curve is flush's) with a smaller bubble: it wins and
    # continues from flush's end state
    (("1f1b-flush", "zb-h1"), 0.05, "zb-h1"),
    (("1f1b-flush", "zb-h1", "pipedream", "2bw"), 0.05, "pipedream"),
])
def test_the_winner_continues_from_its_pilot(tmp_path: Path, candidates: tuple[str, ...],
                                             lr: float, winner: str) -> None:
    """auto on the pipeline, then training, equals training the winner by name with the
    pipeline drained at the pilot's end (a checkpoint there): nothing of the losers' pilots
    leaks into the weights, the optimizer or the LR schedule, and the pilot's minibatches are
    trained once."""
    data = batches(48)
    auto = trainer("auto", lr=lr, auto_options=options("pipeline", candidates))
    auto.fit(data, epochs=1)
    d = auto.auto_decision
    assert d is not None and d.schedule == winner
    assert d.continued == {r.schedule: r.piloted for r in d.rows}[winner] >= 24
    named = trainer(d.schedule, lr=lr, checkpoint_dir=str(tmp_path),
                    checkpoint_every=d.continued,
                    split=d.split if d.split > 1 else None)
    named.fit(data, epochs=1)
    want, got = named.state_dict(), auto.state_dict()
    assert set(want) == set(got)
    for n, t in want.items():
        assert torch.allclose(t, got[n], rtol=0, atol=1e-6), n
    assert auto.history[0]["samples"] == named.history[0]["samples"] == 48 * 4
    assert auto.history[0]["loss"] == pytest.approx(named.history[0]["loss"], rel=1e-6)


def test_where_is_checked() -> None:
    with pytest.raises(RuntimeConfigError, match="where='gpu'"):
        AutoOptions.make({"where": "gpu"})


@pytest.mark.slow
def test_a_pipeline_pilot_priced_out_is_not_run() -> None:
    """Three trained candidates x 24 minibatches, less the cheapest one's, against a run of 48:
    far above max_cost = 25%: flush without a pilot."""
    t = trainer("auto", auto_options=options("pipeline", ("1f1b-flush", "pipedream", "2bw"),
                                             max_cost=0.25))
    t.fit(batches(48), epochs=1)
    d = t.auto_decision
    assert d.schedule == "1f1b-flush" and not d.rows and d.continued == 0
    assert "a pilot on the pipeline would cost" in d.reason


def test_extra_copies_by_hand() -> None:
    """Weight copies beyond flush's one version, 3 minibatches in flight on the stage."""
    from fxpipe.runtime.schedules.spec import parse_schedule
    from fxpipe.runtime.training.auto_pipeline import extra_copies

    def copies(c: str, stashing: bool = True) -> int:
        spec = parse_schedule(c)
        return extra_copies(spec.kind, spec.mitigation, 3, stashing)

    assert copies("1f1b-flush") == copies("gpipe") == copies("zb-h2") == 0
    assert copies("pipedream") == copies("pipedream+lr_scale") == 2      # 3 versions
    assert copies("pipedream+nesterov") == copies("pipedream+momentum") == 2
    assert copies("pipedream", stashing=False) == 0
    assert copies("2bw") == 1
    assert copies("pipedream+predict") == 2 + 3 + 2  # a predicted copy per minibatch, delta, clone
    assert copies("pipedream+dc") == 2 + 2


@pytest.mark.slow
def test_a_candidate_with_too_many_weight_copies_is_not_piloted(monkeypatch) -> None:
    """The process peaked at 10x the model's weight bytes after flush's pilot; max_memory 20%
    allows 2x more: pipedream (stage s stashes 3 - s versions: 2 + 1 + 0 = 3 stage-sized
    copies at most, of stages smaller than the model) pilots, pipedream+predict does not."""
    from fxpipe.runtime.training import auto_pipeline

    t = trainer("auto", auto_options=options("pipeline", ("1f1b-flush", "pipedream",
                                                          "pipedream+predict")))
    weights = sum(p.numel() * p.element_size() for st in t.stages for p in st.gm.parameters())
    monkeypatch.setattr(auto_pipeline, "process_peak_bytes", lambda device: 10 * weights)
    def need(c: str) -> int:
        return auto_pipeline.candidate_memory(c, t.replicas, t.microbatches,
                                              auto_pipeline.weight_bytes(t),
                                              noam=t._noam(c.split("+")[0]))

    pd = need("pipedream")
    assert 0 < pd <= 2 * weights < need("pipedream+predict")
    t.fit(batches(48), epochs=1)
    rows = {r.schedule: r for r in t.auto_decision.rows}
    assert rows["pipedream"].minibatches < float("inf")
    assert "not run: it would hold about" in rows["pipedream+predict"].note
    assert "max_memory=20%" in rows["pipedream+predict"].note
    assert t.auto_decision.schedule != "pipedream+predict"
