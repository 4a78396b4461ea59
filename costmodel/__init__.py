"""fxpipe.costmodel: what each node of a traced graph costs, and the :class:`Profile` of it.

``profiler`` measures, scaled to whole steps by ``calibrate``; ``estimator`` models a device of
``hardware``; ``update``, ``saved`` and ``overheads`` price the step, what backward keeps and the
runtime; ``extract`` and ``pipedream`` make the ``profile``. Lazy exports: no torch on import.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "profile_graph": "profiler", "estimate_graph": "estimator",
    "annotate_parameters": "extract", "to_profile": "extract",
    "Profile": "profile", "ProfileNode": "profile",
    "Cluster": "hardware", "DeviceSpec": "hardware", "DEVICES": "hardware",
    "get_device": "hardware",
}
__all__ = ["profile_graph", "estimate_graph", "annotate_parameters", "to_profile", "Profile",
           "ProfileNode", "Cluster", "DeviceSpec", "DEVICES", "get_device"]

if TYPE_CHECKING:
    from .estimator import estimate_graph
    from .extract import annotate_parameters, to_profile
    from .hardware import DEVICES, Cluster, DeviceSpec, get_device
    from .profile import Profile, ProfileNode
    from .profiler import profile_graph


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
