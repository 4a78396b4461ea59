"""The fast solver against PipeDream's own O(N^2 M^2) dynamic program, on PipeDream's real GPU
profiles: the same cost model (coefficients, cut prices), a literal DP, the same optimum."""
from __future__ import annotations

from pathlib import Path

import pytest

from fxpipe.costmodel import Cluster, Profile
from fxpipe.passes import partition
from fxpipe.passes.reference_dp import pipedream_dp

PROFILES = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "pipedream-profiles"
pytestmark = pytest.mark.skipif(not PROFILES.is_dir(),
                                reason=f"PipeDream profiles not found at {PROFILES}")


@pytest.mark.parametrize("model", ["alexnet", "vgg16", "gnmt", "squeezenet1_0"])
@pytest.mark.parametrize("workers", [4, 8])
@pytest.mark.parametrize("sync", ["allreduce", "parameter-server"])
def test_same_optimum_as_pipedream_dp(model: str, workers: int, sync: str) -> None:
    profile = Profile.from_pipedream(PROFILES / model / "graph.txt")
    cluster = Cluster(workers=workers, bandwidth="10Gbps")
    plan = partition(profile, cluster, sync=sync)
    assert plan.time_per_minibatch == pytest.approx(pipedream_dp(profile, cluster, sync), rel=1e-9)
