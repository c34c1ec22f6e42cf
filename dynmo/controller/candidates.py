"""The layouts a step-time objective chooses among (the replay's oracle takes the best of them).

The balancer (a DP) stays the generator: its min-max layout, with the fewest moves from the
current one among equals. The step time of the schedule that runs is not the slowest stage's
load (the fill and drain, forward and backward apart, links), so a bounded local search then
tries the neighbours that shift a boundary of one of the heaviest stages by one layer, and keeps
the best by `step_of`. The current layout is always a candidate: no move wins ties.
"""

from __future__ import annotations

from typing import Callable

from dynmo.balance import Problem, balance
from dynmo.layout import Layout

ROUNDS = 3  # local-search rounds: each moves one boundary by one layer
HEAVIEST = 2  # the boundaries of this many heaviest stages are tried in each round

StepOf = Callable[[Problem, Layout], float]


def generated(problem: Problem, balancer: str) -> Layout:
    """The balancer's layout (min-max stage load, fewest moves from `problem.current`)."""
    result = balance(problem, balancer)
    if result.boundaries is None:
        raise ValueError(f"balancer {balancer!r} gave a non-contiguous layout; pipelines need a contiguous one")
    return Layout(tuple(result.boundaries))


def neighbours(problem: Problem, layout: Layout) -> list[Layout]:
    """Layouts one boundary of one of the HEAVIEST stages away, every stage non-empty and within
    its memory capacity."""
    b = list(layout.boundaries)
    loads = problem.loads_of_assignment(layout.owner())
    heavy = sorted(range(layout.num_stages), key=lambda j: -loads[j])[:HEAVIEST]
    inner = sorted({j for s in heavy for j in (s, s + 1) if 0 < j < layout.num_stages})
    out = []
    for j in inner:
        for d in (-1, 1):
            nb = b[:j] + [b[j] + d] + b[j + 1:]
            if nb[j - 1] < nb[j] < nb[j + 1]:
                cand = Layout(tuple(nb))
                mem = problem.memory_of_assignment(cand.owner())
                if all(m <= c * (1 + 1e-9) for m, c in zip(mem, problem.cap)):
                    out.append(cand)
    return out


def best_layout(problem: Problem, balancer: str, current: Layout | None, step_of: StepOf,
                search: bool = True) -> tuple[Layout, float]:
    """(the layout of least simulated step time among the candidates, its step time). The local
    search runs when `search` is set or the balancer's layout is not `current`."""
    start = generated(problem, balancer)
    best, t_best = start, step_of(problem, start)
    if current is not None and current.num_stages == start.num_stages:
        t_cur = step_of(problem, current)
        if t_cur <= t_best:
            best, t_best = current, t_cur
    seen = {best.boundaries, start.boundaries}
    for _ in range(ROUNDS if search or start != current else 0):
        improved = False
        for cand in neighbours(problem, best):
            if cand.boundaries in seen:
                continue
            seen.add(cand.boundaries)
            t = step_of(problem, cand)
            if t < t_best * (1 - 1e-12):
                best, t_best, improved = cand, t, True
        if not improved:
            break
    return best, t_best
