"""Measure what the shaped links really deliver: TCP goodput and round-trip time between two hosts.

Why: every conclusion drawn on the emulated cluster rests on the link being what we configured, so
the benchmark reports measured numbers next to configured ones rather than trusting tc.  The
probes are plain Python sockets run inside the namespaces (no iperf/ping on this machine).
"""
from __future__ import annotations

import json
import logging
import select
import subprocess
import sys
import threading
import time
from typing import Any

from .netns import EmulatedCluster, _kill_popen

log = logging.getLogger("tools.cluster")

# Headers per full 1448-byte TCP payload on the wire: Ethernet 14 + IPv4 20 + TCP with timestamps
# 32.
TCP_GOODPUT_FRACTION = 1448 / (1448 + 66)

_SINK = r"""
import json, socket, sys, time
addr, port, timeout = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((addr, port)); s.listen(1); s.settimeout(timeout)
print("READY", flush=True)
c, _ = s.accept(); c.settimeout(timeout)
first = c.recv(1 << 20); t0 = time.perf_counter(); n = 0
while True:
    b = c.recv(1 << 20)
    if not b: break
    n += len(b)
t1 = time.perf_counter(); c.sendall(b"k")
print(json.dumps({"bytes": n, "first": len(first), "seconds": t1 - t0}), flush=True)
"""

_SOURCE = r"""
import json, socket, sys, time
addr, port, nbytes, timeout = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
s = socket.create_connection((addr, port), timeout=timeout)
buf = b"x" * (1 << 16); t0 = time.perf_counter(); left = nbytes
while left > 0:
    left -= s.send(buf[:min(left, len(buf))])
s.shutdown(socket.SHUT_WR); s.recv(1)
print(json.dumps({"seconds": time.perf_counter() - t0}), flush=True)
"""

_ECHO = r"""
import socket, sys
addr, port, timeout = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((addr, port)); s.listen(1); s.settimeout(timeout)
print("READY", flush=True)
c, _ = s.accept(); c.settimeout(timeout); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
while True:
    b = c.recv(64)
    if not b: break
    c.sendall(b)
"""

_PING = r"""
import json, socket, statistics, sys, time
addr, port, n, timeout = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
t0 = time.perf_counter(); s = socket.create_connection((addr, port), timeout=timeout)
connect = time.perf_counter() - t0
s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
rtts = []
for _ in range(n):
    t = time.perf_counter(); s.sendall(b"p"); s.recv(64); rtts.append(time.perf_counter() - t)
s.close()
print(json.dumps({"connect": connect, "median": statistics.median(rtts), "min": min(rtts)}), flush=True)
"""


def _readline(proc: subprocess.Popen, timeout: float) -> str:
    """One line of a child's stdout, or ``TimeoutError`` (a bare readline could block forever)."""
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    if not ready:
        raise TimeoutError(f"no output from pid {proc.pid} within {timeout} s")
    return proc.stdout.readline().decode().strip()  # type: ignore[union-attr]


def _pair(cluster: EmulatedCluster, src: int, dst: int, server: str, client: str,
          client_args: list[Any], port: int, timeout: float) -> tuple[str, str]:
    """Start ``server`` on ``dst``, wait until it listens, run ``client`` on ``src``; their last
    lines."""
    addr = cluster.address(dst)
    srv = cluster.run(dst, [sys.executable, "-c", server, addr, port, timeout], stdout=subprocess.PIPE)
    cli = None
    try:
        if _readline(srv, timeout) != "READY":
            raise RuntimeError("probe server failed to start")
        cli = cluster.run(src, [sys.executable, "-c", client, addr, port, *client_args, timeout],
                          stdout=subprocess.PIPE)
        cli_out, _ = cli.communicate(timeout=timeout)
        srv_out, _ = srv.communicate(timeout=timeout)
        if cli.returncode or srv.returncode:
            raise RuntimeError(f"probe failed: client rc {cli.returncode}, server rc {srv.returncode}")
        return srv_out.decode().strip(), cli_out.decode().strip()
    finally:
        for p in (srv, cli):
            if p is not None:
                _kill_popen(p)
                p.wait(timeout=5)


def measure_bandwidth(cluster: EmulatedCluster, src: int = 0, dst: int = 1, nbytes: int = 2 << 20,
                      port: int = 5201, timeout: float = 30.0) -> dict[str, float]:
    """Send ``nbytes`` over one TCP connection; goodput in bit/s as seen by the receiver (from its
    first to its last byte, so connection setup and slow-start's first RTT don't count)."""
    srv, cli = _pair(cluster, src, dst, _SINK, _SOURCE, [nbytes], port, timeout)
    r = json.loads(srv.splitlines()[-1])
    goodput = r["bytes"] * 8 / r["seconds"]
    return {"goodput_bps": goodput, "bytes": r["bytes"] + r["first"], "seconds": r["seconds"],
            "sender_seconds": json.loads(cli.splitlines()[-1])["seconds"],
            "configured_bps": cluster.rate_bps,
            "expected_goodput_bps": cluster.rate_bps * TCP_GOODPUT_FRACTION}


def measure_rtt(cluster: EmulatedCluster, src: int = 0, dst: int = 1, n: int = 50,
                port: int = 5202, timeout: float = 30.0) -> dict[str, float]:
    """TCP connect time and 1-byte echo round trips (median and min, seconds) from src to dst."""
    _, cli = _pair(cluster, src, dst, _ECHO, _PING, [n], port, timeout)
    r = json.loads(cli.splitlines()[-1])
    r["configured_rtt"] = 2 * cluster.latency_s
    r["latency_emulated"] = cluster.latency_emulated
    return r


def measure_duplex(cluster: EmulatedCluster, a: int = 0, b: int = 1, nbytes: int = 2 << 20,
                   timeout: float = 30.0) -> dict[str, dict[str, float]]:
    """a->b and b->a at the same time (a pipeline sends activations and gradients at once): each
    direction should get the full rate, since links are full duplex and ACKs take the fast lane."""
    res: dict[str, dict[str, float]] = {}
    errors: list[BaseException] = []

    def one(src: int, dst: int, port: int) -> None:
        try:
            res[f"{src}->{dst}"] = measure_bandwidth(cluster, src, dst, nbytes, port=port, timeout=timeout)
        except BaseException as e:  # re-raised in the caller's thread
            errors.append(e)

    threads = [threading.Thread(target=one, args=(a, b, 5211)), threading.Thread(target=one, args=(b, a, 5212))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 10)
    if errors:
        raise errors[0]
    return res


def measure_link(cluster: EmulatedCluster, src: int = 0, dst: int = 1, nbytes: int = 2 << 20) -> dict[str, Any]:
    """Both probes, as one report dict (what ``python -m tools.cluster measure`` prints)."""
    t = time.perf_counter()
    out = {"bandwidth": measure_bandwidth(cluster, src, dst, nbytes),
           "duplex": measure_duplex(cluster, src, dst, nbytes), "rtt": measure_rtt(cluster, src, dst)}
    log.info("link probes took %.2f s", time.perf_counter() - t)
    return out
