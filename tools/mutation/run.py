"""Mutation testing: does the test suite notice small wrong changes to the code it covers?

Run from the repository root (takes tens of minutes on 2 cores; one module at a time is fine):

    nice -n 10 .venv/bin/python -m tools.mutation                      # every module below
    nice -n 10 .venv/bin/python -m tools.mutation runtime/replica/stash.py     # some of them
    nice -n 10 .venv/bin/python -m tools.mutation --reuse passes/plan.py  # after new tests
    nice -n 10 .venv/bin/python -m tools.mutation --survivors runtime/schedules/schedule.py  # only
    them .venv/bin/python -m tools.mutation --report                        # publish saved results
    .venv/bin/python -m tools.mutation --pending                       # what --reuse would run

``--reuse`` reruns only what a saved run did not kill (its survivors and the mutants of changed
lines); a mutant identical to one killed before (the same edit of the same line, between the
same two neighbouring lines) counts as killed, marked "killed (earlier run)", and the report says
how many were carried over that way. Code that moved to another module (``MOVED_FROM``) takes
its kills along: a mutant killed in the module it came from counts as killed where it is now.
Results are saved after every mutant, so a run stopped part way (the rest saved as "untested")
is continued by ``--reuse``; ``--pending`` counts what a ``--reuse`` run would run, running
nothing.

Each mutant is one of mutmut's edits (pinned in the ``dev`` extra: ``mutmut==2.5.1``; only its
mutation generator is used): an operator swapped (``<`` for ``<=``, ``-`` for ``+``), a number
off by one, a keyword flipped, a string or assignment replaced. For each one the driver writes the
mutated module into a private copy of the repository (the working tree is never touched, so tests
can run there meanwhile), runs that module's test selection (``SUITES``) against it in a fresh
process forked from a warm parent (torch and pytest already imported; ``fxpipe`` imported fresh
from the copy, no bytecode cache), stops at the first failure, and records

- ``killed``: a test failed (or the run exceeded its timeout: the mutant made something loop);
- ``survived``: every selected test passed: either a missing test or an equivalent mutant.

Lines inside ``log.*(...)`` calls are not mutated (a log message's text is not behaviour any test
could or should pin down). Results go to ``tools/mutation/results/<module>.json`` (in the
repository: commit them with the report, so it can be regenerated); ``--report`` turns them
into benchmarks/mutation-testing.md, listing every survivor. Why the argued
survivors are equivalent is data, ``tools/mutation/equivalent.json`` (keyed by module and line
text; loaded by ``equivalent.py``), so a rerun after a code change shows which arguments no
longer apply.

To cover a new module: add it to ``SUITES`` with the test files that exercise it, fastest and
most specific first (``-x`` stops at the first failure, so order is speed).
"""
from __future__ import annotations

import argparse
import ast
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[2]
# in the repository, not out/: saved runs outlive the machine (a lost out/ once cost hours of
# reruns), and the published report is regenerated from them
OUT = ROOT / "tools" / "mutation" / "results"
PHASES = ("tracing", "costmodel", "passes", "codegen", "runtime")

_T = "tests/passes/"
_LITERAL, _BRUTE = _T + "test_cost_model_literal.py", _T + "test_solver_bruteforce.py"
_RC = _T + "test_recompute.py"  # the recompute model and search (brute force, seeded caps)
_WITNESS = _T + "test_feasibility_witness.py"  # exact bounds and witnesses of the checks (fast)
_SC, _PR, _RE, _EX, _TR = (f"tests/runtime/{p}/" for p in (
    "schedules", "pricing", "replica", "execution", "training"))
_RUNTIME = [_EX + "test_runtime_stale_oracles.py",
            _EX + "test_runtime_reference.py",
            _RE + "test_runtime_tied.py",
            _EX + "test_runtime_staleness.py"]
_ZB = _SC + "test_runtime_zerobubble.py"
_OVERLAP = _EX + "test_runtime_overlap.py"
# The tests that spawn process groups (tens of seconds of start-up each) are left out of the
# runtime selections: the same cases run in-process against the reference executor there.
def _deselect(path: str, *tests: str) -> list[str]:
    return [x for t in tests for x in ("--deselect", f"{path}::{t}")]


_NO_PROCESSES = ["--deselect", _ZB + "::test_distributed_equals_reference_and_minibatch_sgd",
                 "--deselect", _EX + "test_runtime_schedules.py::test_distributed_equals_reference"]
