"""Launch a script across the emulated hosts with torchrun multi-node rendezvous.

Why torchrun and not ``torch.multiprocessing``: the point of the emulated cluster is that fxpipe is
launched exactly as a user would launch it on N real machines (one ``torchrun --nnodes N
--node-rank i --master-addr <host0>`` per machine), so rendezvous, the TCPStore and gloo all go
over the shaped links.
"""
from __future__ import annotations

import logging
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Mapping, Sequence

from .netns import EmulatedCluster, _kill_popen

log = logging.getLogger("tools.cluster")


def torchrun_argv(cluster: EmulatedCluster, node_rank: int, script_args: Sequence[str], *,
                  nproc_per_host: int = 1, master_host: int = 0, port: int = 29500,
                  python: str = sys.executable) -> list[str]:
    """The ``python -m torch.distributed.run ...`` command line for one host."""
    return [python, "-m", "torch.distributed.run",
            "--nnodes", str(cluster.hosts), "--nproc-per-node", str(nproc_per_host),
            "--node-rank", str(node_rank), "--master-addr", cluster.address(master_host),
            "--master-port", str(port), "--max-restarts", "0",
            *map(str, script_args)]


def torchrun_across(cluster: EmulatedCluster, script_args: Sequence[str], nproc_per_host: int = 1,
                    master_host: int = 0, port: int = 29500, env: Mapping[str, str] | None = None,
                    log_dir: str | Path | None = None, python: str = sys.executable) -> list[subprocess.Popen]:
    """Start one torchrun agent per host (node rank = host index); returns their Popens in order.

    The environment pins gloo to ``eth0`` (the hostname resolves to an address that doesn't exist
    inside the namespaces) and sets one intra-op thread per process, since each host is one core.
    Each host's stdout+stderr goes to ``log_dir/host<i>.log`` (a fresh temporary folder by
    default; files, not pipes, so a chatty child can never block on a full pipe while we wait);
    the path is on each Popen as ``.log_path`` (see ``read_output``).  Use ``wait_all`` to wait
    with a timeout; the cluster kills anything left on exit.
    """
    base_env = {"GLOO_SOCKET_IFNAME": "eth0", "TP_SOCKET_IFNAME": "eth0",
                "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                **(env or {})}
    log_dir = Path(log_dir) if log_dir is not None else Path(tempfile.mkdtemp(prefix="fxp-torchrun-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    procs = []
    for host in range(cluster.hosts):
        argv = torchrun_argv(cluster, host, script_args, nproc_per_host=nproc_per_host,
                             master_host=master_host, port=port, python=python)
        path = log_dir / f"host{host}.log"
        with open(path, "wb") as out:  # the child keeps its own descriptor
            proc = cluster.run(host, argv, env=base_env, stdout=out, stderr=subprocess.STDOUT)
        proc.log_path = path  # type: ignore[attr-defined]
        procs.append(proc)
    log.info("torchrun started on %d hosts (master %s:%d)", cluster.hosts,
             cluster.address(master_host), port)
    return procs


def wait_all(procs: Sequence[subprocess.Popen], timeout: float, fail_fast_grace: float = 10.0) -> list[int]:
    """Wait for every process; returns exit codes.  Kills all of them and raises ``TimeoutError``
    after ``timeout`` seconds.  When one fails, the others get ``fail_fast_grace`` seconds to
    exit before being killed (their peers are gone; rendezvous timeouts would take minutes), and
    their code is then reported as the negative signal number, like Popen does.
    """
    deadline = time.monotonic() + timeout
    failed_at: float | None = None
    while True:
        codes = [p.poll() for p in procs]
        if all(c is not None for c in codes):
            return [int(c) for c in codes]  # type: ignore[arg-type]
        now = time.monotonic()
        if failed_at is None and any(c not in (None, 0) for c in codes):
            failed_at = now
            log.warning("a process failed (codes %s); giving the rest %.0f s", codes, fail_fast_grace)
        if now > deadline or (failed_at is not None and now - failed_at > fail_fast_grace):
            for p in procs:
                _kill_popen(p)
            for p in procs:
                try:
                    p.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    log.error("pid %d survived SIGKILL", p.pid)
            if now > deadline:
                raise TimeoutError(f"processes still running after {timeout} s; killed all")
            return [int(p.returncode) if p.returncode is not None else -9 for p in procs]
        time.sleep(0.05)


def read_output(proc: subprocess.Popen) -> str:
    """The output (so far) of a process started by ``torchrun_across``, from its log file."""
    return Path(proc.log_path).read_text(errors="replace")  # type: ignore[attr-defined]
