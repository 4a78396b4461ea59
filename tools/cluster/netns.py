"""An emulated commodity cluster on one machine: Linux network namespaces, veth pairs, a bridge, tc.

Why namespaces: fxpipe's claim is about commodity networks, and the only honest way to show it on
one box is to make every byte between "hosts" cross a real kernel network stack through a link
with a fixed rate, while each host computes on its own CPU core.  Each host is a namespace with one
interface ``eth0`` (address ``<subnet>.<i+1>/24``); every ``eth0`` is one end of a veth pair whose
other end is a port of a bridge that lives in *its own* namespace (``<id>-br``).  The veth pairs
are created from inside the bridge namespace with the peer placed straight into the host namespace,
so the root namespace's interfaces, routes and qdiscs are never touched, and interface names only
have to be unique inside one namespace.

Shaping (see ``_shape``): every link is shaped at both ends, host egress (upload) and bridge-port
egress (download), with HTB at the configured rate (small packets such as ACKs in a priority leaf,
so full-duplex transfers each get the full rate); so host A -> host B is limited by A's upload and
B's download exactly like a host-to-switch-to-host path.  ``latency`` is the
one-way host-to-host delay: each of the two shaped hops on a path adds half of it with a ``netem``
child qdisc, so RTT = 2 x latency.  Kernels built without ``sch_netem`` (like the one this tool was
developed on) cannot delay packets in-kernel; the cluster then shapes bandwidth only, logs a
warning and reports ``latency_emulated = False``.

Cleanup: names are ``<prefix>-<pid>-<k>-h<i>`` / ``<prefix>-<pid>-<k>-br``, unique per instance;
leaving the context (also on an exception or SIGTERM) kills every process inside the namespaces
(found with ``ip netns pids``, so daemonised grandchildren go too) and deletes the namespaces,
which destroys the veth pairs and the bridge with them.  ``cleanup(prefix)`` removes leftovers of
runs that were SIGKILLed.
"""
from __future__ import annotations

import atexit
import itertools
import json
import logging
import os
import re
import signal
import subprocess
import threading
import time
from typing import Any, Mapping, Sequence

log = logging.getLogger("tools.cluster")

_IP_TIMEOUT_S = 15.0
_counter = itertools.count()
_PREFIX_RE = re.compile(r"^[a-z][a-z0-9_]{0,15}$")


class ClusterError(RuntimeError):
    """A namespace/link/qdisc operation failed, or teardown could not remove everything."""


def _sh(args: Sequence[str], check: bool = True, timeout: float = _IP_TIMEOUT_S) -> subprocess.CompletedProcess:
    """Run an ``ip``/``tc`` command; a timeout on every call so a wedged netlink call can't hang
    us."""
    proc = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise ClusterError(f"{' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def parse_rate(rate: str | float) -> int:
    """'50Mbit', '10Gbps', '100kbit', 5e7 -> bits per second.

    'bps' means bits per second here (network convention, as in ``fxpipe.Cluster(bandwidth=...)``),
    unlike tc where 'mbps' means megaBYTES per second; that is why we hand tc plain ``<n>bit``.
    """
    if isinstance(rate, (int, float)):
        return int(rate)
    m = re.fullmatch(r"\s*([0-9.]+)\s*([kmgt]?)(bit|bps|b/s)?\s*", rate.lower())
    if not m:
        raise ValueError(f"cannot parse rate {rate!r}; use e.g. '50Mbit' or '10Gbps'")
    scale = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}[m.group(2)]
    return int(float(m.group(1)) * scale)


def parse_time(value: str | float) -> float:
    """'0.5ms', '500us', '1s', 0.0005 -> seconds."""
    if isinstance(value, (int, float)):
        return float(value)
    m = re.fullmatch(r"\s*([0-9.]+)\s*(s|ms|us|ns)?\s*", value.lower())
    if not m:
        raise ValueError(f"cannot parse time {value!r}; use e.g. '0.5ms'")
    return float(m.group(1)) * {"s": 1.0, None: 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}[m.group(2)]


def list_namespaces() -> list[str]:
    """Names of all named network namespaces (``ip netns list``)."""
    out = _sh(["ip", "netns", "list"]).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def namespace_pids(ns: str) -> list[int]:
    """Pids of live processes whose network namespace is ``ns`` (zombies have none, so aren't
    listed)."""
    proc = _sh(["ip", "netns", "pids", ns], check=False)
    return [int(p) for p in proc.stdout.split() if p.isdigit()]


def _kill_namespace_processes(namespaces: Sequence[str], timeout: float = 5.0) -> list[int]:
    """SIGKILL everything inside ``namespaces`` until nothing is left; returns survivors' pids."""
    deadline = time.monotonic() + timeout
    while True:
        pids = [p for ns in namespaces for p in namespace_pids(ns)]
        if not pids or time.monotonic() > deadline:
            return pids
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)


