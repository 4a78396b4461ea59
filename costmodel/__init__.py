"""fxpipe.costmodel: what each node of a traced graph costs, and the :class:`Profile` of it.

``profile_graph`` measures this machine, ``estimate_graph`` models hardware we do not have (FLOPs
and bytes on a roofline), ``annotate_parameters`` decides which node owns which parameter, and
``to_profile`` turns the annotated graph into the torch-free Profile the partitioner consumes.

Exports are lazy (PEP 562): ``fxpipe.costmodel.profile`` and ``hardware`` are plain data that the
torch-free phases (``fxpipe.passes``, ``fxpipe.runtime.schedules``) read, so importing them must
not run the measuring modules, which import torch.
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
