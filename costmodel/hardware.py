"""Hardware descriptions: a small device table and the :class:`Cluster` a plan is made for.

The device table lets fxpipe plan for hardware we do not have (estimating node times from FLOPs
and bytes); ``device=None`` means "this machine": node times are measured by profiling.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from fxpipe.errors import ConfigError
from fxpipe.units import parse_bandwidth, parse_memory

DEFAULT_BANDWIDTH = "10Gbps"  # PipeDream's commodity-cluster setting


@dataclass(frozen=True)
class DeviceSpec:
    """Peak numbers for the analytical estimator. ``efficiency`` is the fraction of peak a
    typical training kernel reaches (roofline with a derating factor).

    Peaks are dense (no structured sparsity), per arithmetic: ``flops`` is float32 on the plain
    cores, which is where torch runs a float32 matrix product unless told otherwise
    (``torch.get_float32_matmul_precision()`` is ``"highest"`` by default); ``tf32_flops`` is
    float32 on tensor cores (cuDNN's convolutions by default, matrix products once the
    precision is ``"high"``); ``bf16_flops`` and ``fp16_flops`` the half types. ``None``: no
    such units, the plain cores' ``flops`` (a V100 has no TF32 and no bf16 tensor cores).

    Why per arithmetic: one H200 measured (benchmarks/one-gpu-check.md) ran a float32 GPT's
    training step in 21.5 ms where a single TF32 figure for every product estimated 8.3 ms.
    """

    name: str
    flops: float            # peak dense FLOP/s of float32 on the plain cores
    mem_bandwidth: float    # device memory bytes/s
    memory: float           # bytes of device memory
    efficiency: float = 0.5
    launch_overhead_s: float = 5e-6  # per-kernel fixed cost
    tf32_flops: float | None = None  # float32 on tensor cores, where torch allows it
    bf16_flops: float | None = None
    fp16_flops: float | None = None

    def peak_flops(self, dtype: str, *, tf32: bool = False) -> float:
        """Peak FLOP/s for products whose operands are ``dtype`` (``"float32"``,
        ``"bfloat16"``, ``"float16"``; anything else is priced as float32); ``tf32``: float32
        may run on tensor cores (torch's setting for this kind of product)."""
        peak = {"bfloat16": self.bf16_flops, "float16": self.fp16_flops}.get(
            dtype, self.tf32_flops if tf32 else None)
        return peak or self.flops


# Dense datasheet peaks of the SXM parts (NVIDIA): fp32, TF32, bf16, fp16 tensor.
DEVICES: dict[str, DeviceSpec] = {
    "cpu": DeviceSpec("cpu", flops=1.0e11, mem_bandwidth=2.0e10, memory=16e9, efficiency=0.5,
                      launch_overhead_s=2e-6),
    "v100": DeviceSpec("V100", flops=15.7e12, mem_bandwidth=900e9, memory=16e9,
                       fp16_flops=125e12),
    "a100": DeviceSpec("A100", flops=19.5e12, mem_bandwidth=1555e9, memory=40e9,
                       tf32_flops=156e12, bf16_flops=312e12, fp16_flops=312e12),
    "h100": DeviceSpec("H100", flops=67e12, mem_bandwidth=3350e9, memory=80e9,
                       tf32_flops=494.7e12, bf16_flops=989.4e12, fp16_flops=989.4e12),
    "h200": DeviceSpec("H200", flops=67e12, mem_bandwidth=4800e9, memory=141e9,
                       tf32_flops=494.7e12, bf16_flops=989.4e12, fp16_flops=989.4e12),
}


def get_device(name: str) -> DeviceSpec:
    """Look a device up by name, case-insensitively."""
    spec = DEVICES.get(str(name).lower())
    if spec is None:
        raise ConfigError(f"unknown device {name!r}",
                          f"known devices: {', '.join(d.name for d in DEVICES.values())}; "
                          "or leave device unset to profile this machine")
    return spec


@dataclass(frozen=True, init=False)
class Cluster:
    """Workers, their links and their memory.

    ``Cluster(workers=8)`` is a single-level cluster of this machine's device at 10 Gbps.
    ``workers_per_machine=4, intra_bandwidth="300GB/s"`` makes it two-level: ``bandwidth`` is then
    the network between machines and ``intra_bandwidth`` the link inside one.
    """

    workers: int
    bandwidth: float            # bytes/s between machines
    device: str | None          # None: this machine, measured by profiling
    memory: float | None        # bytes per worker; None: unlimited (or the device's memory)
    workers_per_machine: int
    intra_bandwidth: float      # bytes/s inside a machine (== bandwidth when single-level)
    latency: float              # seconds per message

    def __init__(self, workers: int, bandwidth: str | float = DEFAULT_BANDWIDTH,
                 device: str | None = None, memory: str | float | None = None,
                 workers_per_machine: int = 1, intra_bandwidth: str | float | None = None,
                 latency: float = 0.0) -> None:
        if isinstance(workers, bool) or not isinstance(workers, int) or workers <= 0:
            raise ConfigError(f"workers must be a positive integer, got {workers!r}",
                              "e.g. fxpipe.Cluster(workers=8)")
        if (isinstance(workers_per_machine, bool) or not isinstance(workers_per_machine, int)
                or workers_per_machine <= 0 or workers % workers_per_machine):
            raise ConfigError(f"workers_per_machine must be a positive divisor of workers={workers}, "
                              f"got {workers_per_machine!r}")
        bw = parse_bandwidth(bandwidth)
        if device is not None:
            dev = get_device(device)
            device = dev.name
            mem = parse_memory(memory) if memory is not None else dev.memory
        else:
            mem = parse_memory(memory) if memory is not None else None
        intra = parse_bandwidth(intra_bandwidth, "intra_bandwidth") if intra_bandwidth is not None else bw
        if not (isinstance(latency, (int, float)) and latency >= 0):
            raise ConfigError(f"latency must be a non-negative number of seconds, got {latency!r}")
        for k, v in dict(workers=workers, bandwidth=bw, device=device, memory=mem,
                         workers_per_machine=workers_per_machine, intra_bandwidth=intra,
                         latency=float(latency)).items():
            object.__setattr__(self, k, v)

    @property
    def machines(self) -> int:
        return self.workers // self.workers_per_machine

    @property
    def hierarchical(self) -> bool:
        return self.workers_per_machine > 1 and self.machines > 1

    @classmethod
    def from_env(cls, **kwargs: object) -> Cluster:
        """Cluster of the current torchrun job: WORLD_SIZE workers, LOCAL_WORLD_SIZE per machine."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        local = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
        kwargs.setdefault("workers_per_machine", local if world % local == 0 else 1)
        return cls(workers=world, **kwargs)  # type: ignore[arg-type]

    def to_dict(self) -> dict[str, object]:
        return dict(workers=self.workers, bandwidth=self.bandwidth, device=self.device,
                    memory=self.memory, workers_per_machine=self.workers_per_machine,
                    intra_bandwidth=self.intra_bandwidth, latency=self.latency)

    @classmethod
    def from_dict(cls, d: dict[str, object]) -> Cluster:
        return cls(**d)  # type: ignore[arg-type]
