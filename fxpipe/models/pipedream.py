"""PipeDream's published per-layer GPU profiles, shipped with fxpipe: ``pipedream:<name>``.

They let anyone plan the paper's models for the paper's clusters without a GPU (MIT licensed:
``pipedream_profiles/LICENSE.txt``; format: its ``README.md``). :data:`PAPER` holds what the
paper reports for a model, so a plan can be read next to it.
"""
from __future__ import annotations

from pathlib import Path

from fxpipe.errors import ConfigError

PROFILES = Path(__file__).resolve().parent / "pipedream_profiles"
PREFIX = "pipedream:"

PAPER = {
    "vgg16": "PipeDream's paper (Harlap, Narayanan et al., 2018) reports VGG16 on 8 GPUs over "
             "10 Gbps up to 5x faster to a target accuracy than data parallelism, with up to "
             "95% less communication",
}
"""What the paper reports for a model (its headline, in its own terms: time to accuracy)."""


def names() -> list[str]:
    """The shipped profiles, by model name."""
    return sorted(p.name for p in PROFILES.iterdir() if (p / "graph.txt").is_file())


def profile_path(name: str) -> Path:
    """The ``graph.txt`` of ``name`` (``vgg16`` or ``pipedream:vgg16``)."""
    name = name.removeprefix(PREFIX)
    path = PROFILES / name / "graph.txt"
    if not path.is_file():
        raise ConfigError(f"no PipeDream profile named {name!r}",
                          f"use pipedream:<name> with one of {', '.join(names())}")
    return path
