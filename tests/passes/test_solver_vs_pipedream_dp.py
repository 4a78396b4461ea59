"""The fast solver against PipeDream's own O(N^2 M^2) dynamic program, on PipeDream's real GPU
profiles (shipped in fxpipe/models/pipedream_profiles, MIT). ``fxpipe.passes.reference_dp`` writes the cost
model out again from its definitions (it imports neither ``partition``'s coefficients nor
``cut_bytes``), so the same optimum means both read the definitions the same way, on one-level and
two-level clusters, fast and slow networks."""
from __future__ import annotations


import pytest

from fxpipe.costmodel import Cluster, Profile
from fxpipe.passes import partition
from fxpipe.passes.reference_dp import pipedream_dp
from fxpipe.models import pipedream

PROFILES = pipedream.PROFILES  # PipeDream's published profiles, shipped (MIT)
CLUSTERS = {
    "4x10Gbps": dict(workers=4, bandwidth="10Gbps"),
    "8x10Gbps": dict(workers=8, bandwidth="10Gbps"),
    "16x1Gbps": dict(workers=16, bandwidth="1Gbps"),
    # two machines of 4: replicas inside a machine sync over 100 GB/s, up to r = 4 included
    "2x4-two-level": dict(workers=8, workers_per_machine=4, bandwidth="10Gbps",
                          intra_bandwidth="100GB/s"),
    "1x4-one-machine": dict(workers=4, workers_per_machine=4, bandwidth="1Gbps",
                            intra_bandwidth="10GB/s"),
}


@pytest.mark.parametrize("model", ["alexnet", "vgg16", "gnmt", "squeezenet1_0"])
@pytest.mark.parametrize("cluster", sorted(CLUSTERS))
@pytest.mark.parametrize("sync", ["allreduce", "parameter-server"])
def test_same_optimum_as_pipedream_dp(model: str, cluster: str, sync: str) -> None:
    profile = Profile.from_pipedream(PROFILES / model / "graph.txt")
    c = Cluster(**CLUSTERS[cluster])
    plan = partition(profile, c, sync=sync)
    assert plan.time_per_minibatch == pytest.approx(pipedream_dp(profile, c, sync), rel=1e-9)


def test_the_dp_on_a_hand_priced_profile() -> None:
    """The oracle itself on numbers worked out by hand: a -> b -> c, with a skip a -> c, so the cut
    before c carries a and b (100 + 10 bytes) and the cut before b carries a (100 bytes). 4
    workers, 1000 B/s, ring all-reduce. Compute 4, 2, 2 s; parameters 0, 0, 300 bytes.
    [a on 2 | b, c on 1]: max(4/2, 4, cut 2 * 100 / 1000 = 0.2) = 4. [a, b on 3 | c on 1]:
    max(6/3, 2, cut 2 * 110 / 1000 = 0.22) = 2. Data parallel on 4: (8 + 2 (3/4) 300 / 1000) / 4
    = 2.1125. [a on 2 | b on 1 | c on 1]: max(2, 2, 2, 0.2, 0.2) = 2. Best: 2."""
    from fxpipe.costmodel.profile import ProfileNode

    def node(name: str, c: float, p: float, a: float, ins: tuple[str, ...]) -> ProfileNode:
        return ProfileNode(name=name, op="call_module", target=name, forward_s=c, backward_s=0.0,
                           activation_bytes=a, parameter_bytes=p, inputs=ins)

    prof = Profile(nodes=(node("a", 4.0, 0.0, 100.0, ()), node("b", 2.0, 0.0, 10.0, ("a",)),
                          node("c", 2.0, 300.0, 1.0, ("a", "b"))))
    assert pipedream_dp(prof, Cluster(workers=4, bandwidth=1000.0)) == 2.0
    # on 2 workers: [a | b, c] = max(4, 4, 0.2) = 4; [a, b | c] = max(6, 2, 0.22) = 6;
    # data parallel (8 + 2 (1/2) 300 / 1000) / 2 = 4.15: best 4
    assert pipedream_dp(prof, Cluster(workers=2, bandwidth=1000.0)) == 4.0
    # one worker: everything on it, 8 s
    assert pipedream_dp(prof, Cluster(workers=1, bandwidth=1000.0), "parameter-server") == 8.0
    # a cut right after the first node can be the bottleneck: u (1 s, 1000 bytes out) | w (1 s,
    # 10^4 parameter bytes) on 2 workers at 1000 B/s: max(1, 1, 2 * 1000 / 1000) = 2 s, against
    # data parallelism (2 + 2 (1/2) 10^4 / 1000) / 2 = 6 s
    two = Profile(nodes=(node("u", 1.0, 0.0, 1000.0, ()), node("w", 1.0, 1e4, 1.0, ("u",))))
    assert pipedream_dp(two, Cluster(workers=2, bandwidth=1000.0)) == 2.0
