"""Process helpers of the runtime tests: where the job scripts are, a free port, and running a
job (torchrun and its ranks, or one process) so that it is always reaped.

The tests live in one folder per runtime package (``schedules/``, ``pricing/``, ``replica/``,
``execution/``, ``training/``); the ``*_job.py`` scripts and the helpers stay here, in
``tests/runtime/``. A job's ``PYTHONPATH`` holds this folder and every package folder, as
``conftest.py`` puts them on the tests' ``sys.path``: jobs import helpers and test modules by
bare name (``recipe_replicated_job.py`` imports ``test_recipe_replicated``).
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent  # tests/runtime: the *_job.py scripts
ROOT = HERE.parent.parent
PACKAGES = ("schedules", "pricing", "replica", "execution", "training")
# where bare imports resolve: this folder, then each package's tests
PATHS = [HERE, *(HERE / p for p in PACKAGES)]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run(cmd: list[str], timeout: float = 240) -> subprocess.CompletedProcess:
    """Run and always reap: on a timeout its whole process group (torchrun and its ranks)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([*map(str, PATHS), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, cwd=ROOT, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun and every rank it started
        out, _ = proc.communicate()
        pytest.fail(f"timed out after {timeout} s: {' '.join(cmd)}\n{out[-3000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, "")


def _torchrun(*args: str, nproc: int = 2) -> subprocess.CompletedProcess:
    return _run([sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
                 "--master-addr=127.0.0.1", f"--master-port={_port()}",
                 str(HERE / "trainer_job.py"), *args])