def _delete_namespaces(namespaces: Sequence[str]) -> list[str]:
    """Kill processes in, then delete, ``namespaces`` (hosts before the bridge); returns
    failures."""
    survivors = _kill_namespace_processes(namespaces)
    if survivors:
        log.warning("processes survived SIGKILL in %s: %s", list(namespaces), survivors)
    present = set(list_namespaces())
    failed = []
    for ns in sorted(namespaces, key=lambda n: n.endswith("-br")):
        if ns in present and _sh(["ip", "netns", "del", ns], check=False).returncode != 0:
            failed.append(ns)
    return failed


def _matching(prefix: str) -> dict[str, list[str]]:
    """Namespaces created by this tool with ``prefix``, grouped by cluster id."""
    pat = re.compile(rf"^({re.escape(prefix)}-\d+-\d+)-(h\d+|br)$")
    groups: dict[str, list[str]] = {}
    for ns in list_namespaces():
        m = pat.match(ns)
        if m:
            groups.setdefault(m.group(1), []).append(ns)
    return groups


def cleanup(prefix: str = "fxp", cluster_id: str | None = None) -> list[str]:
    """Remove every namespace (and so every veth, bridge, and process in it) left by ``prefix``
    runs.

    For runs that died without tearing down (SIGKILL, power loss).  It removes *all* clusters with
    that prefix, including live ones, so use a prefix of your own per concurrent user.  With
    ``cluster_id`` only that cluster is removed (what ``down`` does).  Returns the removed names.
    """
    groups = _matching(prefix)
    if cluster_id is not None:
        groups = {k: v for k, v in groups.items() if k == cluster_id}
    removed = []
    for cid, namespaces in groups.items():
        failed = _delete_namespaces(namespaces)
        if failed:
            raise ClusterError(f"could not delete {failed} of cluster {cid}")
        removed += namespaces
        log.info("removed cluster %s (%d namespaces)", cid, len(namespaces))
    return removed


def can_create_namespaces() -> tuple[bool, str]:
    """Probe by creating and deleting a throwaway namespace: the only test that captures every
    reason (not root, no CAP_NET_ADMIN, no ``ip``, a seccomp/container policy).  (ok, reason)."""
    name = f"fxpprobe-{os.getpid()}-{next(_counter)}"
    try:
        proc = _sh(["ip", "netns", "add", name], check=False)
    except (FileNotFoundError, PermissionError) as e:
        return False, f"`ip` (iproute2) is not usable: {e}"
    except subprocess.TimeoutExpired:
        return False, "`ip netns add` timed out"
    if proc.returncode != 0:
        return False, f"cannot create network namespaces (need root/CAP_NET_ADMIN): {proc.stderr.strip()}"
    _sh(["ip", "netns", "del", name], check=False)
    for tool in ("tc", "taskset"):
        try:
            subprocess.run([tool, "-V"], capture_output=True, timeout=5)
        except FileNotFoundError:
            return False, f"`{tool}` is not installed"
    return True, ""


def netns_argv(ns: str, argv: Sequence[str], cpu: int | None) -> list[str]:
    """The argv that runs ``argv`` inside ``ns``, pinned to ``cpu`` (``ip netns exec ns
    taskset``)."""
    pin = ["taskset", "-c", str(cpu)] if cpu is not None else []
    return ["ip", "netns", "exec", ns, *pin, *map(str, argv)]