_PLACED = [_SC + "test_placement.py", _SC + "test_placed_checks.py", _SC + "test_hosted_plan.py",
           _SC + "test_placed_timing.py", _SC + "test_placed_greedy.py", _PR + "test_placed_sim.py",
           _TR + "test_runtime_trainer_placed.py", _EX + "test_runtime_placed.py",
           *_deselect(_EX + "test_runtime_placed.py",
                      "test_distributed_equals_reference_and_minibatch_sgd",
                      "test_run_distributed_runs_a_placed_schedule_and_a_dead_process_is_named")]
# module -> the tests that exercise it, cheapest and most specific first (-x: order is speed)
SUITES: dict[str, list[str]] = {
    "passes/cuts.py": [_T + "test_cuts.py", _LITERAL,
                       _BRUTE + "::test_partition_matches_brute_force"],
    "passes/exact_stages.py": [_WITNESS, _LITERAL, _T + "test_feasibility.py", _BRUTE, _RC],
    "passes/feasibility.py": [_WITNESS, _LITERAL, _BRUTE, _T + "test_feasibility.py", _RC],
    "passes/recompute.py": [_WITNESS, _RC, _T + "test_feasibility.py"],
    "passes/solver.py": [_LITERAL, _T + "test_solver.py", _BRUTE, _T + "test_feasibility.py",
                         _RC],
    "passes/partition.py": [_LITERAL, _T + "test_partition.py", _T + "test_partition_update.py",
                            _T + "test_plan.py", _T + "test_cuts.py",
                            _T + "test_solver_vs_pipedream_dp.py",
                            _BRUTE + "::test_partition_matches_brute_force", _RC],
    "passes/plan.py": [_T + "test_plan.py", _T + "test_partition.py",
                       _T + "test_partition_update.py", _RC],
    "passes/reference_dp.py": [_T + "test_solver_vs_pipedream_dp.py", _LITERAL,
                               _T + "test_partition_update.py"],
    # test_runtime_schedules.py is all process groups (its module fixture spawns every case)
    "runtime/schedules/schedule.py": [_SC + "test_schedule.py", _ZB, *_RUNTIME, *_NO_PROCESSES],
    "runtime/schedules/kinds.py": [_SC + "test_schedule.py", _ZB, *_RUNTIME, *_NO_PROCESSES],
    "runtime/schedules/zerobubble.py": [_ZB, _SC + "test_schedule.py",
                              _EX + "test_runtime_reference.py", *_NO_PROCESSES],
    "runtime/replica/stash.py": [_RE + "test_runtime_stash.py", *_RUNTIME,
                         _RE + "test_runtime_master_weights.py"],
    # placement as data (interleaved-1f1b, zb-v): the literal tables, the simulator, the NCCL
    # order checker and the reference executor; the spawned worlds of test_runtime_placed.py
    # are left out
    "runtime/schedules/placement.py": _PLACED,
    "runtime/schedules/placed_orders.py": _PLACED,
    # the in-process tests of the layout, hooks, rounds and means; the end-to-end cases spawn a
    # world of processes (a minute each on 2 cores) and are left out
    "runtime/execution/buckets.py": [_OVERLAP, _ZB + "::test_buckets_launch_after_the_last_w_of_a_round",
                           *_deselect(_OVERLAP, "test_distributed_equals_reference",
                                      "test_overlapped_and_flat_give_the_same",
                                      "test_first_bucket_is_launched_before",
                                      "test_flat_path_has_no_bucket_waits",
                                      "test_hung_replica_fails_the_bucket_wait")],
}

# module -> the modules its code came from: a mutant a saved run of one of those killed (the same
# edit of the same line between the same neighbours) counts as killed here too, so ``--reuse``
# does not rerun what moved with its code; their text-keyed arguments (equivalent.json) apply too
MOVED_FROM: dict[str, tuple[str, ...]] = {
    # make_schedule and the per-kind generators, out of schedule.py
    "runtime/schedules/kinds.py": ("runtime/schedules/schedule.py",),
}


@dataclass
class Mutant:
    line_number: int   # 1-based
    line: str          # the original line, stripped
    index: int         # mutmut's index among the mutations of that line
    diff: str          # "- old\n+ new" for the report
    status: str = "untested"
    seconds: float = 0.0


# --------------------------------------------------------------------------- generating
def _log_lines(source: str) -> set[int]:
    """1-based line numbers of every ``log.x(...)`` / ``logger.x(...)`` call."""
    out: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id in ("log", "logger", "logging")):
            out.update(range(node.lineno, (node.end_lineno or node.lineno) + 1))
    return out


