"""Re-packing: put the layers on fewer workers and release the rest.

`firstfit` (paper, Algorithm 4). Walk worker pairs (src, dst > src); when src's and dst's
memory together fit dst's capacity and more than `target` workers are active, all of src's
layers go to dst and src is released. It looks at memory only, never at load, and merging
into a non-adjacent dst breaks contiguity (the result is then an assignment, not a layout).
The paper takes `target` as an input; by default we use the number of workers that the
`optimal` re-packing keeps, so both release the same count and their bottlenecks compare.

`optimal` (ours). The fewest workers k whose optimal bottleneck stays within
(1 + tolerance) x the optimal bottleneck on all p workers, under the memory caps. Which k
workers: the k fastest (ties: larger capacity, then lower index), kept in pipeline order,
so with identical workers it is simply the first k. With heterogeneous workers the choice of
subset is this rule, not a search over all subsets. For p <= 64 every k is tried (exact
"fewest k"); above that k is found by binary search, which assumes the optimal bottleneck
does not grow when a worker is added (true for identical workers without transfer costs).
The layout on the kept workers is the min-move optimal layout, moves counted per worker.
"""

from __future__ import annotations

import math

import numpy as np

from .optimal import bottleneck_and_tolerance, optimal_with
from .problem import BalanceError, Problem
from .result import Result, make_result


def _current_owner(problem: Problem) -> np.ndarray:
    return np.repeat(np.arange(problem.stages), np.diff(problem.current_layout.boundaries))


def _keep_order(problem: Problem) -> list[int]:
    return sorted(range(problem.stages), key=lambda w: (-problem.s[w], -problem.cap[w], w))


def _bottleneck(problem: Problem) -> float:
    try:
        return bottleneck_and_tolerance(problem)[0]
    except BalanceError:
        return math.inf


def repack_optimal(problem: Problem, tolerance: float = 0.05) -> Result:
    if not (tolerance >= 0 and math.isfinite(tolerance)):
        raise BalanceError(f"tolerance must be a finite number >= 0, got {tolerance!r}")
    p = problem.stages
    full, btol = bottleneck_and_tolerance(problem)  # raises when even p workers cannot fit
    limit = full * (1 + tolerance) + btol
    order = _keep_order(problem)

    def kept(k: int) -> list[int]:
        return sorted(order[:k])

    def ok(k: int) -> bool:
        return _bottleneck(problem.with_stages(kept(k))) <= limit

    if p <= 64:
        k = next(k for k in range(1, p + 1) if k == p or ok(k))
    else:
        lo, hi = 1, p  # ok(p) holds
        while lo < hi:
            mid = (lo + hi) // 2
            if ok(mid):
                hi = mid
            else:
                lo = mid + 1
        k = lo
    workers = kept(k)
    sub = problem.with_stages(workers)
    cur = problem.current_layout.boundaries
    ranges = [(cur[w], cur[w + 1]) for w in workers]
    bnd, _ = optimal_with(sub, ranges)
    res = make_result(sub, "optimal-repack", boundaries=bnd, workers=workers,
                      current_owner=_current_owner(problem))
    res.released = [w for w in range(p) if w not in set(workers)]
    return res


def repack_firstfit(problem: Problem, target: int | None = None, tolerance: float = 0.05) -> Result:
    p = problem.stages
    if target is None:
        target = len(repack_optimal(problem, tolerance).workers)
    if not 1 <= target <= p:
        raise BalanceError(f"target must be between 1 and {p} workers, got {target}")
    owner = _current_owner(problem)
    new_owner = owner.copy()
    mem = np.bincount(owner, weights=problem.m, minlength=p).astype(float)
    alive = [True] * p
    active = p
    for src in range(p):
        if not alive[src]:
            continue
        for dst in range(src + 1, p):
            if not alive[dst]:
                continue
            if active > target and mem[src] + mem[dst] <= problem.cap[dst]:
                new_owner[new_owner == src] = dst
                mem[dst] += mem[src]
                mem[src] = 0.0
                alive[src] = False
                active -= 1
                break
    workers = [w for w in range(p) if alive[w]]
    stage_of = {w: j for j, w in enumerate(workers)}
    sub = problem.with_stages(workers)
    stage_owner = [stage_of[int(w)] for w in new_owner]
    res = make_result(sub, "firstfit-repack", owner=stage_owner, workers=workers, current_owner=owner)
    res.released = [w for w in range(p) if not alive[w]]
    return res
