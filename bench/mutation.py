"""Mutation testing: does the test suite notice small wrong changes to the code it covers?

Run from the repository root (takes tens of minutes on 2 cores; one module at a time is fine):

    nice -n 10 .venv/bin/python -m bench.mutation                      # every module below
    nice -n 10 .venv/bin/python -m bench.mutation runtime/stash.py     # some of them
    nice -n 10 .venv/bin/python -m bench.mutation --reuse passes/plan.py  # after new tests
    .venv/bin/python -m bench.mutation --report                        # publish saved results

``--reuse`` reruns only what a saved run did not kill (its survivors and the mutants of changed
lines); a mutant identical to one killed before (same line text, same edit) counts as killed,
marked "killed (earlier run)", and the report says how many were carried over that way.

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
could or should pin down). Results go to ``out/mutation/<module>.json``; ``--report`` turns them
into the ``mutation-testing`` section of BENCHMARKS.md, listing every survivor. Why the argued
survivors are equivalent lives in ``EQUIVALENT`` below (keyed by module and line text), so a rerun
after a code change shows which arguments no longer apply.

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
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "out" / "mutation"
PHASES = ("tracing", "costmodel", "passes", "codegen", "runtime")

_T = "tests/passes/"
_LITERAL, _BRUTE = _T + "test_cost_model_literal.py", _T + "test_solver_bruteforce.py"
_RUNTIME = ["tests/runtime/test_runtime_stale_oracles.py", "tests/runtime/test_runtime_reference.py",
            "tests/runtime/test_runtime_tied.py", "tests/runtime/test_runtime_staleness.py"]
# module -> the tests that exercise it, cheapest and most specific first (-x: order is speed)
SUITES: dict[str, list[str]] = {
    "passes/cuts.py": [_T + "test_cuts.py", _LITERAL,
                       _BRUTE + "::test_partition_matches_brute_force"],
    "passes/exact_stages.py": [_LITERAL, _T + "test_feasibility.py", _BRUTE],
    "passes/feasibility.py": [_LITERAL, _BRUTE, _T + "test_feasibility.py"],
    "passes/solver.py": [_LITERAL, _T + "test_solver.py", _BRUTE, _T + "test_feasibility.py"],
    "passes/partition.py": [_LITERAL, _T + "test_partition.py", _T + "test_partition_update.py",
                            _T + "test_plan.py", _T + "test_cuts.py",
                            _T + "test_solver_vs_pipedream_dp.py",
                            _BRUTE + "::test_partition_matches_brute_force"],
    "passes/plan.py": [_T + "test_plan.py", _T + "test_partition.py",
                       _T + "test_partition_update.py"],
    "passes/reference_dp.py": [_T + "test_solver_vs_pipedream_dp.py", _LITERAL,
                               _T + "test_partition_update.py"],
    "runtime/schedule.py": ["tests/runtime/test_schedule.py", *_RUNTIME],
    "runtime/stash.py": ["tests/runtime/test_runtime_stash.py", *_RUNTIME],
    "runtime/buckets.py": ["tests/runtime/test_runtime_overlap.py"],
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


def _previously_killed(module: str) -> set[tuple[str, str]]:
    """(original line, mutated line) of every mutant a saved run of ``module`` killed."""
    path = OUT / (module.replace("/", "_") + ".json")
    if not path.exists():
        return set()
    return {(m["line"], m["diff"]) for m in json.loads(path.read_text())["mutants"]
            if m["status"].startswith("killed")}


def test_module(module: str, repo: Path, site: Path, reuse: bool = False) -> dict:
    tests = SUITES[module]
    known = _previously_killed(module) if reuse else set()
    target = repo / module
    original = target.read_text()
    log = repo.parent / "pytest.log"
    rc, base = run_tests(repo, site, tests, 3600, log)
    if rc != 0:
        raise SystemExit(f"{module}: the unmutated selection fails (rc {rc}); see {log}")
    timeout = max(30.0, 3 * base)
    found = mutants(target)
    print(f"{module}: {len(found)} mutants, baseline {base:.1f} s, timeout {timeout:.0f} s",
          flush=True)
    results = []
    try:
        for i, (m, source) in enumerate(found):
            if (m.line, m.diff) in known:  # same edit of the same line text, killed before
                m.status = "killed (earlier run)"
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
    finally:
        target.write_text(original)
    return {"module": module, "tests": tests, "baseline_s": base, "timeout_s": timeout,
            "mutants": [asdict(m) for m in results]}


# --------------------------------------------------------------------------- reporting
# (module, stripped original line, mutated line) -> why the mutant is equivalent: it changes no
# result any caller can observe. Filled in from the survivors of a run, each argued in one line.
_UNREAD = "the extra element is never read"
_ANNOTATION = "an annotation: a string under `from __future__ import annotations`, never evaluated"
_PATH = ("search path only: which exact checks the bisection makes, not where it ends (the same "
         "plan); only the reported `checks` may differ")
EQUIVALENT: dict[tuple[str, str, str], str] = {
    ("passes/cuts.py", "if j > last[i]:", "if j >= last[i]:"):
        "when j == last[i] it stores the same j again",
    ("passes/cuts.py", "if n <= 1:", "if n < 1:"):
        "for n = 1 the general path also returns an empty float array",
    ("passes/cuts.py", "diff = np.zeros(n + 1)", "diff = np.zeros(n + 2)"):
        _UNREAD + " (the prefix sum is sliced [1:n])",
    ("passes/cuts.py", "bad = np.zeros(n + 1, dtype=np.int64)",
     "bad = np.zeros(n + 2, dtype=np.int64)"): _UNREAD + " (the prefix sum is sliced [1:n])",
    ("passes/reference_dp.py", "best = [[math.inf] * (workers + 1) for _ in range(n + 1)]",
     "best = [[math.inf] * (workers + 2) for _ in range(n + 1)]"): _UNREAD,
    ("passes/reference_dp.py", "best = [[math.inf] * (workers + 1) for _ in range(n + 1)]",
     "best = [[math.inf] * (workers + 1) for _ in range(n + 2)]"): _UNREAD,
    ("passes/reference_dp.py", "best[0] = [0.0] * (workers + 1)",
     "best[0] = [0.0] * (workers + 2)"): _UNREAD,
    ("passes/reference_dp.py", "comp, par = [0.0] * j, [0.0] * j",
     "comp, par = [1.0] * j, [0.0] * j"): "every entry is overwritten by the loop below before "
                                           "it is read",
    ("passes/reference_dp.py", "comp, par = [0.0] * j, [0.0] * j",
     "comp, par = [0.0] * j, [1.0] * j"): "every entry is overwritten by the loop below before "
                                           "it is read",
    ("passes/reference_dp.py", "if i > 0 and m - r < 1:", "if i > 1 and m - r < 1:"):
        "the break only skips candidates built on best[i][0] = inf (i > 0), which never win",
    ("passes/reference_dp.py", "if i > 0 and m - r < 1:", "if i > 0 and m + r < 1:"):
        "the break only skips candidates built on best[i][0] = inf (i > 0), which never win",
    ("passes/reference_dp.py", "break  # the stages before i need at least one worker",
     "continue  # the stages before i need at least one worker"):
        "the loop goes on through candidates built on best[i][0] = inf, which never win",
    ("passes/partition.py", "crossing = all_crossing_values(profile, [a for a in sol.starts if a > 0])",
     "crossing = all_crossing_values(profile, [a for a in sol.starts if a >= 0])"):
        "`crossing` only feeds a debug log line",
    ("passes/partition.py", "if a > 0:", "if a > 1:"): "only decides whether a debug line is logged",
    ("passes/partition.py",
     'f"no plan fits in {format_bytes(cluster.memory or 0)} per worker: the smallest-memory "',
     'f"no plan fits in {format_bytes(cluster.memory or 1)} per worker: the smallest-memory "'):
        "raised only under a memory cap, and Cluster refuses a cap <= 0: the `or` never applies",
    ("runtime/stash.py", "OptimizerFactory = Callable[[list[torch.Tensor]], torch.optim.Optimizer]",
     "OptimizerFactory = None"): "a type alias used only in annotations (strings under "
                                 "`from __future__ import annotations`)",
    ("runtime/stash.py", "_Slots = list[tuple[str, list[tuple[dict, str]]]]", "_Slots = None"):
        "a type alias used only in annotations (strings under `from __future__ import annotations`)",
    ("runtime/stash.py", "self.optimizer: torch.optim.Optimizer | None = (",
     "self.optimizer: torch.optim.Optimizer & None = ("): _ANNOTATION,
    ("runtime/stash.py", "if self._reads[v] > 0:", "if self._reads[v] >= 0:"):
        "a count driven below 0 is only ever compared `> 0`, like 0",
    ("runtime/stash.py", "copied = False", "copied = True"):
        "an in-place update adds no storage, so the peak it would re-take is already counted "
        "(the peak starts at bytes_held())",
    ("runtime/stash.py", "copied = False", "copied = None"): "None is falsy like False",
    ("runtime/stash.py", "reused = 0", "reused = 1"): "`reused` only feeds a debug log line",
    ("runtime/stash.py", "reused += 1", "reused = 1"): "`reused` only feeds a debug log line",
    ("runtime/stash.py", "reused += 1", "reused -= 1"): "`reused` only feeds a debug log line",
    ("runtime/stash.py", "reused += 1", "reused += 2"): "`reused` only feeds a debug log line",
    ("runtime/stash.py", "for mname, mod in gm.named_modules(remove_duplicate=False):",
     "for mname, mod in gm.named_modules(remove_duplicate=True):"):
        "a module reached under two names is one object with one dict: swapping (and restoring) "
        "its slot once or twice gives the same call",
    ("passes/solver.py", "_PROBE_LO_GAP = 1e-9", "_PROBE_LO_GAP = 2e-09"): _PATH,
    ("passes/solver.py",
     "lower = min(r * inst.alpha[r] for r in inst.rs) * inst.Cl[-1] / workers",
     "lower = min(r / inst.alpha[r] for r in inst.rs) * inst.Cl[-1] / workers"):
        "alpha_r = 1/r (the only coefficients partition() makes): r alpha_r = 1 = min r/alpha_r "
        "(at r = 1)",
    ("passes/solver.py", "lo, hi = max(0.0, lower * (1 - 1e-9)), best.bottleneck",
     "lo, hi = max(0.0, lower * (1 - 2e-09)), best.bottleneck"): _PATH,
    ("passes/solver.py", "if hi - lo <= _PROBE_LO_GAP * hi:",
     "if hi + lo <= _PROBE_LO_GAP * hi:"): _PATH,
    ("passes/solver.py", "if hi - lo <= _PROBE_LO_GAP * hi:",
     "if hi - lo < _PROBE_LO_GAP * hi:"): _PATH,
    ("passes/solver.py", "if hi - lo <= _PROBE_LO_GAP * hi:",
     "if hi - lo <= _PROBE_LO_GAP / hi:"): _PATH,
    ("passes/solver.py", "elif lo > 0 and hi > 2 * lo:", "elif lo >= 0 and hi > 2 * lo:"): _PATH,
    ("passes/solver.py", "elif lo > 0 and hi > 2 * lo:", "elif lo > 0 and hi > 3 * lo:"): _PATH,
    ("passes/solver.py", "elif lo > 0 and hi > 2 * lo:", "elif lo > 0 or hi > 2 * lo:"): _PATH,
    ("passes/solver.py", "tau = lo + (hi - lo) / 2", "tau = lo + (hi - lo) / 3"): _PATH,
    ("passes/solver.py",
     'assert sol.bottleneck <= tau, "feasibility check returned a plan over its bound"',
     'assert sol.bottleneck <= tau, "XXfeasibility check returned a plan over its boundXX"'):
        "the text of an internal invariant no correct check violates: never shown",
    ("passes/solver.py",
     "fewer = fewest_stages(inst, hi * (1.0 + tie_tolerance) if tie_tolerance > 0 else hi)",
     "fewer = fewest_stages(inst, hi * (1.0 + tie_tolerance) if tie_tolerance >= 0 else hi)"):
        "at tie_tolerance = 0, hi (1 + 0) is hi",
    ("passes/solver.py", "if fewer is not None and len(fewer) < len(best.starts):",
     "if fewer is not None or len(fewer) < len(best.starts):"):
        "fewest_stages at hi always finds a plan (the best one is within hi), so `fewer` is "
        "never None",
    ("passes/solver.py", "if mid <= lo or mid >= hi:", "if mid < lo or mid >= hi:"):
        "mid == lo only between adjacent floats, where ok(lo) is already known false: the extra "
        "step changes nothing and the 200-step cap ends the loop",
    ("passes/solver.py", "if mid <= lo or mid >= hi:", "if mid <= lo or mid > hi:"):
        "mid == hi only between adjacent floats, where ok(hi) is already known true: the extra "
        "step changes nothing and the 200-step cap ends the loop",
    ("passes/solver.py", "if mid <= lo or mid >= hi:", "if mid <= lo and mid >= hi:"):
        "never breaks early: once lo and hi are adjacent floats every step changes nothing, and "
        "the 200-step cap ends the loop",
    ("passes/solver.py", "break", "continue"):
        "never breaks early: once lo and hi are adjacent floats every step changes nothing, and "
        "the 200-step cap ends the loop",
    ("passes/plan.py", "batch_size: int | None = None", "batch_size: int & None = None"): _ANNOTATION,
    ("passes/plan.py", "model_fingerprint: str | None = None",
     "model_fingerprint: str & None = None"): _ANNOTATION,
}


# Survivors of the last saved run that a test added afterwards kills, checked by applying the
# mutant by hand (not yet rerun through this driver): (module, line, mutated line) -> the test.
# The table's numbers stay those of the saved run; rerun with --reuse to fold these in.
_STASH_T, _SOLVER_T = ("tests/runtime/test_runtime_stash.py::",
                       "tests/passes/test_solver.py::test_the_search_starts_at_the_work_bound")
KILLED_SINCE: dict[tuple[str, str, str], str] = {
    ("runtime/stash.py",
     "n: (p.detach().to(device, copy=True) if device is not None else p.detach().clone()",
     "n: (p.detach().to(device, copy=False) if device is not None else p.detach().clone()"):
        _STASH_T + "test_the_stash_owns_copies_of_the_weights_it_was_given",
    ("runtime/stash.py",
     "n: (p.detach().to(device, copy=True) if device is not None else p.detach().clone()",
     "n: (p.detach().to(device, copy=True) if device is  None else p.detach().clone()"):
        _STASH_T + "test_the_stash_puts_the_weights_on_the_device_asked_for",
    ("runtime/stash.py", '"each minibatch has one forward per stage replica")',
     '"XXeach minibatch has one forward per stage replicaXX")'):
        _STASH_T + "test_each_misuse_is_refused_with_what_to_do",
    ("runtime/stash.py", '"finish every backward before starting a new schedule")',
     '"XXfinish every backward before starting a new scheduleXX")'):
        _STASH_T + "test_each_misuse_is_refused_with_what_to_do",
    ("runtime/stash.py", "continue", "break"):
        _STASH_T + "test_slots_list_every_place_a_tensor_lives",
    ("passes/solver.py",
     "lower = min(r * inst.alpha[r] for r in inst.rs) * inst.Cl[-1] / workers",
     "lower = min(r * inst.alpha[r] for r in inst.rs) * inst.Cl[+1] / workers"): _SOLVER_T,
    ("passes/solver.py",
     "lower = min(r * inst.alpha[r] for r in inst.rs) * inst.Cl[-1] / workers",
     "lower = min(r * inst.alpha[r] for r in inst.rs) * inst.Cl[-2] / workers"): _SOLVER_T,
    ("passes/solver.py", "lo, hi = max(0.0, lower * (1 - 1e-9)), best.bottleneck",
     "lo, hi = max(0.0, lower / (1 - 1e-9)), best.bottleneck"): _SOLVER_T,
    ("passes/solver.py", "lo, hi = max(0.0, lower * (1 - 1e-9)), best.bottleneck",
     "lo, hi = max(0.0, lower * (1 + 1e-9)), best.bottleneck"): _SOLVER_T,
    ("passes/solver.py", "elif lo > 0 and hi > 2 * lo:", "elif lo > 1 and hi > 2 * lo:"):
        _SOLVER_T,
    ("passes/solver.py", "elif lo > 0 and hi > 2 * lo:", "elif lo > 0 and hi >= 2 * lo:"):
        _SOLVER_T,
    ("passes/solver.py", "elif lo > 0 and hi > 2 * lo:", "elif lo > 0 and hi > 2 / lo:"):
        _SOLVER_T,
}


def report() -> str:
    rows, lines = [], []
    for path in sorted(OUT.glob("*.json")):
        d = json.loads(path.read_text())
        ms = d["mutants"]
        killed = sum(m["status"].startswith("killed") for m in ms)
        surv = [m for m in ms if m["status"] == "survived"]
        argued = [m for m in surv if _why(d["module"], m)]
        carried = sum(m["status"] == "killed (earlier run)" for m in ms)
        rows.append((d["module"], len(ms), killed, len(surv), len(argued), d["baseline_s"],
                     carried))
        for m in surv:
            since = KILLED_SINCE.get((d["module"], m["line"], m["diff"].splitlines()[-1][2:]))
            why = _why(d["module"], m) or (f"killed since by `{since}` (mutant applied by hand; "
                                           "not rerun)" if since else
                                           "**no argument: a missing test**")
            new = m["diff"].splitlines()[-1][2:]
            lines.append(f"| {d['module']}:{m['line_number']} | `{m['line']}` | `{new}` | {why} |")
    total = sum(r[1] for r in rows)
    killed = sum(r[2] for r in rows)
    out = ["## Mutation testing", "",
           "Command: `nice -n 10 .venv/bin/python -m bench.mutation` (then `--report`), "
           "mutants from mutmut 2.5.1's generator, each module against its test selection "
           "(`bench/mutation.py`, `SUITES`), first failure kills. Score = killed / mutants; "
           "`score (equivalent excluded)` leaves out the survivors argued equivalent below.", "",
           "`killed earlier` counts mutants identical (line text and edit) to ones a previous "
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
        out.append(f"| **all** | {total} | {killed} | {carried} | {total - killed} | {eq} | "
                   f"{100 * killed / total:.1f}% | {100 * killed / max(1, total - eq):.1f}% | |")
    missing = sorted(set(SUITES) - {r[0] for r in rows})
    if missing:
        out += ["", "Not run yet (no saved results): " + ", ".join(f"`{m}`" for m in missing)
                + "."]
    out += ["", "Every survivor, with why it cannot be killed (an equivalent mutant: no caller "
            "can observe the change):", "", "| where | original | mutant | why it survives |",
            "|---|---|---|---|", *lines]
    return "\n".join(out)


def _why(module: str, m: dict) -> str | None:
    return EQUIVALENT.get((module, m["line"], m["diff"].splitlines()[-1][2:]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("modules", nargs="*", help=f"default: all of {sorted(SUITES)}")
    ap.add_argument("--report", action="store_true", help="publish the saved results")
    ap.add_argument("--reuse", action="store_true",
                    help="incremental: a mutant identical (same line text, same edit) to one the "
                         "saved run killed is counted killed without running; the rest run")
    ap.add_argument("--out", help="write the report here instead of BENCHMARKS.md")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    if args.report:
        from bench._report import publish
        publish("mutation-testing", report(), args.out)
        return 0
    unknown = [m for m in args.modules if m not in SUITES]
    if unknown:
        ap.error(f"no test selection for {unknown}: add them to SUITES in bench/mutation.py")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so run_tests' cleanup runs
    import hypothesis  # noqa: F401  (warm: the forked children inherit these imports)
    import numpy  # noqa: F401
    import pytest  # noqa: F401
    import torch  # noqa: F401
    repo, site = make_copy()
    OUT.mkdir(parents=True, exist_ok=True)
    try:
        for module in args.modules or sorted(SUITES):
            res = test_module(module, repo, site, args.reuse)
            (OUT / (module.replace("/", "_") + ".json")).write_text(json.dumps(res, indent=1))
    finally:
        shutil.rmtree(repo.parent, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
