"""Every command in a page is run by a test, as the README's are.

The pages are README.md and docs/*.md. For each of them this file

- runs every command of its ``bash`` blocks, from a scratch folder that sees the repository's
  directories (symlinked; ``docs/`` is a real folder there holding links to its subfolders only,
  so a command that writes ``docs/vgg16-plan.svg`` writes the scratch copy), with ``.venv/bin/``
  meaning the interpreter running pytest. A command that is too slow for CI, needs root, GPUs
  or several hosts, or is this suite itself runs in the cheap form given in ``CHEAP`` with the
  reason; a command in a page that is neither run as written nor listed fails its test (it runs,
  and times out or breaks), and a ``CHEAP`` entry no page has any more fails
  ``test_exceptions_are_current``;
- compiles every ``python`` block and runs the self-contained ones (``FRAGMENTS`` lists the
  rest, with the reason; ``FILES`` the blocks a command runs as a script);
- checks every relative link (and ``#anchor`` into a page) points at something that exists, and
  so do the repository paths (``runtime/schedules/commplan.py``) and the ``fxpipe.`` module and
  attribute names (``fxpipe.runtime.training.checkpoint.load_model_state``) the prose names;
- checks docs/cli.md names every option of ``fxpipe plan``, ``simulate`` and ``train``, and only
  real ones; that the README links every docs page (one link to each feature's page); and that
  the modules docs/DESIGN.md lists in each runtime package's contract exist.
"""
from __future__ import annotations

import importlib
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BIN = Path(sys.executable).parent
TIMEOUT = 150  # seconds one command may take; the slowest run here takes ~20 s

QUICK = ('.venv/bin/fxpipe plan pipedream:vgg16 --workers 8 --bandwidth 10Gbps --sync '
         'parameter-server --schedule pipedream --svg vgg16-plan.svg')
INSTALL = ('apt-get update -q && apt-get install -y -q graphviz && python3 -m venv .venv && '
           f'.venv/bin/pip install -q torch==2.13.0 -e ".[dev]" && {QUICK}')
LLAMA = ('.venv/bin/fxpipe plan "hf:LlamaForCausalLM:hidden_size=4096,intermediate_size=11008,'
         'num_hidden_layers={layers},num_attention_heads=32,num_key_value_heads=32,'
         'vocab_size=32000" --meta --device A100 --memory 80GB --workers {workers} --seq-len 2048 '
         '--batch-size 1 --svg docs/llama-7b-plan.svg')
RESNET = ('.venv/bin/fxpipe train resnet50 --data digits --nproc 2 --epochs {epochs} '
          '--batch-size 32 --lr 0.05 --schedule pipedream')
LM = ('.venv/bin/fxpipe train docs/examples/lm_stdlib.py:model --data '
      'docs/examples/lm_stdlib.py:loaders --nproc 2 --stages 2 --straight --schedule 1f1b-flush '
      '--microbatches 4 --optimizer adamw --lr 0.003 --weight-decay 0.1 --warmup 15 '
      '--schedule-lr cosine --clip 1.0 --precision bf16 --epochs {epochs} --metrics out.jsonl')
GPU = ".venv/bin/python -m tests.gpu.gpu_check"
ONE_GPU = ".venv/bin/python -m tests.gpu.one_gpu_check"
MUTATION = ("nice -n 10 .venv/bin/python -m tools.mutation --reuse && "
            ".venv/bin/python -m tools.mutation --report")
EXPERIMENT = ".venv/bin/python -m bench.experiment.run"
REPLAN = ("sudo .venv/bin/python -m bench.replan --hosts 2 --mbit 1000 --layers 12 --after 2 "
          "--repeats 8")