class EmulatedCluster:
    """N hosts joined by shaped links through one bridge; a context manager that always cleans up.

    ``bandwidth`` is each host's link rate in each direction; ``latency`` the one-way
    host-to-host delay (needs ``sch_netem``; see ``latency_emulated``).  Host ``i`` runs on
    ``cpus[i % len(cpus)]`` (default: the CPUs this process may use), so with one core per host the
    compute-to-communication ratio is that of one core against the link.
    """

    def __init__(self, hosts: int, bandwidth: str | float = "50Mbit", latency: str | float = "0.5ms",
                 cpus: list[int] | None = None, prefix: str = "fxp", subnet: str = "10.123.45",
                 require_latency: bool = False) -> None:
        if hosts < 1 or hosts > 250:
            raise ValueError("hosts must be in 1..250 (one /24)")
        if not _PREFIX_RE.match(prefix):
            raise ValueError(f"prefix {prefix!r} must match {_PREFIX_RE.pattern}")
        self.hosts = hosts
        self.rate_bps = parse_rate(bandwidth)
        self.latency_s = parse_time(latency)
        avail = sorted(os.sched_getaffinity(0))
        self.cpus = list(cpus) if cpus else avail
        self.prefix = prefix
        self.subnet = subnet
        self.require_latency = require_latency
        self.id = f"{prefix}-{os.getpid()}-{next(_counter)}"
        self.bridge_ns = f"{self.id}-br"
        self.namespaces = [f"{self.id}-h{i}" for i in range(hosts)]
        self.latency_emulated = False
        self._procs: list[subprocess.Popen] = []
        self._started = False
        self._old_sigterm: Any = None

    # ---- lifecycle -------------------------------------------------------------------------
    def __enter__(self) -> "EmulatedCluster":
        self.start()
        atexit.register(self.close)
        if threading.current_thread() is threading.main_thread() and \
                signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            # SIGTERM's default action skips __exit__; turn it into SystemExit so teardown runs.
            self._old_sigterm = signal.signal(signal.SIGTERM, _raise_system_exit)
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.close(raise_errors=exc[0] is None)
        finally:
            atexit.unregister(self.close)
            if self._old_sigterm is not None:
                signal.signal(signal.SIGTERM, self._old_sigterm)
                self._old_sigterm = None

    def start(self) -> "EmulatedCluster":
        """Create namespaces, bridge, veth pairs, addresses and qdiscs; on any failure undo all."""
        stale = _matching(self.prefix).get(self.id)
        if stale:  # our pid was reused after a crashed run: those are certainly dead leftovers
            log.warning("removing stale namespaces %s", stale)
            _delete_namespaces(stale)
        self._started = True
        try:
            self._build()
        except BaseException:
            self.close(raise_errors=False)
            raise
        log.info("cluster %s up: %d hosts, %s bit/s, latency %s s (emulated: %s)", self.id,
                 self.hosts, self.rate_bps, self.latency_s, self.latency_emulated)
        return self

    def _build(self) -> None:
        br = self.bridge_ns
        _sh(["ip", "netns", "add", br])
        _sh(["ip", "-n", br, "link", "set", "lo", "up"])
        _sh(["ip", "-n", br, "link", "add", "br0", "type", "bridge", "stp_state", "0", "forward_delay", "0"])
        _sh(["ip", "-n", br, "link", "set", "br0", "up"])
        _disable_ipv6(br)
        netem = self.latency_s > 0 and self._netem_available()
        self.latency_emulated = netem or self.latency_s == 0
        if self.latency_s > 0 and not netem:
            msg = ("this kernel has no sch_netem (CONFIG_NET_SCH_NETEM); shaping bandwidth only, "
                   f"latency {self.latency_s * 1e3:g} ms is NOT emulated")
            if self.require_latency:
                raise ClusterError(msg)
            log.warning(msg)
        for i, ns in enumerate(self.namespaces):
            port = f"v{i}"
            _sh(["ip", "netns", "add", ns])
            _disable_ipv6(ns)
            _sh(["ip", "-n", br, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns])
            _sh(["ip", "-n", br, "link", "set", port, "master", "br0", "up"])
            _sh(["ip", "-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", "eth0"])
            _sh(["ip", "-n", ns, "link", "set", "eth0", "up"])
            _sh(["ip", "-n", ns, "link", "set", "lo", "up"])
            self._shape(ns, "eth0", netem)   # host upload
            self._shape(br, port, netem)     # host download (bridge -> host)

    def _netem_available(self) -> bool:
        """Probe netem on the bridge namespace's loopback (ours, so nothing shared is touched)."""
        ok = _sh(["tc", "-n", self.bridge_ns, "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"],
                 check=False).returncode == 0
        if ok:
            _sh(["tc", "-n", self.bridge_ns, "qdisc", "del", "dev", "lo", "root"], check=False)
        return ok

    def _shape(self, ns: str, dev: str, netem: bool) -> None:
        """HTB at the link rate with two leaves: small packets (IP length < 128: pure ACKs, control
        messages) first, bulk second; plus a netem delay of latency/2 under each leaf when the
        kernel has netem.

        Why two leaves: with one FIFO, the ACKs of B->A's flow wait behind A->B's bulk data in A's
        egress queue, and a full-duplex pair of transfers (forward activations and backward
        gradients at once, the pipeline's normal case) loses up to half its throughput to that
        artefact.  Real hosts run fq_codel, which serves sparse flows first; this kernel has neither
        fq_codel nor sfq/prio, so HTB's class priority plus a u32 length match emulates it.
        Why HTB rather than TBF: HTB accounts veth's GSO super-packets by their real length without
        TBF's segmenting/burst-size pitfalls, takes netem children cleanly, and has priorities.
        """
        tc = ["tc", "-n", ns]
        rate, half = f"{self.rate_bps}bit", f"{max(1, self.rate_bps // 2)}bit"
        _sh([*tc, "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "20"])
        _sh([*tc, "class", "add", "dev", dev, "parent", "1:", "classid", "1:1", "htb",
             "rate", rate, "ceil", rate, "quantum", "1514"])
        for leaf, prio in ((10, 0), (20, 1)):
            _sh([*tc, "class", "add", "dev", dev, "parent", "1:1", "classid", f"1:{leaf}", "htb",
                 "rate", half, "ceil", rate, "prio", str(prio), "quantum", "1514"])
            if netem:
                delay_us = max(1, round(self.latency_s / 2 * 1e6))
                _sh([*tc, "qdisc", "add", "dev", dev, "parent", f"1:{leaf}", "handle", f"{leaf}:",
                     "netem", "delay", f"{delay_us}us", "limit", "10000"])
        # IPv4 total length (header offset 2) < 128 -> the priority leaf.
        _sh([*tc, "filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio", "1", "u32",
             "match", "u16", "0x0000", "0xff80", "at", "2", "flowid", "1:10"])

    def close(self, raise_errors: bool = False) -> None:
        """Kill every process started in or running inside the cluster, delete all namespaces."""
        if not self._started:
            return
        self._started = False
        for p in self._procs:
            _kill_popen(p)
        failed = _delete_namespaces([*self.namespaces, self.bridge_ns])
        for p in self._procs:  # reap, so no zombies of ours remain
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                log.warning("pid %d did not exit after SIGKILL", p.pid)
        self._procs.clear()
        log.info("cluster %s torn down", self.id)
        if failed:
            msg = f"teardown of {self.id} left namespaces {failed}; run `python -m tools.cluster cleanup`"
            log.error(msg)
            if raise_errors:
                raise ClusterError(msg)

    # ---- using the hosts -------------------------------------------------------------------
    def address(self, host: int) -> str:
        """The IPv4 address of ``host`` (``<subnet>.<host+1>``), reachable only inside the
        cluster."""
        if not 0 <= host < self.hosts:
            raise IndexError(f"host {host} not in 0..{self.hosts - 1}")
        return f"{self.subnet}.{host + 1}"

    def cpu(self, host: int) -> int:
        """The CPU core ``host`` is pinned to."""
        return self.cpus[host % len(self.cpus)]

    def run(self, host: int, argv: Sequence[str], env: Mapping[str, str] | None = None,
            cpu: int | None = None, **popen_kwargs: Any) -> subprocess.Popen:
        """Start ``argv`` inside ``host``'s namespace pinned to its CPU (or ``cpu``).

        ``env`` is added to this process's environment (not a replacement, so PATH etc. survive).
        The process gets its own session, and is killed (with everything else in the namespace)
        when the cluster closes.
        """
        if not self._started:
            raise ClusterError("cluster is not started")
        full_env = {**os.environ, **(env or {})}
        argv_ns = netns_argv(self.namespaces[host], argv, self.cpu(host) if cpu is None else cpu)
        proc = subprocess.Popen(argv_ns, env=full_env, start_new_session=True, **popen_kwargs)
        self._procs.append(proc)
        return proc

    def link_bytes(self, host: int) -> dict[str, int]:
        """Bytes/packets sent and received on ``host``'s ``eth0``: wire traffic, for per-sample
        traffic measurement (only cluster traffic crosses it; IPv6 chatter is disabled)."""
        out = _sh(["ip", "-j", "-s", "-n", self.namespaces[host], "link", "show", "eth0"]).stdout
        stats = json.loads(out)[0]["stats64"]
        return {"tx_bytes": stats["tx"]["bytes"], "rx_bytes": stats["rx"]["bytes"],
                "tx_packets": stats["tx"]["packets"], "rx_packets": stats["rx"]["packets"]}

    def __repr__(self) -> str:
        return (f"EmulatedCluster(id={self.id!r}, hosts={self.hosts}, rate={self.rate_bps} bit/s, "
                f"latency={self.latency_s} s, latency_emulated={self.latency_emulated})")


def _disable_ipv6(ns: str) -> None:
    """Silence IPv6 router solicitations/DAD so interface byte counters hold only our traffic."""
    _sh(["ip", "netns", "exec", ns, "sysctl", "-q", "-w", "net.ipv6.conf.all.disable_ipv6=1",
         "net.ipv6.conf.default.disable_ipv6=1"], check=False)


def _kill_popen(p: subprocess.Popen) -> None:
    """SIGKILL a process's whole session (it was started with start_new_session)."""
    if p.poll() is not None:
        return
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        try:
            p.kill()
        except ProcessLookupError:
            pass


def _raise_system_exit(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)
