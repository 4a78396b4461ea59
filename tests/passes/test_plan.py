"""Plan: exact JSON round trip, atomic save, malformed files."""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest

from fxpipe.costmodel.hardware import Cluster
from fxpipe.costmodel.profile import Profile, ProfileNode
from fxpipe.errors import PlanFormatError
from fxpipe.passes import PLAN_FORMAT, Plan, StagePlan, partition, plan_for


def make_plan() -> Plan:
    nodes = tuple(ProfileNode(name=f"n{i}", op="call_module", target="m", forward_s=0.1 / (i + 1),
                              backward_s=0.2 / 3, activation_bytes=1e6 * (7 - i),
                              parameter_bytes=1e5 * i * i, inputs=(f"n{i - 1}",) if i else ())
                  for i in range(7))
    return partition(Profile(nodes=nodes, batch_size=64), Cluster(workers=6, bandwidth="1Gbps"))


def test_round_trip(tmp_path: Path) -> None:
    plan = make_plan()
    assert Plan.from_dict(plan.to_dict()) == plan
    assert Plan.from_dict(json.loads(json.dumps(plan.to_dict()))) == plan
    f = tmp_path / "plan.json"
    plan.save(f)
    assert Plan.load(f) == plan
    assert not (tmp_path / "plan.json.tmp").exists()
    assert json.loads(f.read_text())["format"] == PLAN_FORMAT
    assert plan.throughput == 64 / plan.time_per_minibatch
    s = plan.summary(detail=True)
    assert "time per minibatch" in s and "NOAM" in s and "speedup" in s
    assert "trainer admits" not in s and "NOAM" not in plan.summary()
    wide = dataclasses.replace(plan, window=plan.noam + 1)  # what compile records on a slow link
    assert Plan.from_dict(json.loads(json.dumps(wide.to_dict()))) == wide
    assert (f"NOAM (minibatches in flight at the input stage): {plan.noam}; under pipedream the "
            f"trainer admits {plan.noam + 1}, the fewest that hide the plan's round trips (the "
            "memory column is for the NOAM: the input stage holds a weight version and an "
            "activation set more per minibatch beyond it)" in wide.summary(detail=True).splitlines())
    old = plan.to_dict()
    del old["window"], old["one_worker_time"]  # a plan saved before the fields
    assert Plan.from_dict(old) == dataclasses.replace(plan, one_worker_time=None)


@pytest.mark.parametrize("mutate,field", [
    (lambda d: d.pop("sync"), "sync"),
    (lambda d: d.update(noam="two"), "noam"),
    (lambda d: d.update(window=2.5), "window"),
    (lambda d: d["stages"][0].update(replicas=1.5), "replicas"),
    (lambda d: d["stages"][0].pop("nodes"), "nodes"),
    (lambda d: d.update(time_per_minibatch=-1), "time_per_minibatch"),
    (lambda d: d.update(format="other/9"), "format"),
])
def test_malformed(tmp_path: Path, mutate, field: str) -> None:
    d = make_plan().to_dict()
    mutate(d)
    f = tmp_path / "bad.json"
    f.write_text(json.dumps(d))
    with pytest.raises(PlanFormatError) as ei:
        Plan.load(f)
    assert field in str(ei.value) and "bad.json" in str(ei.value)


def test_missing_and_garbage(tmp_path: Path) -> None:
    with pytest.raises(PlanFormatError, match="does not exist"):
        Plan.load(tmp_path / "nope.json")
    (tmp_path / "g.json").write_text("{not json")
    with pytest.raises(PlanFormatError, match="not valid JSON"):
        Plan.load(tmp_path / "g.json")


# ----------------------------------------------------------------------------- literal plans
def two_level_plan(batch_size: int | None = 8) -> Plan:
    """Four nodes of 10 ms and 50 MB of parameters, activations 1 MB; n0 owns emb.weight, which
    n3 uses too; n1's optimizer step takes 2 ms. 8 workers, 4 per machine, 1 Gbps between
    machines, 100 GB/s inside one; [n0 n1 on 4 | n2 n3 on 4]."""
    nodes = tuple(ProfileNode(
        name=f"n{i}", op="call_module", target="m", forward_s=0.01, backward_s=0.0,
        activation_bytes=1e6, parameter_bytes=5e7, inputs=(f"n{i - 1}",) if i else (),
        params=("emb.weight",) if i == 0 else (), shared_params=("emb.weight",) if i == 3 else (),
        update_s=0.002 if i == 1 else 0.0) for i in range(4))
    cluster = Cluster(workers=8, workers_per_machine=4, bandwidth=1.25e8, intra_bandwidth=1e11)
    return plan_for(Profile(nodes=nodes, batch_size=batch_size), cluster, [0, 2], [4, 4])


