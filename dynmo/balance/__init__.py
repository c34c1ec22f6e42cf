"""Balancers and re-packing: pure decisions (numpy only, no torch, no runtime).

    from dynmo.balance import Problem, balance, repack
    r = balance(Problem(costs=[...], stages=4, current=[0, 3, 6, 9, 12]))
    r.boundaries, r.stage_loads, r.bottleneck, r.imbalance, r.moves

Balancers (`BALANCERS`): uniform, deepspeed, diffusion, diffusion-contiguous, optimal.
Re-packing methods: optimal (ours), firstfit (paper Algorithm 4). See docs/balancers.md.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Mapping

from .diffusion import diffusion, diffusion_contiguous
from .optimal import optimal
from .problem import EPS, BalanceError, Problem, cut_factors
from .repack import repack_firstfit, repack_optimal
from .result import Result, make_result
from .static import deepspeed, uniform

__all__ = ["BALANCERS", "REPACKERS", "BalanceError", "Problem", "Result", "balance", "cut_factors", "repack", "EPS"]

# name -> (function(problem) -> boundaries or per-layer stages, returns a contiguous layout?)
BALANCERS: dict[str, tuple[Callable[[Problem], list[int]], bool]] = {
    "uniform": (uniform, True),
    "deepspeed": (deepspeed, True),
    "diffusion": (diffusion, False),
    "diffusion-contiguous": (diffusion_contiguous, True),
    "optimal": (optimal, True),
}
REPACKERS = ("optimal", "firstfit")


def _as_problem(problem: Problem | Mapping[str, Any]) -> Problem:
    return problem if isinstance(problem, Problem) else Problem.from_dict(dict(problem))


def balance(problem: Problem | Mapping[str, Any], balancer: str = "optimal") -> Result:
    """Decide a layout for `problem` with the named balancer (see BALANCERS)."""
    if balancer not in BALANCERS:
        raise BalanceError(f"unknown balancer {balancer!r}; choose one of {sorted(BALANCERS)}")
    pr = _as_problem(problem)
    fn, contiguous = BALANCERS[balancer]
    t0 = time.perf_counter()
    out = fn(pr)
    seconds = time.perf_counter() - t0
    res = make_result(pr, balancer, boundaries=out) if contiguous else make_result(pr, balancer, owner=out)
    res.seconds = seconds
    return res


def repack(problem: Problem | Mapping[str, Any], tolerance: float = 0.05, method: str = "optimal",
           target: int | None = None) -> Result:
    """Pack the layers onto fewer workers; `Result.released` lists the freed worker indices."""
    pr = _as_problem(problem)
    t0 = time.perf_counter()
    if method == "optimal":
        res = repack_optimal(pr, tolerance)
    elif method == "firstfit":
        res = repack_firstfit(pr, target=target, tolerance=tolerance)
    else:
        raise BalanceError(f"unknown re-packing method {method!r}; choose one of {list(REPACKERS)}")
    res.seconds = time.perf_counter() - t0
    return res
