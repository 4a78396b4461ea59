"""PipeDream's dynamic program, literally: the O(N^2 M^2) oracle for the fast solver.

    A(j, m) = min over i < j, r <= m of max(A(i, m - r), T(i..j, r), cut(i, r))

where A(j, m) is the best bottleneck covering nodes [0, j) with at most m workers, T the stage
time with r replicas and cut(i, r) the price of the cut before node i into r replicas. Same cost
model as :func:`fxpipe.passes.partition` (no memory limit), so its optimum must equal the plan's
``time_per_minibatch``; tests and ``bench/plan_speed.py`` compare the two.
"""
from __future__ import annotations

import math

from fxpipe.costmodel.hardware import Cluster
from fxpipe.costmodel.profile import Profile

from .cuts import cut_bytes
from .partition import coefficients


def pipedream_dp(profile: Profile, cluster: Cluster, sync: str = "allreduce") -> float:
    """The optimal time per minibatch by PipeDream's recurrence (slow: for checking only)."""
    alpha, beta, gamma = coefficients(cluster, sync)
    cuts = cut_bytes(profile)
    n, workers = len(profile), cluster.workers
    comp, par = [0.0], [0.0]
    for nd in profile.nodes:
        comp.append(comp[-1] + nd.compute_s)
        par.append(par[-1] + nd.parameter_bytes)
    best = [[math.inf] * (workers + 1) for _ in range(n + 1)]
    best[0] = [0.0] * (workers + 1)
    for j in range(1, n + 1):
        for m in range(1, workers + 1):
            v = math.inf
            for i in range(j):
                c, p = comp[j] - comp[i], par[j] - par[i]
                for r in range(1, m + 1):
                    if i > 0 and m - r < 1:
                        break  # the stages before i need at least one worker
                    cut = gamma[r - 1] * cuts[i - 1] if i > 0 else 0.0
                    v = min(v, max(best[i][m - r], alpha[r - 1] * c + beta[r - 1] * p, cut))
            best[j][m] = v
    return best[n][workers]
