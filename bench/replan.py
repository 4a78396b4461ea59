"""Re-planning in place from a deliberately wrong profile (issue 13, item 1), local gloo ranks.

    .venv/bin/python bench/replan.py [--procs 2] [--repeats 3]

Costs of an MLP are measured once on this machine (the RIGHT profile; its plan is the right
plan). The WRONG profile multiplies the right plan's stage 0 costs by 4; its plan cuts
elsewhere. Three runs per repeat, one after the other, each ``--procs`` torchrun ranks (gloo,
one thread each), 1f1b-flush:

* ``right``: the right plan;
* ``wrong``: the wrong plan, kept (the cost of believing the wrong profile);
* ``replan``: the wrong plan with ``replan="auto"``: after the first segment every rank
  measures its stage from its timeline, the ranks agree on a re-solved plan and switch to it
  in place (``fxpipe.runtime.trainer_switch``).

Every run records timelines (so the three pay the same) and the seconds per minibatch of every
segment; throughput excludes the first segment of each plan (warm-up). Results go to
BENCHMARKS.md (section "replan").
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

D, B, L = 512, 32, 6  # width, batch (samples per minibatch), hidden layers
MINIBATCHES, SEGMENT, MICRO = 256, 8, 4


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList([nn.Linear(D, D) for _ in range(L)])
        self.head = nn.Linear(D, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.head(x)


def data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(B, D, generator=g), torch.randint(0, 10, (B,), generator=g))
            for _ in range(MINIBATCHES)]


def plans(procs: int, work: Path) -> dict[str, Any]:
    """Measure the right profile here; derive the wrong one; save both with their plans."""
    import fxpipe
    from fxpipe.passes.partition import partition
    from fxpipe.runtime.replan import stage_starts

    torch.set_num_threads(1)
    cluster = fxpipe.Cluster(workers=procs)
    c = fxpipe.compile(Net(), cluster, example_inputs=(torch.randn(B, D),),
                       loss_fn=F.cross_entropy, repeats=5)
    right, plan = c.profile, c.plan
    x4 = set(plan.stages[0].nodes)
    bad = replace(right, nodes=tuple(
        replace(nd, forward_s=4 * nd.forward_s, backward_s=4 * nd.backward_s,
                update_s=4 * nd.update_s) if nd.name in x4 else nd for nd in right.nodes))
    bad_plan = replace(partition(bad, cluster), model_fingerprint=plan.model_fingerprint)
    info = {"right": {"profile": right.to_dict(), "plan": plan.to_dict()},
            "wrong": {"profile": bad.to_dict(), "plan": bad_plan.to_dict()},
            "starts": {"right": stage_starts(right, plan), "wrong": stage_starts(bad, bad_plan)}}
    (work / "plans.json").write_text(json.dumps(info))
    return info


def worker(work: Path, run: str) -> int:
    """One rank of one run (launched by torchrun)."""
    import fxpipe
    from fxpipe.costmodel import Profile
    from fxpipe.passes import Plan

    torch.set_num_threads(1)
    info = json.loads((work / "plans.json").read_text())
    which = "right" if run == "right" else "wrong"
    plan, profile = (Plan.from_dict(info[which]["plan"]),
                     Profile.from_dict(info[which]["profile"]))
    c = fxpipe.compile(Net(), fxpipe.Cluster(workers=int(os.environ["WORLD_SIZE"])),
                       example_inputs=(torch.randn(B, D),), loss_fn=F.cross_entropy, plan=plan,
                       repeats=1)
    c.profile = profile  # what this run believes
    t = c.trainer(optimizer=lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=0.9),
                  schedule="1f1b-flush", microbatches=MICRO, segment=SEGMENT, progress=False,
                  timeout_s=120, replan="auto",
                  replan_threshold=0.05 if run == "replan" else 1e9)
    history = t.fit(data(), epochs=1)
    if int(os.environ["RANK"]) == 0:
        recs = [{"adopted": r.adopted, "gain": r.proposal.gain, "factors": r.proposal.factors,
                 "from": list(r.proposal.current.replicas),
                 "to": list(r.proposal.proposed.replicas),
                 "to_stages": [len(s.nodes) for s in r.proposal.proposed.stages],
                 "from_stages": [len(s.nodes) for s in r.proposal.current.stages],
                 "predicted_before_s": r.proposal.current.time_per_minibatch,
                 "predicted_after_s": r.proposal.proposed.time_per_minibatch}
                for r in t.replanner.records]
        (work / f"{run}.json").write_text(json.dumps({
            "segments": t.replanner.segment_times, "records": recs,
            "loss": history[-1]["loss"]}))
    t.close()
    return 0


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(work: Path, run: str, procs: int) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={procs}",
           "--master-addr=127.0.0.1", f"--master-port={_port()}", __file__, "--worker", run,
           "--work", str(work)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if res.returncode:
        raise SystemExit(f"{run} failed:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}")
    return json.loads((work / f"{run}.json").read_text())


def throughput(segments: list[list[float]], plan: int) -> float:
    """Samples per second over the segments of plan generation ``plan``, its first one left
    out (warm-up)."""
    times = [s for g, s in segments if g == plan][1:]
    return B / statistics.mean(times)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--procs", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--work", default=None)
    p.add_argument("--out", default=None, help="write the markdown here, not BENCHMARKS.md")
    a = p.parse_args(argv)
    if a.worker:
        return worker(Path(a.work), a.worker)
    work = Path(a.work or tempfile.mkdtemp(prefix="fxp-replan-"))
    work.mkdir(parents=True, exist_ok=True)
    info = plans(a.procs, work)
    rows, t0 = [], time.monotonic()
    for k in range(a.repeats):
        got = {run: launch(work, run, a.procs) for run in ("right", "wrong", "replan")}
        rec = got["replan"]["records"][0]
        rows.append({"right": throughput(got["right"]["segments"], 0),
                     "wrong": throughput(got["wrong"]["segments"], 0),
                     "before": B / got["replan"]["segments"][0][1],
                     "after": (throughput(got["replan"]["segments"], 1)
                               if rec["adopted"] else None),
                     "rec": rec, "loss": {r: got[r]["loss"] for r in got}})
        print(json.dumps(rows[-1]), flush=True)
    from _report import publish

    wall = time.monotonic() - t0
    lines = ["## Re-planning in place from a wrong profile (issue 13)", "",
             f"Command: `.venv/bin/python bench/replan.py --procs {a.procs} --repeats "
             f"{a.repeats}` ({a.procs} local gloo ranks, 1 thread each, this machine shared with "
             f"other jobs: `uptime` load ~10 on 2 cores; {wall:.0f} s). MLP {L}x Linear({D},{D}) "
             f"+ head, batch {B}, 1f1b-flush, {MICRO} microbatches per update, segments of "
             f"{SEGMENT} minibatches, {MINIBATCHES} minibatches.", "",
             f"Right plan (profile measured here): node starts {info['starts']['right']}; wrong "
             f"plan (the right plan's stage 0 costs x4): node starts "
             f"{info['starts']['wrong']}. `replan` starts from the wrong plan and re-plans after "
             "its first segment from its ranks' timelines. Throughput in samples/s over each "
             "plan's segments but its first (warm-up); `before` is the replan run's one segment "
             "under the wrong plan (warm-up included).", "",
             "| repeat | right | wrong (kept) | replan: after | after / right | wrong / right "
             "| re-plan: stages (nodes) | predicted gain | measured gain (after / wrong) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for k, r in enumerate(rows):
        rec, after, right, wrong = r["rec"], r["after"], r["right"], r["wrong"]
        lines.append(
            f"| {k} | {r['right']:.0f} | {r['wrong']:.0f} | "
            f"{'-' if after is None else f'{after:.0f}'} | "
            f"{'-' if after is None else f'{after / right:.2f}'} | "
            f"{r['wrong'] / r['right']:.2f} | {rec['from_stages']} -> "
            f"{rec['to_stages'] if rec['adopted'] else 'kept'} | {rec['gain']:+.1%} | "
            f"{'-' if after is None else f'{after / wrong - 1:+.1%}'} |")
    ok = [r["after"] / r["right"] for r in rows if r["after"] is not None]
    if ok:
        lines += ["", f"after / right over {len(ok)} repeat(s): mean {statistics.mean(ok):.2f}, "
                  f"min {min(ok):.2f}, max {max(ok):.2f}."]
    for run in ("right", "wrong"):  # the noise floor: one plan, run after run
        xs = [r[run] for r in rows]
        lines.append(f"`{run}` alone across repeats: {min(xs):.0f}-{max(xs):.0f} samples/s "
                     f"(max/min {max(xs) / min(xs):.2f}).")
    lines += ["", "The gains are only claims where they exceed that spread."]
    publish("replan", "\n".join(lines), a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
