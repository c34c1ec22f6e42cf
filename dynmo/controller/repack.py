"""Re-packing: the fewest pipeline positions 0..k-1 whose predicted step time stays within the
tolerance of the best layout's on every worker the run started with, once the model has shrunk.

The reference is the run's first workers, not today's: measured against today's, each re-pack
could cost its tolerance on top of the last one's.

A re-pack waits until the forecast total cost fell by `repack_shrink` from the largest seen:
released workers come back only through a checkpoint restart (`grow`), which costs far more than
a migration, so a model that may still grow keeps them.

Growing back (`grow`) is the mirror: when the packed layout is no longer within the tolerance of
the best layout on every worker the run started with, on the forecast and on 80 % of the
observed steps, and the step time it saves over the horizon repays the restart (`restart_s`,
a prior until a restart was measured), the workers come back.
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
           steps_of: StepsOf, history: Iterable[list[float]], microbatches: int, widest: int = 0,
           memo: dict | None = None) -> Repack | None:
    """The re-pack to make now, or None (the model has not shrunk, or every worker is needed).
    The tolerance is against the best layout, among the controller's candidates, on the `widest`
    positions the run had (at least today's). With `when` other than `every`, the re-pack must
    also keep its tolerance on 80% of the observed steps of `history` (the controller's evidence,
    up to 20 steps, not only the forecast's window): released workers come back only through a restart, so the
    decision that releases them reads all the evidence there is. `memo` keeps each observed
    step's best step time on every position between calls (it is searched, not just simulated).

    A stage count whose slowest stage alone, `microbatches` times, exceeds the limit cannot be
    within it (that stage runs every microbatch's forward and backward), and is not simulated."""

    p = current.num_stages
    if sum(costs) > (1 - cfg.repack_shrink) * peak_total:
        return None
    full = max(widest, p)
    memo = {} if memo is None else memo

    def best_of(step_costs: list[float]) -> float:
        return _best_on(cfg, step_costs, full, current, problem_of, steps_of, memo)

    t_best = best_of(costs)
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
    if cfg.when != "every" and not _fits_on_most_steps(cfg, new, k, problem_of, steps_of, history, best_of):
        return None
    return Repack(new, result.bottleneck, t_k, t_best)


def _best_on(cfg: BalanceConfig, costs: list[float], full: int, current: Layout, problem_of: ProblemOf,
             steps_of: StepsOf, memo: dict) -> float:
    """The best step time of `costs` on all `full` positions, kept in `memo` per step: the
    re-pack and the grow read each observed step's at every decision."""
    p = current.num_stages
    key = (tuple(costs), full, current.boundaries if full == p else None)
    if key not in memo:
        memo[key] = best_layout(problem_of(costs, full, current if full == p else None), cfg.balancer, None,
                                steps_of)[1]
    return memo[key]


def _fits_on_most_steps(cfg: BalanceConfig, new: Layout, k: int, problem_of: ProblemOf, steps_of: StepsOf,
                        history: Iterable[list[float]], best_of: Callable[[list[float]], float]) -> bool:
    steps = list(history)
    ok = 0
    for costs in steps:
        t_best = best_of(costs)
        ok += steps_of(problem_of(costs, k), [new])[0] <= t_best * (1 + cfg.repack_tolerance) * (1 + 1e-9)
    return ok >= -(-len(steps) * 4 // 5)


@dataclass
class Grow:
    layout: Layout  # on all `widest` positions
    step_s: float  # its predicted step time
    current_step_s: float  # the packed layout's


def grow(cfg: BalanceConfig, costs: list[float], current: Layout, widest: int, problem_of: ProblemOf,
         steps_of: StepsOf, history: Iterable[list[float]], horizon: int, cost_s: float,
         memo: dict | None = None) -> Grow | None:
    """Take the released workers back, or None: the best layout on all `widest` positions, when
    the packed `current` runs beyond the re-pack's tolerance of it (on the forecast, and, with
    `when` other than `every`, on 80 % of the observed steps: the restart reads all the evidence
    there is, as the re-pack did) and the saving over `horizon` steps exceeds `cost_s` (the
    restart: the layers come back from its checkpoint, no migration)."""
    if current.num_stages >= widest:
        return None
    wide, t_wide = best_layout(problem_of(costs, widest), cfg.balancer, None, steps_of)
    t_now = float(steps_of(problem_of(costs, current.num_stages, current), [current])[0])
    if t_now <= t_wide * (1 + cfg.repack_tolerance) * (1 + 1e-9) or (t_now - t_wide) * horizon <= cost_s:
        return None
    if cfg.when != "every":
        steps = list(history)
        memo = {} if memo is None else memo
        beyond = 0
        for c in steps:
            best = _best_on(cfg, c, widest, current, problem_of, steps_of, memo)
            packed = steps_of(problem_of(c, current.num_stages, current), [current])[0]
            beyond += packed > best * (1 + cfg.repack_tolerance) * (1 + 1e-9)
        if beyond < -(-len(steps) * 4 // 5):
            return None
    return Grow(wide, t_wide, t_now)
