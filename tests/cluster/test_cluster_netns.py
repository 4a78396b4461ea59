"""The emulated cluster: connectivity, shaping as configured, and nothing left behind on failure.

Needs network namespaces (root / CAP_NET_ADMIN and iproute2); skips with the reason otherwise.
"""
from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tools.cluster import (EmulatedCluster, can_create_namespaces, cleanup, list_namespaces,  # noqa: E402
                           measure_bandwidth, measure_duplex, measure_rtt, parse_rate, parse_time, wait_all)

_OK, _WHY = can_create_namespaces()
needs_netns = pytest.mark.skipif(not _OK, reason=f"emulated cluster unavailable: {_WHY}")
RATE = "50Mbit"


@pytest.fixture
def prefix() -> str:
    """A prefix no other run uses, so cleanup() in one test can't touch anyone else's cluster."""
    return "fxpt" + secrets.token_hex(4)


def _links() -> set[str]:
    """Interface names in the root namespace (our tool must never add any)."""
    out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, timeout=10).stdout
    return {line.split(":")[1].strip().split("@")[0] for line in out.splitlines()}


def _alive(pid: int) -> bool:
    """True if pid exists and is not a zombie."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return "\nState:\tZ" not in status


def _assert_nothing_left(prefix: str, links_before: set[str], pids: list[int]) -> None:
    assert [n for n in list_namespaces() if n.startswith(prefix + "-")] == []
    assert _links() - links_before == set(), "root namespace gained interfaces"
    # killed processes vanish once the kernel reaps them; the deadline only bounds the wait
    # (it asserts nothing about speed)
    deadline = time.monotonic() + 60
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [p for p in pids if _alive(p)] == []


def test_parse_units() -> None:
    assert parse_rate("50Mbit") == 50_000_000
    assert parse_rate("10Gbps") == 10_000_000_000
    assert parse_rate("100kbit") == 100_000
    assert parse_time("0.5ms") == pytest.approx(5e-4)
    assert parse_time("250us") == pytest.approx(2.5e-4)
    with pytest.raises(ValueError):
        parse_rate("fast")


@pytest.mark.multiprocess
@needs_netns
def test_connectivity_pinning_and_shaping(prefix: str) -> None:
    with EmulatedCluster(2, bandwidth=RATE, latency="0.5ms", cpus=[0, 1], prefix=prefix) as c:
        assert [c.address(0), c.address(1)] == ["10.123.45.1", "10.123.45.2"]
        p = c.run(1, ["sh", "-c", "taskset -pc $$; ip -o -4 addr show dev eth0"], stdout=subprocess.PIPE)
        out = p.communicate(timeout=10)[0].decode()
        assert "affinity list: 1" in out and "10.123.45.2/24" in out
        before = c.link_bytes(0)
        nbytes = 2 << 20
        for src, dst in ((0, 1), (1, 0)):  # both directions are shaped
            bw = measure_bandwidth(c, src, dst, nbytes=nbytes)
            assert bw["bytes"] == nbytes
            # goodput within 15% of the configured rate (it's ~4% under it: TCP/IP/Ethernet headers)
            assert abs(bw["goodput_bps"] - c.rate_bps) / c.rate_bps < 0.15, bw
            assert abs(bw["goodput_bps"] - bw["expected_goodput_bps"]) / bw["expected_goodput_bps"] < 0.15
        # full duplex: both directions at once each get the rate (ACKs don't queue behind bulk data)
        for direction, bw in measure_duplex(c, 0, 1, nbytes=nbytes).items():
            assert abs(bw["goodput_bps"] - c.rate_bps) / c.rate_bps < 0.15, (direction, bw)
        after = c.link_bytes(0)
        assert after["tx_bytes"] - before["tx_bytes"] >= 2 * nbytes  # interface counters see the traffic
        assert after["rx_bytes"] - before["rx_bytes"] >= 2 * nbytes


@pytest.mark.multiprocess
@needs_netns
def test_rtt_matches_latency(prefix: str) -> None:
    with EmulatedCluster(2, bandwidth=RATE, latency="0.5ms", prefix=prefix) as c:
        r = measure_rtt(c, 0, 1, n=30)
        if not c.latency_emulated:
            pytest.skip("kernel lacks sch_netem (CONFIG_NET_SCH_NETEM): latency is not emulated; "
                        f"measured unshaped RTT {r['median'] * 1e6:.0f} us")
        assert 0.9 * r["configured_rtt"] <= r["median"] <= 1.5 * r["configured_rtt"] + 3e-4, r


@pytest.mark.multiprocess
@needs_netns
def test_failed_body_leaves_nothing(prefix: str) -> None:
    links = _links()
    pids: list[int] = []
    with pytest.raises(RuntimeError, match="boom"):
        with EmulatedCluster(2, bandwidth=RATE, latency="0.5ms", prefix=prefix) as c:
            pids.append(c.run(0, ["sleep", "300"]).pid)
            # a daemonised grandchild in its own session, detached from anything we hold
            p = c.run(1, ["sh", "-c", "setsid sleep 300 >/dev/null 2>&1 & echo $!"], stdout=subprocess.PIPE)
            pids.append(int(p.communicate(timeout=10)[0]))
            assert all(_alive(x) for x in pids)
            raise RuntimeError("boom")
    _assert_nothing_left(prefix, links, pids)


@pytest.mark.multiprocess
@needs_netns
def test_hanging_child_leaves_nothing(prefix: str) -> None:
    links = _links()
    hang = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(300)"
    with pytest.raises(TimeoutError):
        with EmulatedCluster(2, bandwidth=RATE, latency="0.5ms", prefix=prefix) as c:
            procs = [c.run(h, [sys.executable, "-c", hang]) for h in range(2)]
            pids = [p.pid for p in procs]
            wait_all(procs, timeout=1.0)
    _assert_nothing_left(prefix, links, pids)


_CRASH = """
import os, signal, subprocess, sys
sys.path.insert(0, sys.argv[2])
from tools.cluster import EmulatedCluster
c = EmulatedCluster(2, prefix=sys.argv[1]).start()
p = c.run(0, ["sleep", "300"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
print(p.pid, flush=True)
os.kill(os.getpid(), signal.SIGKILL)   # crash: no teardown runs
"""


@pytest.mark.multiprocess
@needs_netns
def test_cleanup_removes_crashed_run(prefix: str) -> None:
    links = _links()
    crashed = subprocess.run([sys.executable, "-c", _CRASH, prefix, str(ROOT)], capture_output=True,
                             text=True, timeout=30)
    assert crashed.returncode == -signal.SIGKILL
    pid = int(crashed.stdout.split()[0])
    assert len([n for n in list_namespaces() if n.startswith(prefix + "-")]) == 3  # h0, h1, br
    cli = subprocess.run([sys.executable, "-m", "tools.cluster", "cleanup", "--prefix", prefix],
                         cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert cli.returncode == 0, cli.stderr
    _assert_nothing_left(prefix, links, [pid])
    assert cleanup(prefix) == []


_TERM = """
import subprocess, sys, time
sys.path.insert(0, sys.argv[2])
from tools.cluster import EmulatedCluster
with EmulatedCluster(2, prefix=sys.argv[1]) as c:
    print(c.run(1, ["sleep", "300"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).pid, flush=True)
    time.sleep(300)
"""


@pytest.mark.multiprocess
@needs_netns
def test_sigterm_tears_down(prefix: str) -> None:
    links = _links()
    p = subprocess.Popen([sys.executable, "-c", _TERM, prefix, str(ROOT)], stdout=subprocess.PIPE, text=True)
    try:
        import select
        assert select.select([p.stdout], [], [], 30)[0], "child never reported its pid"
        pid = int(p.stdout.readline())  # type: ignore[union-attr]
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=30) == 128 + signal.SIGTERM
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(timeout=10)
        cleanup(prefix)
    _assert_nothing_left(prefix, links, [pid])