# command as the page writes it -> (what the test runs instead, or None: nothing; why)
CHEAP: dict[str, tuple[str | None, str]] = {
    INSTALL: (QUICK,
              "apt-get and pip need root and the network, and the venv exists already: .ci/run "
              "runs the line verbatim on a clean clone (tests/test_readme.py checks it is the "
              "README's); here its last step, the plan, runs"),
    ".venv/bin/python -m pytest -q -p no:cacheprovider": (
        None, "the whole suite, which includes this test: .ci/run runs it"),
    '.venv/bin/python -m pytest -q -p no:cacheprovider -m "not multiprocess and not slow"': (
        None, "most of the suite (~3 minutes), which includes this test: .ci/run runs the whole "
              "suite"),
    ".venv/bin/python -m pytest -q -p no:cacheprovider tests/test_readme.py tests/test_docs.py": (
        None, "this test itself"),
    ".venv/bin/fxpipe plan vgg16 --size full --device V100 --workers 8 --bandwidth 10Gbps": (
        ".venv/bin/fxpipe plan vgg16 --size full --device V100 --workers 8 --bandwidth 10Gbps "
        "--batch-size 2",
        "shape propagation runs the full VGG16 on its default batch of 128 on the CPU (~50 s on "
        "2 cores); a batch of 2 takes the same path"),
    RESNET.format(epochs=3): (RESNET.format(epochs=1),
                              "the same two-process job, one epoch instead of three"),
    LM.format(epochs=10): (LM.format(epochs=1),
                           "the same two-process job, one epoch instead of ten"),
    f"{GPU}": (f"{GPU} --help", "needs 2-4 CUDA GPUs (tests/gpu's gpu tests run it where they are)"),
    f"{GPU} --publish": (f"{GPU} --help", "needs 2-4 CUDA GPUs, and writes benchmarks/"),
    f"{GPU} --dry": (f"{GPU} --help",
                     "every case on gloo takes several minutes on 2 cores; tests/gpu/"
                     "test_gpu_check.py's test_dry_* run one case and the Trainer check of it"),
    f"{ONE_GPU} --publish": (f"{ONE_GPU} --help",
                             "needs a CUDA GPU, and writes benchmarks/; tests/gpu/"
                             "test_one_gpu_check.py runs its --dry (which the page's other "
                             "line names, run here as written)"),
    MUTATION: (".venv/bin/python -m tools.mutation --help && "
               ".venv/bin/python -m tools.mutation --report --out mutation-report.md",
               "the mutation run takes hours on 2 cores: its arguments are checked and the "
               "saved results rendered (into the scratch folder, not BENCHMARKS.md)"),
    EXPERIMENT: (f"{EXPERIMENT} --help",
                 "needs root (network namespaces, tc) and ~23 minutes; "
                 "tests/cluster/ runs the emulated cluster where root is available"),
    f"{EXPERIMENT} --smoke": (f"{EXPERIMENT} --help",
                              "needs root: it still brings up two emulated hosts"),
    ".venv/bin/python -m bench.simcheck.run": (
        ".venv/bin/python -m bench.simcheck.run --help",
        "needs root (emulated hosts) and ~3 minutes; tests/cluster/test_cluster_simcheck.py"),
    REPLAN: (".venv/bin/python -m bench.replan --help",
             "needs root (emulated hosts) and minutes of training runs"),
}

# commands whose page shows what they print (the untyped block after theirs): every line of it
# must still be in their output (deterministic: the costs are estimated, not measured)
CHECK_PRINTED = {
    QUICK,
    ".venv/bin/fxpipe plan vgg16 --workers 8 --bandwidth 10Gbps --device V100 --batch-size 64 "
    "--svg docs/vgg16-plan.svg",
    ".venv/bin/fxpipe plan vgg16 --workers 8 --bandwidth 10Gbps --device V100 --batch-size 64 "
    "--schedule pipedream --detail",
    ".venv/bin/fxpipe simulate gpt --device V100 --workers 8 --bandwidth 10Gbps --straight "
    "--stages 8 --schedule zb-h2 --choose planner",
    LLAMA.format(layers=32, workers=8),
}

# (page, first line) of a python block that is a script a command runs -> the file name
FILES = {("README.md", "# train.py: the same script on every rank (torchrun starts them)"):
         "train.py"}