def test_summary_of_a_two_stage_plan_literally() -> None:
    """Stage 0: compute (0.02 + 0.002) / 4 = 5.5 ms plus sync 2 (3/4) 1e8 / 1e11 / 4 = 0.375 ms:
    5.875 ms, shown 5.88 ms; update 0.002 / 4 = 500 us; memory 3 P + (2 - 1) P + 2 A with
    P = 100 MB, A = 2 MB: 404 MB (v = ceil(8 / 4) = 2). Stage 1: 5 + 0.375 ms, the cut
    2 * 1 MB / (1.25e8 * 4) = 4 ms, memory 3 P + A with P = 100 MB and its copy of
    emb.weight, 50 MB: 452 MB. Data parallel on 8 spans machines:
    (0.042 + 2 (7/8) 2e8 / 1.25e8) / 8 = 355.25 ms: 355.25 / 5.875 = 60.47x; one worker: the
    four nodes' 40 ms and the 2 ms step, 42 / 5.875 = 7.15x. Batch 8: 8 / 5.875 ms = 1361.7
    samples/s. The detailed view adds the update column, its note, the memory rule and NOAM."""
    legend = ("(per minibatch: compute = forward, backward, optimizer step and weight sync of "
              "the stage's replicas; comm = activations in and gradients back; memory per "
              "worker)")
    tail = [
        "",
        "time per minibatch: 5.88 ms on 8 of 8 workers (allreduce sync; pipedream, by the "
        "planner's bottleneck)",
        "speedup: 60.47x over data parallelism on 8 workers (355 ms per minibatch), 7.15x over "
        "one worker (42 ms)",
        "throughput: 1361.7 samples/s (batch 8)",
        "parameters shared across stages: emb.weight [0, 1]; stage 1 keeps a copy (50 MB, in "
        "its memory)",
    ]
    assert two_level_plan().summary().splitlines() == [
        "stage  nodes                                    replicas    compute       comm     memory",
        "-" * 89,
        "    0  n0..n1 (2)                                      4    5.88 ms       0 us     404 MB",
        "    1  n2..n3 (2)                                      4    5.38 ms       4 ms     452 MB",
        legend, *tail]
    assert two_level_plan().summary(detail=True).splitlines() == [
        "stage  nodes                                    replicas    compute     update       comm     memory",
        "-" * 100,
        "    0  n0..n1 (2)                                      4    5.88 ms     500 us       0 us     404 MB",
        "    1  n2..n3 (2)                                      4    5.38 ms       0 us       4 ms     452 MB",
        legend, "(update = the optimizer step, included in compute)", *tail,
        "memory per worker priced for: pipedream",
        "NOAM (minibatches in flight at the input stage): 2",
    ]


def test_summary_of_data_parallelism_and_of_odd_spans() -> None:
    plan = two_level_plan(batch_size=None)
    assert plan.throughput is None and "throughput" not in plan.summary()
    assert not plan.is_data_parallel and plan.stage_of() == {"n0": 0, "n1": 0, "n2": 1, "n3": 1}
    one = dataclasses.replace(plan.stages[0], nodes=("n0",))
    long = dataclasses.replace(plan.stages[1], nodes=("a" * 30, "b" * 30))
    empty = dataclasses.replace(plan.stages[1], index=2, nodes=())
    lines = dataclasses.replace(plan, stages=(one, long, empty)).summary().splitlines()
    assert lines[2] == "    0  n0 (1)" + " " * 42 + "4    5.88 ms       0 us     404 MB"
    assert lines[3][:47] == "    1  " + "a" * 30 + ".." + "b" * 5 + "..."  # 40 columns at most
    assert lines[4].startswith("    2  (empty)")
    dp = dataclasses.replace(plan, stages=(dataclasses.replace(plan.stages[0], replicas=8),),
                             shared_parameters={})
    text = dp.summary()
    assert dp.is_data_parallel and text.endswith(
        "This plan is plain data parallelism on 8 workers: no pipeline is faster here (per "
        "minibatch: compute 5.5 ms, weight sync 375 us; a pipeline pays for its messages and "
        "its imbalance).")
    assert "shared across stages" not in text
    fewer = dataclasses.replace(dp, stages=(dataclasses.replace(dp.stages[0], replicas=3),),
                                workers_used=3)
    assert fewer.summary().splitlines()[-1] == (
        "This plan uses 3 of the 8 workers: none on more is faster here (their all-reduces and "
        "messages cost more than they save); in a 8-process job the other ranks idle.")
    old = dataclasses.replace(plan, one_worker_time=None)  # saved before it was recorded
    assert "over one worker" not in old.summary() and old.speedup_over_one_worker is None
    free = dataclasses.replace(plan, time_per_minibatch=0.0, batch_size=8)
    assert free.speedup_over_data_parallel == math.inf and free.throughput is None


