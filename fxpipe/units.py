"""Parsing of human quantities: bandwidths and memory sizes (a shared leaf module).

Internally fxpipe works in SI base units: seconds, bytes and bytes per second.
"""
from __future__ import annotations

import re

from fxpipe.errors import ConfigError

_NUM = r"\s*([-+]?[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*"

# bandwidth suffixes -> bytes per second. Lower-case 'b' means bits, upper-case 'B' bytes.
_BANDWIDTH = {
    "bps": 1 / 8, "kbps": 1e3 / 8, "mbps": 1e6 / 8, "gbps": 1e9 / 8, "tbps": 1e12 / 8,
    "kbit/s": 1e3 / 8, "mbit/s": 1e6 / 8, "gbit/s": 1e9 / 8,
    "B/s": 1.0, "KB/s": 1e3, "MB/s": 1e6, "GB/s": 1e9, "TB/s": 1e12,
    "KiB/s": 2**10, "MiB/s": 2**20, "GiB/s": 2**30,
}
_MEMORY = {
    "B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12,
    "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40,
}


def parse_bandwidth(value: str | float | int, what: str = "bandwidth") -> float:
    """Return bytes/second. Numbers are taken as bytes/second; strings like '10Gbps', '25 Gbit/s',
    '1.5GB/s', '40Mbps'. Zero, negative and unparsable values raise ConfigError."""
    if isinstance(value, bool):
        raise ConfigError(f"{what} must be a number or a string like '10Gbps', got {value!r}")
    if isinstance(value, (int, float)):
        out = float(value)
    elif isinstance(value, str):
        m = re.fullmatch(_NUM + r"([A-Za-z/]+)\s*", value)
        if not m:
            raise ConfigError(f"cannot parse {what} {value!r}",
                              "write it like '10Gbps', '25Gbit/s', '1.25GB/s' or a number of bytes/s")
        unit = m.group(2)
        scale = _BANDWIDTH.get(unit)
        if scale is None:  # case-insensitive for the unambiguous bit units
            scale = _BANDWIDTH.get(unit.lower()) if unit.lower().endswith(("bps", "bit/s")) else None
        if scale is None:
            raise ConfigError(f"unknown {what} unit {unit!r} in {value!r}",
                              f"use one of {', '.join(sorted(_BANDWIDTH))}")
        out = float(m.group(1)) * scale
    else:
        raise ConfigError(f"{what} must be a number or a string like '10Gbps', got {type(value).__name__}")
    if not out > 0 or out == float("inf"):
        raise ConfigError(f"{what} must be positive and finite, got {value!r}",
                          "give the link speed, e.g. bandwidth='10Gbps'")
    return out


def parse_memory(value: str | float | int, what: str = "memory") -> float:
    """Return bytes. Numbers are bytes; strings like '16GB', '80GiB', '512MB'."""
    if isinstance(value, bool):
        raise ConfigError(f"{what} must be a number or a string like '16GB', got {value!r}")
    if isinstance(value, (int, float)):
        out = float(value)
    elif isinstance(value, str):
        m = re.fullmatch(_NUM + r"([A-Za-z]+)\s*", value)
        if not m or m.group(2) not in _MEMORY:
            raise ConfigError(f"cannot parse {what} {value!r}",
                              f"write it like '16GB' or '80GiB' (units: {', '.join(_MEMORY)})")
        out = float(m.group(1)) * _MEMORY[m.group(2)]
    else:
        raise ConfigError(f"{what} must be a number or a string like '16GB', got {type(value).__name__}")
    if not out > 0 or out == float("inf"):
        raise ConfigError(f"{what} must be positive and finite, got {value!r}",
                          "give the device memory, e.g. memory='16GB'")
    return out


def format_bytes(n: float) -> str:
    """'1.5 GB'-style rendering for tables."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"


def format_seconds(s: float) -> str:
    """'12.3 ms'-style rendering for tables."""
    if s == float("inf"):
        return "inf"
    if abs(s) >= 1:
        return f"{s:.3g} s"
    if abs(s) >= 1e-3:
        return f"{s * 1e3:.3g} ms"
    return f"{s * 1e6:.3g} us"