# (page, first line) of a python block that only compiles -> why it cannot run alone
FRAGMENTS: dict[tuple[str, str], str] = {
    ("huggingface.md", "# train.py, launched by: torchrun --nproc-per-node 4 train.py"):
        "uses the reader's config and loader; tests/runtime/training/test_recipe_dist.py trains "
        "this recipe (a Llama, no schedule named, -100 padding) on 2 torchrun ranks against "
        "plain PyTorch",
    ("training.md", "# train.py, launched by: torchrun --nproc-per-node 4 train.py   (or "
                    "--nnodes N ... across machines)"):
        "a sketch over the reader's model and loaders; the README's train.py is the complete "
        "version, run by its torchrun command",
    ("training.md", "from fxpipe.models import ModelSpec"):
        "a factory's sketch over the reader's own MyNet; tests/api/test_api_cli_user_job.py "
        "trains a user's factory through fxpipe train",
    ("training.md", "from fxpipe.runtime import weight_decay_groups"):
        "uses the reader's compiled model, dataset and LR function; tests/runtime/ tests each "
        "option against eager PyTorch",
    ("torch-pipelining.md",
     'pipe = compiled.torch_stages(rank, world_size, placement="loop")   # or "v" for ZB-V'):
        "one rank's step inside a torchrun job: docs/examples/torch_pipelining.py is the "
        "complete script, run by the page's torchrun commands",
    ("DESIGN.md", "from fxpipe.tracing import trace, TracedGraph"): "API signatures",
    ("DESIGN.md", "from fxpipe.costmodel import profile_graph, estimate_graph, to_profile, "
                  "Profile, ProfileNode, Cluster, get_device"): "API signatures",
    ("DESIGN.md", "from fxpipe.passes import partition, Plan, StagePlan, solve"):
        "API signatures",
    ("DESIGN.md", "from fxpipe.codegen import split_graph, StageSpec, run_stages, "
                  "export_stages, load_exported, draw_plan"): "API signatures",
}


# --- reading the pages ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Block:
    page: Path
    lang: str
    text: str
    line: int  # of the opening fence, 1-based
    after: str | None  # the untyped block right after this one, if the next block is one

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"

    @property
    def first(self) -> str:
        return self.text.splitlines()[0].strip() if self.text.strip() else ""


def blocks(page: Path) -> list[Block]:
    raw: list[tuple[str, str, int]] = []
    lang, start, body = None, 0, []
    for i, line in enumerate(page.read_text().splitlines(), 1):
        if lang is None:
            if line.startswith("```"):
                lang, start, body = line[3:].strip(), i, []
        elif line.strip() == "```":
            raw.append((lang, "\n".join(body) + "\n", start))
            lang = None
        else:
            body.append(line)
    assert lang is None, f"{page}: unclosed code block from line {start}"
    return [Block(page, lg, text, ln,
                  raw[k + 1][1] if k + 1 < len(raw) and raw[k + 1][0] == "" else None)
            for k, (lg, text, ln) in enumerate(raw)]


def prose(page: Path) -> str:
    """The page without its fenced blocks (links and names in code blocks are not checked)."""
    return re.sub(r"^```.*?^```[ \t]*$", "", page.read_text(), flags=re.M | re.S)


def strip_comment(line: str) -> str:
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line.rstrip()


def commands(block: Block) -> list[str]:
    text = re.sub(r"\\\n\s*", " ", block.text)
    out = [strip_comment(line).strip() for line in text.splitlines()]
    return [c for c in out if c]


ALL_BLOCKS = [b for page in PAGES for b in blocks(page)]
WRITTEN = [(c, b, k) for b in ALL_BLOCKS if b.lang in ("bash", "sh", "shell")
           for k, c in enumerate(commands(b))]


def effective(written: str) -> str | None:
    return CHEAP[written][0] if written in CHEAP else written


RUNS: dict[str, list[tuple[str, Block, int]]] = {}  # what runs -> the page commands it stands for
for _c, _b, _k in WRITTEN:
    if effective(_c) is not None:
        RUNS.setdefault(effective(_c), []).append((_c, _b, _k))  # type: ignore[arg-type]


# --- running a command ---------------------------------------------------------------------------
def scratch(work: Path) -> Path:
    """A folder that sees the repository's directories but keeps what commands write."""
    work.mkdir(parents=True, exist_ok=True)
    for entry in ROOT.iterdir():
        if entry.is_dir() and not entry.name.startswith((".", "__")) and entry.name != "docs":
            (work / entry.name).symlink_to(entry, target_is_directory=True)
    (work / "docs").mkdir()
    for entry in (ROOT / "docs").iterdir():
        if entry.is_dir():
            (work / "docs" / entry.name).symlink_to(entry, target_is_directory=True)
    for b in ALL_BLOCKS:
        name = FILES.get((b.page.name, b.first))
        if name:
            (work / name).write_text(b.text)
    return work