# ----------------------------------------------------------------------------- every refusal
def _bad(d: dict) -> str:
    with pytest.raises(PlanFormatError) as ei:
        Plan.from_dict(d, origin="'p.json'")
    return ei.value.message


@pytest.mark.parametrize("edit, message", [
    (lambda d: d.update(stages="x"), "'p.json': field 'stages' must be list, got 'x'"),
    (lambda d: d["stages"].__setitem__(0, 3), "'p.json': stages[0] must be an object"),
    (lambda d: d["stages"][1].update(nodes=["n2", 3]),
     "'p.json': stages[1]: field 'nodes' must be a list of names"),
    (lambda d: d["stages"][0].update(index=True),
     "'p.json': stages[0]: field 'index' must be int, got True"),
    (lambda d: d["stages"][0].update(in_flight=2.0),
     "'p.json': stages[0]: field 'in_flight' must be int, got 2.0"),
    (lambda d: d["stages"][0].pop("replicas"), "'p.json': stages[0]: missing field 'replicas'"),
    (lambda d: d["stages"][0].pop("comm_s"), "'p.json': stages[0]: missing field 'comm_s'"),
    (lambda d: d["stages"][0].update(comm_s=True),
     "'p.json': stages[0]: field 'comm_s' must be a non-negative number, got True"),
    (lambda d: d["stages"][0].update(sync_s="1"),
     "'p.json': stages[0]: field 'sync_s' must be a non-negative number, got '1'"),
    (lambda d: d["stages"][0].update(memory_bytes=float("nan")),
     "'p.json': stages[0]: field 'memory_bytes' must be a non-negative number, got nan"),
    (lambda d: d.update(shared_parameters={"w": [0, "x"]}),
     "'p.json': field 'shared_parameters' must map names to stage index lists"),
    (lambda d: d.update(shared_parameters={"w": 3}),
     "'p.json': field 'shared_parameters' must map names to stage index lists"),
    (lambda d: d.update(shared_parameters=[]),
     "'p.json': field 'shared_parameters' must be dict, got []"),
    (lambda d: d.update(batch_size=True), "'p.json': field 'batch_size' must be an integer or null"),
    (lambda d: d.update(batch_size=8.0), "'p.json': field 'batch_size' must be an integer or null"),
    (lambda d: d.update(model_fingerprint=7),
     "'p.json': field 'model_fingerprint' must be a string or null"),
    (lambda d: d.update(cluster=[]), "'p.json': field 'cluster' must be dict, got []"),
    (lambda d: d.update(profile_source=None),
     "'p.json': field 'profile_source' must be str, got None"),
    (lambda d: d.update(workers_used=False),
     "'p.json': field 'workers_used' must be int, got False"),
    (lambda d: d.pop("data_parallel_time"), "'p.json': missing field 'data_parallel_time'"),
    (lambda d: d.pop("format"), "'p.json': field 'format' is None, expected 'fxpipe.plan/1'"),
])
def test_every_malformed_field_is_named(edit, message: str) -> None:
    d = json.loads(json.dumps(two_level_plan().to_dict()))
    edit(d)
    assert _bad(d) == message


