"""Emulated commodity cluster on one machine (network namespaces + veth + bridge + tc).

Run from the repository root (it is a developer tool, not part of the installed package)::

    python -m tools.cluster --help

Library use::

    from tools.cluster import EmulatedCluster, torchrun_across, wait_all
    with EmulatedCluster(hosts=2, bandwidth="50Mbit", latency="0.5ms") as c:
        procs = torchrun_across(c, ["train.py", "--epochs", "1"])
        codes = wait_all(procs, timeout=600)
"""
from .launch import read_output, torchrun_across, torchrun_argv, wait_all
from .measure import measure_bandwidth, measure_duplex, measure_link, measure_rtt
from .netns import (ClusterError, EmulatedCluster, can_create_namespaces, cleanup, list_namespaces,
                    namespace_pids, parse_rate, parse_time)

__all__ = ["EmulatedCluster", "ClusterError", "cleanup", "can_create_namespaces", "list_namespaces",
           "namespace_pids", "parse_rate", "parse_time", "torchrun_across", "torchrun_argv",
           "wait_all", "read_output", "measure_bandwidth", "measure_duplex", "measure_rtt", "measure_link"]
