"""Bandwidth spellings: fxpipe's own and tc's (``tc qdisc ... rate 50Mbit``), by hand-computed
values in bytes per second."""
from __future__ import annotations

import pytest

from fxpipe.errors import ConfigError
from fxpipe.units import parse_bandwidth


@pytest.mark.parametrize("text, want", [
    ("50Mbit", 50e6 / 8), ("1gbit", 1e9 / 8), ("100kbit", 100e3 / 8), ("1GBIT", 1e9 / 8),
    ("20 mbit", 20e6 / 8), ("8bit", 1.0), ("2mibit", 2 * 2**20 / 8), ("1gibit", 2**30 / 8),
    ("1gbps", 1e9 / 8), ("10Gbps", 10e9 / 8), ("25 Gbit/s", 25e9 / 8), ("40Mbps", 40e6 / 8),
    ("1.5GB/s", 1.5e9), ("1GBps", 1e9), ("8 MBps", 8e6), ("1KiBps", 1024.0),
])
def test_bandwidth_spellings(text: str, want: float) -> None:
    assert parse_bandwidth(text) == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("text", ["50Mbyte", "fast", "-3Gbps", "0bit", "1 gbitz"])
def test_bad_bandwidths_are_config_errors(text: str) -> None:
    with pytest.raises(ConfigError):
        parse_bandwidth(text)