def mutants(path: Path) -> list[tuple[Mutant, str]]:
    """Every mutant of ``path`` (mutmut's generator) with its mutated source."""
    from mutmut import ALL, Context, RelativeMutationID, list_mutations, mutate

    source = path.read_text()
    skip = _log_lines(source)
    ids = list_mutations(Context(source=source, filename=str(path), mutation_id=ALL))
    out = []
    for mid in ids:
        if mid.line_number + 1 in skip:
            continue
        rel = RelativeMutationID(line=mid.line, index=mid.index, line_number=mid.line_number)
        new, n = mutate(Context(source=source, filename=str(path), mutation_id=rel))
        if n != 1:
            continue
        old_line = source.split("\n")[mid.line_number]
        new_line = new.split("\n")[mid.line_number] if new.count("\n") == source.count("\n") \
            else "(several lines)"
        out.append((Mutant(mid.line_number + 1, old_line.strip(), mid.index,
                           f"- {old_line.strip()}\n+ {new_line.strip()}"), new))
    return out


# --------------------------------------------------------------------------- running
def make_copy() -> tuple[Path, Path]:
    """A private copy of the repository (tracked and untracked, not ignored, files) and a
    ``site`` folder laid out like the installed package: site/fxpipe/<phase> -> copy/<phase>."""
    tmp = Path(tempfile.mkdtemp(prefix="fxpipe-mutation-"))
    repo, site = tmp / "repo", tmp / "site"
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT,
                           check=True, capture_output=True).stdout.decode().split("\0")
    for f in filter(None, files):
        src = ROOT / f
        if src.is_file():
            (repo / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, repo / f)
    (site / "fxpipe").mkdir(parents=True)
    for entry in (repo / "fxpipe").iterdir():
        (site / "fxpipe" / entry.name).symlink_to(entry)
    for phase in PHASES:
        (site / "fxpipe" / phase).symlink_to(repo / phase)
    return repo, site


def _child(repo: Path, site: Path, tests: list[str], log: Path) -> None:
    """In the forked child: run the selection on the copy, exit with pytest's code."""
    os.setsid()
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.chdir(repo)
    sys.path.insert(0, str(site))
    os.environ["PYTHONPATH"] = os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])
    os.environ["PYTHONDONTWRITEBYTECODE"] = "1"  # a mutant of the same size and second must
    sys.dont_write_bytecode = True                # never be served from a stale .pyc
    import hypothesis
    import pytest
    hypothesis.settings.register_profile("mutation", database=None, derandomize=True,
                                         deadline=None)
    hypothesis.settings.load_profile("mutation")
    rc = pytest.main(["-x", "-q", "-p", "no:cacheprovider", "--no-header", *tests])
    os._exit(int(rc))


