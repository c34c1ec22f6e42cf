"""Re-packing: the fewest pipeline positions 0..k-1 whose predicted step time stays within the
tolerance of the best layout's on every worker the run started with, once the model has shrunk.

The reference is the run's first workers, not today's: measured against today's, each re-pack
could cost its tolerance on top of the last one's.

Released workers never come back, so a model that may still grow keeps them: the re-pack waits
until the forecast total cost fell by `repack_shrink` from the largest seen.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

from dynmo.balance import Problem, balance
from dynmo.config import BalanceConfig
from dynmo.controller.candidates import best_layout
from dynmo.controller.steptime import StepsOf
from dynmo.layout import Layout

ProblemOf = Callable[..., Problem]  # (costs, stages[, current]) -> the balancing problem on positions 0..stages-1


@dataclass
class Repack:
    layout: Layout  # on positions 0..k-1
    bottleneck: float  # its slowest stage, seconds per microbatch
    step_s: float  # its predicted step time
    best_step_s: float  # the best layout's on every worker the run started with


def repack(cfg: BalanceConfig, costs: list[float], current: Layout, peak_total: float, problem_of: ProblemOf,
           steps_of: StepsOf, window: Iterable[list[float]], microbatches: int, widest: int = 0) -> Repack | None:
    """The re-pack to make now, or None (the model has not shrunk, or every worker is needed).
    The tolerance is against the best layout, among the controller's candidates, on the `widest`
    positions the run had (at least today's). With `when` other than `every`, the re-pack must also keep its tolerance on 80% of
    the steps of the `window`.

    A stage count whose slowest stage alone, `microbatches` times, exceeds the limit cannot be
    within it (that stage runs every microbatch's forward and backward), and is not simulated."""

    def best_of(problem: Problem) -> float:
        return best_layout(problem, cfg.balancer, None, steps_of)[1]

    p = current.num_stages
    if sum(costs) > (1 - cfg.repack_shrink) * peak_total:
        return None
    full = max(widest, p)
    t_best = best_of(problem_of(costs, full, current if full == p else None))
    limit = t_best * (1 + cfg.repack_tolerance) * (1 + 1e-9)
    for k in range(1, p):
        sub = problem_of(costs, k)
        if microbatches * sum(costs) / float(sub.s.sum()) > limit:
            continue  # even a perfect split of the work over k positions is too slow
        result = balance(sub, cfg.balancer)  # the runtime keeps positions 0..k-1
        if result.boundaries is None or microbatches * result.bottleneck > limit:
            continue
        new = Layout(tuple(result.boundaries))
        t_k = float(steps_of(sub, [new])[0])
        if t_k <= limit:
            break
    else:
        return None
    if cfg.when != "every" and not _fits_on_most_steps(cfg, current, full, new, k, problem_of, steps_of, window, best_of):
        return None
    return Repack(new, result.bottleneck, t_k, t_best)


def _fits_on_most_steps(cfg: BalanceConfig, current: Layout, full: int, new: Layout, k: int, problem_of: ProblemOf,
                        steps_of: StepsOf, window: Iterable[list[float]], best_of: Callable[[Problem], float]) -> bool:
    steps = list(window)
    ok = 0
    for costs in steps:
        t_best = best_of(problem_of(costs, full, current if full == current.num_stages else None))
        ok += steps_of(problem_of(costs, k), [new])[0] <= t_best * (1 + cfg.repack_tolerance) * (1 + 1e-9)
    return ok >= -(-len(steps) * 4 // 5)
