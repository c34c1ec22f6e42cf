"""Re-packing: the fewest pipeline positions 0..k-1 whose predicted step time stays within the
tolerance of the best all-worker layout's, once the model has shrunk.

Released workers never come back, so a model that may still grow keeps them: the re-pack waits
until the forecast total cost fell by `min_gain` from the largest seen.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

from dynmo.balance import Problem, balance
from dynmo.config import BalanceConfig
from dynmo.layout import Layout

ProblemOf = Callable[..., Problem]  # (costs, stages[, current]) -> the balancing problem on positions 0..stages-1
StepOf = Callable[[Problem, Layout], float]  # predicted step seconds of a layout under a problem's costs


@dataclass
class Repack:
    layout: Layout  # on positions 0..k-1
    bottleneck: float  # its slowest stage, seconds per microbatch
    step_s: float  # its predicted step time
    best_step_s: float  # the best layout's on all of today's workers


def repack(cfg: BalanceConfig, costs: list[float], current: Layout, peak_total: float, problem_of: ProblemOf,
           step_of: StepOf, window: Iterable[list[float]]) -> Repack | None:
    """The re-pack to make now, or None (the model has not shrunk, or every worker is needed).
    With `when` other than `every`, the re-pack must also keep its tolerance on nearly every
    step of the `window` (as `evidence.consistent`)."""
    p = current.num_stages
    if sum(costs) > (1 - cfg.min_gain) * peak_total:
        return None
    t_best = _best_step(problem_of(costs, p, current), step_of)
    limit = t_best * (1 + cfg.repack_tolerance) * (1 + 1e-9)
    for k in range(1, p):
        sub = problem_of(costs, k)
        result = balance(sub, cfg.balancer)  # the runtime keeps positions 0..k-1
        if result.boundaries is None:
            continue
        new = Layout(tuple(result.boundaries))
        t_k = step_of(sub, new)
        if t_k <= limit:
            break
    else:
        return None
    if cfg.when != "every" and not _fits_on_most_steps(cfg, current, new, k, problem_of, step_of, window):
        return None
    return Repack(new, result.bottleneck, t_k, t_best)


def _best_step(problem: Problem, step_of: StepOf) -> float:
    """The predicted step time of the optimal layout of `problem`."""
    return step_of(problem, Layout(tuple(balance(problem, "optimal").boundaries)))


def _fits_on_most_steps(cfg: BalanceConfig, current: Layout, new: Layout, k: int, problem_of: ProblemOf,
                        step_of: StepOf, window: Iterable[list[float]]) -> bool:
    steps = list(window)
    ok = 0
    for costs in steps:
        t_best = _best_step(problem_of(costs, current.num_stages, current), step_of)
        ok += step_of(problem_of(costs, k), new) <= t_best * (1 + cfg.repack_tolerance) * (1 + 1e-9)
    return ok >= -(-len(steps) * 4 // 5)