def run_tests(repo: Path, site: Path, tests: list[str], timeout: float, log: Path
              ) -> tuple[int | None, float]:
    """(pytest's exit code or None on timeout, seconds)."""
    t0 = time.monotonic()
    pid = os.fork()
    if pid == 0:
        try:
            _child(repo, site, tests, log)
        finally:
            os._exit(99)
    deadline = t0 + timeout
    try:
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                pid = 0
                return os.waitstatus_to_exitcode(status), time.monotonic() - t0
            if time.monotonic() > deadline:
                return None, time.monotonic() - t0
            time.sleep(0.05)
    finally:
        if pid:  # timed out, or this driver is being stopped: the child's whole group goes
            try:
                os.killpg(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass


Key = tuple[str, str, str, str, int]


def _keys(source: str, ms: list[dict]) -> list[Key]:
    """Each mutant's identity across edits elsewhere in the file: (line before, its line, line
    after, the edit, which occurrence of that 3-line context it is). A mutant of an unchanged
    line in a changed neighbourhood (or of one of several identical lines) is not the same."""
    lines = [x.strip() for x in source.split("\n")]
    seen: dict[tuple[str, str, str], list[int]] = {}
    out = []
    for m in ms:
        i = m["line_number"] - 1
        ctx = (lines[i - 1] if i else "", lines[i], lines[i + 1] if i + 1 < len(lines) else "")
        nums = seen.setdefault(ctx, [])
        if m["line_number"] not in nums:
            nums.append(m["line_number"])
        out.append((*ctx, m["diff"], nums.index(m["line_number"])))
    return out


def _saved_source(module: str, d: dict) -> str | None:
    """The source a saved run mutated: stored with it, or (runs saved before the source was)
    the last commit's version if every saved mutant's line is where that version has it."""
    if "source" in d:
        return d["source"]
    try:
        src = subprocess.run(["git", "show", f"HEAD:{module}"], cwd=ROOT, check=True,
                             capture_output=True, text=True).stdout
    except subprocess.CalledProcessError:
        return None
    lines = src.split("\n")
    ok = all(m["line_number"] <= len(lines) and lines[m["line_number"] - 1].strip() == m["line"]
             for m in d["mutants"])
    return src if ok else None


def _saved(module: str) -> tuple[dict, list[tuple[Key, dict]]] | None:
    """A saved run of ``module`` and its mutants keyed by ``_keys`` (None: no saved run, or
    its source is unknown)."""
    path = OUT / (module.replace("/", "_") + ".json")
    if not path.exists():
        return None
    d = json.loads(path.read_text())
    source = _saved_source(module, d)
    if source is None:
        print(f"{module}: the saved run's source is unknown; nothing is reused", flush=True)
        return None
    return d, list(zip(_keys(source, d["mutants"]), d["mutants"]))


def _origins(module: str) -> tuple[str, ...]:
    """``module`` and the modules its code moved from (``MOVED_FROM``)."""
    return (module, *MOVED_FROM.get(module, ()))


def _previous_survivors(module: str) -> set[Key]:
    """The keys (``_keys``) of every mutant a saved run of ``module`` (or of a module its code
    moved from) let survive."""
    out: set[Key] = set()
    for origin in _origins(module):
        saved = _saved(origin)
        if saved is not None:
            out |= {k for k, m in saved[1] if m["status"] == "survived"}
    return out


def _previously_killed(module: str) -> set[Key]:
    """The keys (``_keys``) of every mutant a saved run of ``module`` (or of a module its code
    moved from, ``MOVED_FROM``) killed."""
    out: set[Key] = set()
    for origin in _origins(module):
        out |= _killed_in(origin)
    return out


def _killed_in(module: str) -> set[Key]:
    """The keys (``_keys``) of every mutant a saved run of ``module`` itself killed."""
    saved = _saved(module)
    if saved is None:
        return set()
    d, keyed = saved
    # Runs saved before the source was carried kills over by line text and edit alone, which
    # confuses identical lines: such a carried kill of a repeated line is not trusted (rerun).
    twice = {x for x, c in Counter((m["line"], m["diff"]) for m in d["mutants"]).items()
             if c > 1} if "source" not in d else set()
    return {k for k, m in keyed
            if m["status"].startswith("killed") and not (m["status"] == "killed (earlier run)"
                                                         and (m["line"], m["diff"]) in twice)}


def test_module(module: str, repo: Path, site: Path, reuse: bool = False,
                save: Callable[[dict], None] = lambda _: None,
                survivors_only: bool = False) -> dict:
    """Run every mutant of ``module``; ``save`` gets the results after each one (the mutants
    not run yet as ``untested``), so a run stopped part way keeps what it measured and a
    ``--reuse`` run picks up from there."""
    tests = SUITES[module]
    known = _previously_killed(module) if reuse or survivors_only else set()
    # --survivors: rerun only what the saved run let survive (after new tests); the rest of
    # what it did not run stays untested
    again = _previous_survivors(module) if survivors_only else None
    target = repo / module
    original = target.read_text()
    log = repo.parent / "pytest.log"
    rc, base = run_tests(repo, site, tests, 3600, log)
    if rc != 0:
        raise SystemExit(f"{module}: the unmutated selection fails (rc {rc}); see {log}")
    timeout = max(30.0, 3 * base)
    found = mutants(target)
    keys = _keys(original, [asdict(m) for m, _ in found])
    print(f"{module}: {len(found)} mutants, baseline {base:.1f} s, timeout {timeout:.0f} s",
          flush=True)
    results: list[Mutant] = []

    def result() -> dict:
        return {"module": module, "tests": tests, "baseline_s": base, "timeout_s": timeout,
                "mutants": [asdict(m) for m in results]
                + [{**asdict(m), "status": "killed (earlier run)" if k in known else "untested"}
                   for (m, _), k in zip(found[len(results):], keys[len(results):])],
                "source": original}

    try:
        for i, ((m, source), key) in enumerate(zip(found, keys)):
            if key in known:  # the same edit of the same line in the same context, killed before
                m.status = "killed (earlier run)"
                results.append(m)
                continue
            if again is not None and key not in again:
                results.append(m)  # untested: not a survivor of the saved run
                continue
            if again is not None and _why(module, asdict(m)):
                m.status = "survived"  # argued equivalent: no test can kill it, not rerun
                results.append(m)
                continue
            target.write_text(source)
            rc, m.seconds = run_tests(repo, site, tests, timeout, log)
            m.status = "survived" if rc == 0 else "killed"
            if rc not in (0, 1):  # 1 = a test failed; else timeout, crash, collection error
                m.status += " (timeout)" if rc is None else f" (exit {rc})"
            results.append(m)
            print(f"  [{i + 1}/{len(found)}] {m.status:<16} line {m.line_number}: "
                  f"{m.diff.splitlines()[-1]}", flush=True)
            save(result())
    finally:
        target.write_text(original)
    return result()


def pending(module: str, survivors_only: bool = False) -> tuple[int, int, int]:
    """(mutants of ``module`` now, of which killed before (carried over), to run): what
    ``test_module(module, reuse=True)`` (or ``survivors_only``) would do, running nothing."""
    found = mutants(ROOT / module)
    keys = _keys((ROOT / module).read_text(), [asdict(m) for m, _ in found])
    known = _previously_killed(module)
    if survivors_only:
        again = _previous_survivors(module)
        run = sum(k not in known and k in again and not _why(module, asdict(m))
                  for (m, _), k in zip(found, keys))
    else:
        run = sum(k not in known for k in keys)
    return len(found), sum(k in known for k in keys), run


# --------------------------------------------------------------------------- reporting
from .equivalent import EQUIVALENT, EQUIVALENT_AT, KILLED_SINCE  # noqa: E402  (the argued survivors)


def report() -> str:
    rows, lines, partial = [], [], []
    for path in sorted(OUT.glob("*.json")):
        d = json.loads(path.read_text())
        ms = [m for m in d["mutants"] if m["status"] != "untested"]
        if len(ms) < len(d["mutants"]):
            partial.append(f"`{d['module']}` ({len(ms)} of {len(d['mutants'])})")
        killed = sum(m["status"].startswith("killed") for m in ms)
        surv = [m for m in ms if m["status"] == "survived"]
        argued = [m for m in surv if _why(d["module"], m)]
        carried = sum(m["status"] == "killed (earlier run)" for m in ms)
        rows.append((d["module"], len(ms), killed, len(surv), len(argued), d["baseline_s"],
                     carried))
        for m in surv:
            since = next((KILLED_SINCE[k] for k in _text_keys(d["module"], m)
                          if k in KILLED_SINCE), None)
            why = _why(d["module"], m) or (f"killed since by `{since}` (mutant applied by hand; "
                                           "not rerun)" if since else
                                           "**no argument: a missing test**")
            new = m["diff"].splitlines()[-1][2:]
            lines.append(f"| {d['module']}:{m['line_number']} | `{m['line']}` | `{new}` | {why} |")
    total = sum(r[1] for r in rows)
    killed = sum(r[2] for r in rows)
    out = ["## Mutation testing", "",
           "Command: `nice -n 10 .venv/bin/python -m tools.mutation` (then `--report`), "
           "mutants from mutmut 2.5.1's generator, each module against its test selection "
           "(`tools/mutation/run.py`, `SUITES`), first failure kills. Score = killed / mutants; "
           "`score (equivalent excluded)` leaves out the survivors argued equivalent below. "
           "The runtime selections leave out the tests that spawn a world of processes (a "
           "minute each on 2 cores): `runtime/schedules/schedule.py`, `kinds.py` and `zerobubble.py` "
           "run their "
           "in-process tests (literal tables, the reference executor, the stale-weight "
           "oracles), `runtime/execution/buckets.py` the in-process layout, hook and round tests "
           "(`SUITES` lists them).", "",
           f"Report written {time.strftime('%Y-%m-%d', time.gmtime())} (UTC) from the saved runs "
           "in `tools/mutation/results/`; runs niced on a 2-core machine shared with other sessions, so "
           "`selection seconds` (the unmutated selection's wall time) is not a benchmark.", "",
           "`killed earlier` counts mutants identical (the same edit of the same line between the "
           "same neighbours) to ones a previous "
           "run killed, not rerun (`--reuse`).", "",
           "| module | mutants | killed | of which killed earlier | survived | argued equivalent "
           "| score | score (equivalent excluded) | selection seconds |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for mod, n, k, s, a, secs, c in rows:
        out.append(f"| {mod} | {n} | {k} | {c} | {s} | {a} | {100 * k / n:.1f}% | "
                   f"{100 * k / max(1, n - a):.1f}% | {secs:.0f} |")
    if total:
        eq = sum(r[4] for r in rows)
        carried = sum(r[6] for r in rows)
        out.append(f"| **all** | {total} | {killed} | {carried} | {sum(r[3] for r in rows)} | "
                   f"{eq} | "
                   f"{100 * killed / total:.1f}% | {100 * killed / max(1, total - eq):.1f}% | |")
    if partial:
        out += ["", "Stopped part way (mutants run of all; the rest are not counted above, and "
                "`--reuse` picks up from there): " + ", ".join(partial) + "."]
    missing = sorted(set(SUITES) - {r[0] for r in rows})
    if missing:
        out += ["", "Not run yet (no saved results): " + ", ".join(f"`{m}`" for m in missing)
                + "."]
    out += ["", "Every survivor, with why it cannot be killed (an equivalent mutant: no caller "
            "can observe the change):", "", "| where | original | mutant | why it survives |",
            "|---|---|---|---|", *lines]
    return "\n".join(out)


def _text_keys(module: str, m: dict) -> list[tuple[str, str, str]]:
    """The text keys (module, line, mutated line) of ``m``'s argument: its module's, then those
    of the modules its code moved from (``MOVED_FROM``)."""
    new = m["diff"].splitlines()[-1][2:]
    return [(origin, m["line"], new) for origin in _origins(module)]


def _why(module: str, m: dict) -> str | None:
    """The argument that ``m`` is equivalent: keyed by text (its module's, or one its code moved
    from), or by line number too (its module's only: a moved line has another number)."""
    new = m["diff"].splitlines()[-1][2:]
    return (next((EQUIVALENT[k] for k in _text_keys(module, m) if k in EQUIVALENT), None)
            or EQUIVALENT_AT.get((module, m["line_number"], m["line"], new)))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.mutation",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("modules", nargs="*", help=f"default: all of {sorted(SUITES)}")
    ap.add_argument("--report", action="store_true", help="publish the saved results")
    ap.add_argument("--reuse", action="store_true",
                    help="incremental: a mutant identical (same edit, same line, same neighbours) to one the "
                         "saved run killed is counted killed without running; the rest run")
    ap.add_argument("--survivors", action="store_true",
                    help="rerun only the saved run's survivors not argued equivalent (after new "
                         "tests); what it did not run stays untested")
    ap.add_argument("--pending", action="store_true",
                    help="count the mutants --reuse (with --survivors: --survivors) would run, "
                         "and the seconds that would take at most, running nothing")
    ap.add_argument("--out", help="write the report here instead of benchmarks/mutation-testing.md")
    args = ap.parse_args(argv)
    if args.report:
        from bench._report import publish
        publish("mutation-testing", report(), args.out)
        return 0
    unknown = [m for m in args.modules if m not in SUITES]
    if unknown:
        ap.error(f"no test selection for {unknown}: add them to SUITES in tools/mutation/run.py")
    if args.pending:
        for module in args.modules or sorted(SUITES):
            n, carried, run = pending(module, args.survivors)
            saved = [json.loads(p.read_text())["baseline_s"] for o in _origins(module)
                     if (p := OUT / (o.replace("/", "_") + ".json")).exists()]
            base = max(saved, default=0.0)
            bound = (f": about {run * base:.0f} s if each took the saved selection's "
                     f"{base:.0f} s, at most {run * max(30.0, 3 * base):.0f} s (timeouts)"
                     if saved else "")
            print(f"{module}: {n} mutants, {carried} killed before, {run} to run{bound}")
        return 0
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so run_tests' cleanup runs
    import hypothesis  # noqa: F401  (warm: the forked children inherit these imports)
    import numpy  # noqa: F401
    import pytest  # noqa: F401
    import torch  # noqa: F401
    repo, site = make_copy()
    OUT.mkdir(parents=True, exist_ok=True)
    try:
        for module in args.modules or sorted(SUITES):
            path = OUT / (module.replace("/", "_") + ".json")

            def save(res: dict, path: Path = path) -> None:
                tmp = path.with_suffix(".tmp")
                tmp.write_text(json.dumps(res, indent=1))
                tmp.replace(path)
            save(test_module(module, repo, site, args.reuse, save, args.survivors))
    finally:
        shutil.rmtree(repo.parent, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
