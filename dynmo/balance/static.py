"""The static baselines: `uniform` (Megatron-LM) and `deepspeed` (DeepSpeed's partition_balanced).

Both ignore worker speeds, transfer costs and memory caps, as the originals do; the result
is still checked against the memory caps (an over-full stage is an error, not a result).
"""

from __future__ import annotations

import numpy as np

from dynmo.layout import Layout

from .problem import BalanceError, Problem

# The DP below reads up to i candidates for each of its ~layers x stages cells: its time grows
# with layers^2 x stages (10^9 takes 10-20 s on a 2-core machine; 1,000 x 1,000 and 31,622 x 1
# are at the limit) and its tables with layers x stages. Larger problems are refused, not started.
DEEPSPEED_MAX_WORK = 10**9


def check_deepspeed_size(layers: int, stages: int) -> None:
    """BalanceError when layers^2 x stages exceeds DEEPSPEED_MAX_WORK."""
    work = layers * layers * stages
    if work > DEEPSPEED_MAX_WORK:
        raise BalanceError(
            f"balancer 'deepspeed' on {layers} layers x {stages} stages needs layers^2 x stages = {work:.3g} "
            f"steps, over the limit DEEPSPEED_MAX_WORK = {DEEPSPEED_MAX_WORK:.0e}; use balancer 'optimal' "
            "(exact and near-linear) or fewer layers"
        )


def uniform(problem: Problem) -> list[int]:
    """Equal numbers of layers per stage; the first n % p stages get one more. O(p)."""
    return list(Layout.uniform(problem.num_layers, problem.stages).boundaries)


def deepspeed(problem: Problem) -> list[int]:
    """DeepSpeed's `partition_balanced(weights, num_parts)` semantics, fed with our costs.

    DeepSpeed (deepspeed/runtime/utils.py, current versions) runs a dynamic program over
    (items i, parts j) that keeps, for every prefix and part count, ONE predecessor: the one
    whose partial layout has the smallest max - min part weight (ties: the later split).
    It therefore minimizes the spread of part weights greedily per prefix, not the
    bottleneck, and is not exact even for the spread. Older versions bisected on the
    bottleneck with a probe; we reproduce the current semantics. O(n^2 p) time, vectorized
    over the split point per (i, j): slow beyond a few thousand layers.
    """
    w = problem.c
    n, p = len(w), problem.stages
    check_deepspeed_size(n, p)
    pre = np.concatenate(([0.0], np.cumsum(w)))
    inf = np.inf
    dmax = np.full((n + 1, p + 1), inf)
    dmin = np.full((n + 1, p + 1), inf)
    dcost = np.full((n + 1, p + 1), inf)
    pos = np.zeros((n + 1, p + 1), dtype=np.int64)
    dmax[0, 0] = 0.0
    dcost[0, 0] = 0.0
    for j in range(1, p + 1):
        # every i at once: candidates k in [0, i) for cell (i, j)
        for i in range(j, n + 1):
            k = np.arange(i)
            seg = pre[i] - pre[k]
            mx = np.maximum(dmax[k, j - 1], seg)
            mn = np.minimum(dmin[k, j - 1], seg)
            cost = mx - mn
            # DeepSpeed updates on `>=` while k ascends: the LAST k of minimal cost wins
            best = i - 1 - int(np.argmin(cost[::-1]))
            dcost[i, j] = cost[best]
            dmax[i, j] = mx[best]
            dmin[i, j] = mn[best]
            pos[i, j] = best
    parts = [n]
    for j in range(p, 0, -1):
        parts.append(int(pos[parts[-1], j]))
    parts.reverse()
    return parts
