"""fxpipe.costmodel: what each node of a traced graph costs, and the :class:`Profile` of it.

``profile_graph`` measures this machine, ``estimate_graph`` models hardware we do not have (FLOPs
and bytes on a roofline), ``annotate_parameters`` decides which node owns which parameter, and
``to_profile`` turns the annotated graph into the torch-free Profile the partitioner consumes.
"""
from __future__ import annotations

from .estimator import estimate_graph
from .extract import annotate_parameters, to_profile
from .hardware import DEVICES, Cluster, DeviceSpec, get_device
from .profile import Profile, ProfileNode
from .profiler import profile_graph

__all__ = ["profile_graph", "estimate_graph", "annotate_parameters", "to_profile", "Profile",
           "ProfileNode", "Cluster", "DeviceSpec", "DEVICES", "get_device"]