_RESULTS: dict[str, subprocess.CompletedProcess[str]] = {}


def run(command: str, work: Path) -> subprocess.CompletedProcess[str]:
    if command not in _RESULTS:
        cmd = command.replace(".venv/bin/", f"{BIN}/")
        env = dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")
        env.pop("FXPIPE_OVERHEADS", None)  # as a reader runs it (conftest turns them off)
        t0 = time.perf_counter()
        # a session of its own: on a timeout the whole group goes (torchrun and its ranks too)
        proc = subprocess.Popen(["bash", "-c", cmd], cwd=scratch(work), env=env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True)
        try:
            out, err = proc.communicate(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            pytest.fail(f"{command!r} ran past {TIMEOUT} s: too slow for CI; give it a cheap form "
                        f"in CHEAP (tests/test_docs.py) with the reason")
        res = subprocess.CompletedProcess(cmd, proc.returncode, out, err)
        res.args = f"{command}  ({time.perf_counter() - t0:.1f} s)"
        _RESULTS[command] = res
    return _RESULTS[command]


@pytest.mark.multiprocess
@pytest.mark.parametrize("command", sorted(RUNS, key=lambda c: (RUNS[c][0][1].where, RUNS[c][0][2])),
                         ids=lambda c: f"{RUNS[c][0][1].where}[{RUNS[c][0][2]}]")
def test_command(command: str, tmp_path: Path) -> None:
    res = run(command, tmp_path)
    shown = ", ".join(f"{b.where}: {c!r}" for c, b, _ in RUNS[command])
    assert res.returncode == 0, (f"{shown} exits {res.returncode}\n--- stdout\n{res.stdout[-3000:]}"
                                 f"\n--- stderr\n{res.stderr[-3000:]}")
    for written, block, _ in RUNS[command]:
        if written in CHECK_PRINTED:
            assert block.after, f"{block.where}: no printed output after {written!r}"
            got = {line.rstrip() for line in res.stdout.splitlines()}
            missing = [line for line in block.after.splitlines()
                       if line.strip() and line.rstrip() not in got]
            assert not missing, (f"{block.where}: the page says {written!r} prints lines it no "
                                 f"longer does: {missing}\n--- it printed\n{res.stdout}")


def test_exceptions_are_current() -> None:
    """Every exception names a command a page still has, and every command that is not run as
    written says why."""
    written = {c for c, _, _ in WRITTEN}
    assert not set(CHEAP) - written, f"CHEAP names commands no page has: {set(CHEAP) - written}"
    assert not CHECK_PRINTED - written, CHECK_PRINTED - written
    for c in written & set(CHEAP):
        assert CHEAP[c][1], c
    firsts = {(b.page.name, b.first) for b in ALL_BLOCKS if b.lang == "python"}
    stale = (set(FRAGMENTS) | set(FILES)) - firsts
    assert not stale, f"FRAGMENTS/FILES name python blocks no page has: {stale}"


# --- python blocks -------------------------------------------------------------------------------
PYTHON = [b for b in ALL_BLOCKS if b.lang in ("python", "py")]


@pytest.mark.multiprocess
@pytest.mark.parametrize("block", PYTHON, ids=lambda b: b.where)
def test_python_block(block: Block, tmp_path: Path) -> None:
    compile(block.text, block.where, "exec")
    key = (block.page.name, block.first)
    if key in FRAGMENTS or key in FILES:
        return  # compiled; FRAGMENTS says why it does not run alone, FILES which command runs it
    script = scratch(tmp_path) / "block.py"
    script.write_text(block.text)
    res = subprocess.run([sys.executable, str(script)], cwd=tmp_path, text=True,
                         capture_output=True, timeout=TIMEOUT)
    assert res.returncode == 0, (f"{block.where} fails (if it is not meant to run alone, add it "
                                 f"to FRAGMENTS with the reason)\n{res.stdout[-2000:]}\n"
                                 f"{res.stderr[-3000:]}")


# --- links, paths and names ----------------------------------------------------------------------
def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in prose(page).splitlines():
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            s = slug(m.group(1))
            out.add(f"{s}-{seen[s]}" if s in seen else s)
            seen[s] = seen.get(s, 0) + 1
    return out


LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_links(page: Path) -> None:
    bad = []
    for target in LINK.findall(prose(page)):
        if re.match(r"[a-z]+:", target):
            continue  # https:, mailto:
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            bad.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{target}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    assert not bad, f"{page.relative_to(ROOT)}: " + "; ".join(bad)


TOP = sorted(p.name for p in ROOT.iterdir() if p.is_dir() and not p.name.startswith((".", "__"))
             and p.name not in ("out", "build", "dist") and not p.name.endswith(".egg-info"))
PATH = re.compile(r"(?<![\w./<-])((?:%s)/[\w./-]*)" % "|".join(map(re.escape, TOP)))
PHASES = ("fxpipe", "tracing", "costmodel", "passes", "codegen", "runtime")
NAME = re.compile(r"`((?:%s)(?:\.[A-Za-z_]\w*)+)" % "|".join(PHASES))


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_paths_exist(page: Path) -> None:
    """Repository paths the prose names (``runtime/schedules/commplan.py``, ``bench/replan.py``)."""
    missing = sorted({p.rstrip(".") for p in PATH.findall(prose(page))
                      if not (ROOT / p.rstrip(".")).exists()})
    assert not missing, f"{page.relative_to(ROOT)} names paths that do not exist: {missing}"


def resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    if parts[0] != "fxpipe":
        parts = ["fxpipe", *parts]
    for i in range(len(parts), 0, -1):
        name = ".".join(parts[:i])
        try:
            obj = importlib.import_module(name)
        except ModuleNotFoundError as err:
            if err.name and (name == err.name or name.startswith(err.name + ".")):
                continue
            raise
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_module_names_resolve(page: Path) -> None:
    """``fxpipe.runtime.training.checkpoint.load_model_state``, ``runtime.timeline`` and the like:
    the module exists and has the attribute (renames in the code show up here)."""
    names = sorted(set(NAME.findall(prose(page))))
    bad = [n for n in names if not resolves(n)]
    assert not bad, f"{page.relative_to(ROOT)} names what does not exist: {bad}"


# --- the CLI reference ---------------------------------------------------------------------------
OPTION = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")


@pytest.mark.multiprocess
@pytest.mark.parametrize("sub", ["plan", "simulate", "train"])
def test_cli_reference_is_complete(sub: str, tmp_path: Path) -> None:
    text = (ROOT / "docs" / "cli.md").read_text()
    section = re.search(rf"^## fxpipe {sub}\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert section, f"docs/cli.md has no section '## fxpipe {sub}'"
    res = run(f".venv/bin/fxpipe {sub} --help", tmp_path)
    assert res.returncode == 0, res.stderr
    real = set(OPTION.findall(res.stdout)) - {"--help"}
    named = set(OPTION.findall(section.group(1)))
    assert not real - named, f"docs/cli.md does not name fxpipe {sub}'s {sorted(real - named)}"
    tabled = {o for row in re.findall(r"^\| ([^|]*) \|", section.group(1), re.M)
              for o in OPTION.findall(row)}
    assert not tabled - real, f"docs/cli.md lists options fxpipe {sub} lacks: {tabled - real}"


# --- the pages as a whole ------------------------------------------------------------------------
def test_every_page_is_one_link_from_the_readme() -> None:
    readme = prose(ROOT / "README.md")
    linked = {(ROOT / t.partition("#")[0]).resolve() for t in LINK.findall(readme)}
    unlinked = [str(p.relative_to(ROOT)) for p in PAGES[1:] if p.resolve() not in linked]
    assert not unlinked, f"the README links to no {unlinked}: add them to its feature list"


def test_design_lists_real_modules() -> None:
    """Each runtime package's contract in docs/DESIGN.md names its main modules: they exist."""
    text = prose(ROOT / "docs" / "DESIGN.md")
    found = re.findall(r"\*\*Main modules\*\*\s+\(`(runtime/\w+/)`\):(.*?)(?:\n\n|\Z)", text, re.S)
    assert len(found) == 5, [f[0] for f in found]
    missing = [f"{folder}{m}" for folder, body in found
               for m in re.findall(r"`(\w+\.py)`", body) if not (ROOT / folder / m).is_file()]
    assert not missing, f"docs/DESIGN.md names modules that do not exist: {missing}"
