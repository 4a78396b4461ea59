"""PipeDream's dynamic program, literally: the O(N^2 M^2) oracle for the fast solver's optimum.

``A(j, m) = min over i < j, r <= m of max(A(i, m - r), T(i..j, r), cut(i, r))`` on DESIGN.md's
cost model (no memory limit), written out anew: importing nothing it checks, it shares no bug.
"""
from __future__ import annotations

import math

from fxpipe.costmodel.hardware import Cluster
from fxpipe.costmodel.profile import Profile


def _live_bytes(profile: Profile) -> list[float]:
    """Bytes of the values produced before cut i and used at or after it (each once), for
    i = 1..N-1; inf where a value that cannot be sent is live."""
    nodes = profile.nodes
    where = {nd.name: i for i, nd in enumerate(nodes)}
    out = []
    for i in range(1, len(nodes)):
        live = {where[u] for nd in nodes[i:] for u in nd.inputs if where[u] < i}
        if any(not nodes[p].sendable for p in live):
            out.append(math.inf)
        else:
            out.append(sum(nodes[p].activation_bytes for p in live))
    return out


def pipedream_dp(profile: Profile, cluster: Cluster, sync: str = "allreduce") -> float:
    """The optimal time per minibatch by PipeDream's recurrence (slow: for checking only)."""
    n, workers = len(profile.nodes), cluster.workers
    one_machine = cluster.workers == cluster.workers_per_machine
    cut_bw = cluster.intra_bandwidth if one_machine else cluster.bandwidth
    k = 2.0 if sync == "allreduce" else 4.0  # ring all-reduce | PipeDream's parameter server
    live = _live_bytes(profile)

    def sync_bandwidth(r: int) -> float:
        """The link inside a machine while the r replicas fit in one, else the network."""
        return cluster.intra_bandwidth if one_machine or r <= cluster.workers_per_machine \
            else cluster.bandwidth

    def cut(i: int, r: int) -> float:
        """Activations forward and gradients back, into r replicas taking turns."""
        return 2.0 * live[i - 1] / (cut_bw * r) if i > 0 else 0.0

    best = [[math.inf] * (workers + 1) for _ in range(n + 1)]
    best[0] = [0.0] * (workers + 1)
    for j in range(1, n + 1):
        # C and P of every stage [i, j), summed node by node from j - 1 down to i
        comp, par = [0.0] * j, [0.0] * j
        c = p = 0.0
        for i in range(j - 1, -1, -1):
            c += profile.nodes[i].compute_s
            p += profile.nodes[i].parameter_bytes
            comp[i], par[i] = c, p
        for m in range(1, workers + 1):
            v = math.inf
            for i in range(j):
                for r in range(1, m + 1):
                    if i > 0 and m - r < 1:
                        break  # the stages before i need at least one worker
                    # (C + k (r-1)/r P / B) / r: r replicas share the minibatches, sync once a round
                    t = (comp[i] + k * (r - 1) / r * par[i] / sync_bandwidth(r)) / r
                    v = min(v, max(best[i][m - r], t, cut(i, r)))
            best[j][m] = v
    return best[n][workers]