def test_refusals_say_what_to_do_and_accept_what_is_valid() -> None:
    with pytest.raises(PlanFormatError) as ei:
        Plan.from_dict([1, 2])
    assert ei.value.message == "<dict>: a plan must be a JSON object"
    d = two_level_plan().to_dict()
    with pytest.raises(PlanFormatError) as ei:
        Plan.from_dict({**d, "format": "fxpipe.plan/0"})
    assert ei.value.hint == "make plans with fxpipe.passes.partition()"
    # valid variants: integer numbers, a null batch size and fingerprint, a string fingerprint
    ok = json.loads(json.dumps(d))
    ok["stages"][0]["comm_s"] = 0
    ok.update(batch_size=None, model_fingerprint="abc")
    plan = Plan.from_dict(ok)
    assert plan.stages[0].comm_s == 0.0 and isinstance(plan.stages[0].comm_s, float)
    assert plan.batch_size is None and plan.model_fingerprint == "abc"
    assert plan.shared_parameters == {"emb.weight": (0, 1)}


def test_load_names_the_file_and_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(PlanFormatError) as ei:
        Plan.load(tmp_path / "nope.json")
    assert ei.value.message == f"plan file {str(tmp_path / 'nope.json')!r} does not exist"
    assert ei.value.hint == "pass a file written by Plan.save()"
    f = tmp_path / "p.json"
    d = two_level_plan().to_dict()
    d["stages"][0]["replicas"] = "4"
    f.write_text(json.dumps(d))
    with pytest.raises(PlanFormatError) as ei:
        Plan.load(f)
    assert ei.value.message == f"{str(f)!r}: stages[0]: field 'replicas' must be int, got '4'"


def test_defaults_and_immutability() -> None:
    """A plan is a frozen value; the fields added over time default to what older plans meant."""
    sp = StagePlan(index=0, nodes=("a",), replicas=1, compute_s=1.0, sync_s=0.0,
                   stage_time_s=1.0, input_bytes=0.0, comm_s=0.0, parameter_bytes=0.0,
                   activation_bytes=0.0, memory_bytes=0.0, in_flight=1)
    assert sp.update_s == 0.0
    plan = Plan(stages=(sp,), cluster={}, sync="allreduce", time_per_minibatch=1.0, noam=1,
                data_parallel_time=1.0)
    assert (plan.batch_size, plan.shared_parameters, plan.model_fingerprint,
            plan.profile_source, plan.workers_used) == (None, {}, None, "fxpipe", 0)
    other = Plan(stages=(sp,), cluster={}, sync="allreduce", time_per_minibatch=1.0, noam=1,
                 data_parallel_time=1.0)
    assert plan.shared_parameters is not other.shared_parameters  # not one shared default
    with pytest.raises(dataclasses.FrozenInstanceError):
        sp.replicas = 2  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.noam = 2  # type: ignore[misc]


def test_span_column_and_shared_list_edges() -> None:
    """A stage's span is first..last node (three nodes here), cut to 40 columns only when
    longer; several shared parameters are listed comma-separated, sorted."""
    plan = two_level_plan()
    three = dataclasses.replace(plan.stages[0], nodes=("n0", "mid", "n1"))
    exact = dataclasses.replace(plan.stages[1], nodes=("a" * 17, "b" * 17))  # 17+2+17+4 = 40
    over = dataclasses.replace(plan.stages[1], index=2, nodes=("a" * 18, "b" * 17))  # 41
    shown = dataclasses.replace(plan, stages=(three, exact, over),
                                shared_parameters={"w2": (1, 2), "emb.weight": (0, 1)})
    lines = shown.summary().splitlines()
    assert lines[2][7:47] == "n0..n1 (3)".ljust(40)
    assert lines[3][7:47] == "a" * 17 + ".." + "b" * 17 + " (2)"
    assert lines[4][7:47] == ("a" * 18 + ".." + "b" * 17)[:37] + "..."
    assert lines[-1] == ("parameters shared across stages: emb.weight [0, 1], w2 [1, 2]; "
                         "stage 1 keeps a copy (50 MB, in its memory); stage 2 keeps a copy "
                         "(50 MB, in its memory)")  # both made from the plan's stage 1


