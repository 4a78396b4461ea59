"""Parsing of human quantities: bandwidths and memory sizes (a shared leaf module).

Internally fxpipe works in SI base units: seconds, bytes and bytes per second.
"""
from __future__ import annotations

import re
from typing import Callable

from fxpipe.errors import ConfigError

_NUM = r"\s*([-+]?[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*"

# bandwidth suffixes -> bytes per second. Lower-case 'b' means bits, upper-case 'B' bytes.
# ``tc``'s own spellings parse too (``50Mbit``, ``1gbit``, ``100kbit``, ``10mibit``, ``1GBps``),
# case-insensitively for the bit units. One deliberate difference from tc: ``bps``/``mbps``/
# ``gbps`` in lower case are BITS per second here (the network convention, and what
# tools.cluster hands tc as ``<n>bit``), where tc would read them as bytes; capital-B
# ``KBps``/``MBps``/``GBps`` are bytes per second, as in tc.
_BITS = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12,
         "ki": 2.0**10, "mi": 2.0**20, "gi": 2.0**30, "ti": 2.0**40}
_BANDWIDTH = {
    **{f"{p}bps": v / 8 for p, v in _BITS.items() if "i" not in p},
    **{f"{p}bit": v / 8 for p, v in _BITS.items()},
    **{f"{p}bit/s": v / 8 for p, v in _BITS.items()},
    "B/s": 1.0, "KB/s": 1e3, "MB/s": 1e6, "GB/s": 1e9, "TB/s": 1e12,
    "KiB/s": 2**10, "MiB/s": 2**20, "GiB/s": 2**30,
    "Bps": 1.0, "KBps": 1e3, "MBps": 1e6, "GBps": 1e9, "TBps": 1e12,
    "KiBps": 2**10, "MiBps": 2**20, "GiBps": 2**30,
}
_MEMORY = {
    "B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12,
    "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40,
}


def _parse_quantity(value: str | float | int, what: str, units: dict[str, float],
                    example: str, unit_of: Callable[[str], float | None]) -> float:
    """Shared parser: numbers are taken in base units, strings are '<number><unit>'; the result
    must be positive and finite, else ConfigError naming the value and an example."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ConfigError(f"{what} must be a number or a string like {example!r}, got {value!r}")
    if isinstance(value, str):
        m = re.fullmatch(_NUM + r"([A-Za-z/]+)\s*", value)
        if not m:
            raise ConfigError(f"cannot parse {what} {value!r}", f"write it like {example!r}")
        scale = unit_of(m.group(2))
        if scale is None:
            raise ConfigError(f"unknown {what} unit {m.group(2)!r} in {value!r}",
                              f"use one of {', '.join(units)}")
        out = float(m.group(1)) * scale
    else:
        out = float(value)
    if not out > 0 or out == float("inf"):
        raise ConfigError(f"{what} must be positive and finite, got {value!r}",
                          f"e.g. {what}={example!r}")
    return out


def _bandwidth_unit(unit: str) -> float | None:
    scale = _BANDWIDTH.get(unit)
    if scale is None and unit.lower().endswith(("bps", "bit", "bit/s")):  # bits: any case
        scale = _BANDWIDTH.get(unit.lower())
    return scale


def parse_bandwidth(value: str | float | int, what: str = "bandwidth") -> float:
    """Return bytes/second. Numbers are taken as bytes/second; strings like '10Gbps', '25 Gbit/s',
    '1.5GB/s', '40Mbps', or tc's '50Mbit', '1gbit', '100kbit' (see ``_BANDWIDTH`` for the bits
    and bytes conventions). Zero, negative and unparsable values raise ConfigError."""
    return _parse_quantity(value, what, _BANDWIDTH, "10Gbps", _bandwidth_unit)


def parse_memory(value: str | float | int, what: str = "memory") -> float:
    """Return bytes. Numbers are bytes; strings like '16GB', '80GiB', '512MB'."""
    return _parse_quantity(value, what, _MEMORY, "16GB", _MEMORY.get)


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
