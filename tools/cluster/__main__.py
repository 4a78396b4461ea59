"""CLI: ``python -m tools.cluster {up,down,list,cleanup,exec,measure,torchrun} ...`` (repo root, as
root).

``up`` leaves a cluster running (for interactive poking) and prints its id; ``exec`` runs a
command on one of its hosts; ``down`` removes it; ``cleanup`` removes every cluster with a prefix
(leftovers of crashed runs).  ``measure`` and ``torchrun`` use a throwaway cluster that is always
torn down, even on Ctrl-C or failure.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys

from .launch import read_output, torchrun_across, wait_all
from .measure import measure_link
from .netns import EmulatedCluster, _matching, cleanup, netns_argv


def _cluster_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--hosts", type=int, default=2)
    p.add_argument("--bandwidth", default="50Mbit", help="per-host link rate, each direction")
    p.add_argument("--latency", default="0.5ms", help="one-way host-to-host delay (needs sch_netem)")
    p.add_argument("--cpus", default=None, help="comma-separated cores, host i -> cpus[i %% len]")
    p.add_argument("--prefix", default="fxp")


def _make(a: argparse.Namespace) -> EmulatedCluster:
    cpus = [int(c) for c in a.cpus.split(",")] if a.cpus else None
    return EmulatedCluster(a.hosts, a.bandwidth, a.latency, cpus=cpus, prefix=a.prefix)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.cluster", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-v", "--verbose", action="store_true")
    sub = ap.add_subparsers(dest="cmd", required=True)
    _cluster_args(sub.add_parser("up", help="create a cluster and leave it running"))
    sub.add_parser("down", help="remove one cluster").add_argument("cluster_id")
    sub.add_parser("list", help="list clusters").add_argument("--prefix", default="fxp")
    sub.add_parser("cleanup", help="remove all clusters with a prefix").add_argument("--prefix", default="fxp")
    ex = sub.add_parser("exec", help="run a command on a host of an `up` cluster")
    ex.add_argument("cluster_id")
    ex.add_argument("host", type=int)
    ex.add_argument("--cpu", type=int, default=None, help="default: the host's core, as in `up`")
    ex.add_argument("--timeout", type=float, default=3600.0, help="kill the command after this many s")
    ex.add_argument("command", nargs=argparse.REMAINDER)
    me = sub.add_parser("measure", help="probe goodput and RTT on a throwaway cluster")
    _cluster_args(me)
    me.add_argument("--mbytes", type=float, default=2.0)
    tr = sub.add_parser("torchrun", help="torchrun a script across a throwaway cluster")
    _cluster_args(tr)
    tr.add_argument("--port", type=int, default=29500)
    tr.add_argument("--timeout", type=float, default=600.0)
    tr.add_argument("--log-dir", default=None)
    tr.add_argument("script", nargs=argparse.REMAINDER, help="script and its arguments")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO if a.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")

    if a.cmd == "up":
        c = _make(a).start()
        print(c.id)
        for i in range(c.hosts):
            print(f"  host {i}: netns {c.namespaces[i]}  addr {c.address(i)}  cpu {c.cpu(i)}")
        print(f"  latency emulated: {c.latency_emulated}")
        return 0
    if a.cmd == "down":
        prefix = a.cluster_id.rsplit("-", 2)[0]
        removed = cleanup(prefix, cluster_id=a.cluster_id)
        print("\n".join(removed) or "nothing to remove")
        return 0 if removed else 1
    if a.cmd == "list":
        for cid, names in sorted(_matching(a.prefix).items()):
            print(cid, " ".join(sorted(names)))
        return 0
    if a.cmd == "cleanup":
        removed = cleanup(a.prefix)
        print("\n".join(removed) or "nothing to remove")
        return 0
    if a.cmd == "exec":
        cmd = a.command[1:] if a.command[:1] == ["--"] else a.command
        avail = sorted(os.sched_getaffinity(0))
        cpu = a.cpu if a.cpu is not None else avail[a.host % len(avail)]
        try:
            return subprocess.run(netns_argv(f"{a.cluster_id}-h{a.host}", cmd, cpu), timeout=a.timeout).returncode
        except subprocess.TimeoutExpired:
            print(f"timed out after {a.timeout} s", file=sys.stderr)
            return 124
    if a.cmd == "measure":
        with _make(a) as c:
            print(json.dumps(measure_link(c, nbytes=int(a.mbytes * 2**20)), indent=2))
        return 0
    if a.cmd == "torchrun":
        script = a.script[1:] if a.script[:1] == ["--"] else a.script
        with _make(a) as c:
            procs = torchrun_across(c, script, port=a.port, log_dir=a.log_dir)
            codes = wait_all(procs, timeout=a.timeout)
            for i, p in enumerate(procs):
                print(f"--- host {i} (exit {codes[i]}, log {p.log_path}) ---")
                print(read_output(p)[-4000:])
        return max((abs(c) for c in codes), default=0)
    return 2


if __name__ == "__main__":
    sys.exit(main())