def test_to_dict_is_plain_json() -> None:
    d = two_level_plan().to_dict()
    assert set(d) == {"format", *(f.name for f in dataclasses.fields(Plan))}
    assert d["shared_parameters"] == {"emb.weight": [0, 1]}
    assert d["stages"][0]["nodes"] == ["n0", "n1"]
    assert json.loads(json.dumps(d)) == d  # lists, not tuples: JSON gives back the same
    d["format"] = "other/9"
    assert _bad(d) == "'p.json': field 'format' is 'other/9', expected 'fxpipe.plan/1'"


# ----------------------------------------------------------------------------- staleness table
def test_summary_names_the_stages_by_spans_and_shows_staleness_literally() -> None:
    """``spans`` replaces first..last node (still cut to 40 columns); a plan with a staleness
    table ends with it: one row per schedule, own/global per stage, the schedule column as wide
    as the longest name plus 2, each stage column 10 wide."""
    plan = dataclasses.replace(two_level_plan(), staleness={"pipedream": ((1, 2), (0, 0)),
                                                            "2bw": ((1, 1), (1, 1))})
    lines = plan.summary(spans=["embedding", "x" * 45], detail=True).splitlines()
    assert lines[2][7:47] == "embedding (2)".ljust(40)
    assert lines[3][7:47] == ("x" * 45 + " (2)")[:37] + "..."
    assert "weight staleness" not in plan.summary()  # the first screen leaves it to detail
    assert lines[-5:] == [
        "",
        "weight staleness (steady state, per stage: own updates / global block updates as in "
        "Randomized PipeDream):",
        "schedule      stage 0   stage 1",
        "pipedream         1/2       0/0",
        "2bw               1/1       1/1",
    ]
    assert "weight staleness" not in two_level_plan().summary()  # no table: no section


def test_staleness_table_of_a_deep_pipeline_shows_the_worst_stage() -> None:
    """Up to 8 stages one column each; deeper, one column: the largest own / largest global
    (taken separately, over the stages)."""
    from fxpipe.passes.plan import format_staleness

    eight = [(i, 7 - i) for i in range(8)]
    assert format_staleness({"pd": eight}).splitlines() == [
        "schedule" + "".join(f"{'stage ' + str(s):>10}" for s in range(8)),  # w = 2 + 2
        "pd  " + "".join(f"{f'{o}/{g}':>10}" for o, g in eight),
    ]
    nine = [(0, 5), (3, 1)] + [(1, 1)] * 7
    assert format_staleness({"pipedream": nine}).splitlines() == [
        "schedule   worst stage",  # 11 characters overflow the 10-wide column
        "pipedream         3/5",
    ]


def test_staleness_round_trips_and_every_malformed_table_is_refused() -> None:
    plan = dataclasses.replace(two_level_plan(), staleness={"pipedream": ((1, 2), (0, 0))})
    d = plan.to_dict()
    assert d["staleness"] == {"pipedream": [[1, 2], [0, 0]]}
    back = Plan.from_dict(json.loads(json.dumps(d)))
    assert back.staleness == {"pipedream": ((1, 2), (0, 0))} and back == plan
    old = plan.to_dict()
    del old["staleness"]  # plans written before the field existed
    assert Plan.from_dict(old).staleness == {}
    zero = plan.to_dict()
    zero["staleness"] = {"gpipe": [[0, 0], [0, 0]]}
    assert Plan.from_dict(zero).staleness == {"gpipe": ((0, 0), (0, 0))}
    message = ("'p.json': field 'staleness' must map schedule names to one [own, global] pair "
               "of non-negative integers per stage (2)")
    for bad in ([], {"pd": ((1, 2), (0, 0))}, {"pd": [[1, 2]]}, {"pd": [[1, 2], [0, 0], [0, 0]]},
                {"pd": [[1, 2], (0, 0)]}, {"pd": [[1, 2], [0]]}, {"pd": [[1, 2], [0, 0, 0]]},
                {"pd": [[1, 2], [0, -1]]}, {"pd": [[1, 2], [True, 0]]},
                {"pd": [[1, 2], [0, 1.0]]}):
        d = plan.to_dict()
        d["staleness"] = bad
        with pytest.raises(PlanFormatError) as ei:
            Plan.from_dict(d, origin="'p.json'")
        assert ei.value.message == message, bad
        assert ei.value.hint == "re-plan, or delete the field: it is recomputed by fxpipe.compile"
