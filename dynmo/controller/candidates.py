"""The layouts a decision chooses among, scored by the simulated step time.

The balancer (a DP) stays the generator: its min-max layout, with the fewest moves from the
current one among equals. The step time of the schedule that runs is not the slowest stage's
load (the fill and drain, forward and backward apart, links), so a bounded local search then
tries the neighbours that shift a boundary of one of the heaviest stages by one layer, and keeps
the best by `steps_of`. The current layout is always a candidate: no move wins ties.
"""

from __future__ import annotations

from dynmo.balance import Problem, balance
from dynmo.controller.steptime import StepsOf
from dynmo.layout import Layout

ROUNDS = 3  # local-search rounds: each moves one boundary by one layer
HEAVIEST = 2  # the boundaries of this many heaviest stages are tried in each round



def generated(problem: Problem, balancer: str) -> Layout:
    """The balancer's layout (min-max stage load, fewest moves from `problem.current`)."""
    result = balance(problem, balancer)
    if result.boundaries is None:
        raise ValueError(f"balancer {balancer!r} gave a non-contiguous layout; pipelines need a contiguous one")
    return Layout(tuple(result.boundaries))


def fits(problem: Problem, layout: Layout) -> bool:
    """Whether every stage of `layout` is within its memory capacity."""
    mem = problem.memory_of_assignment(layout.owner())
    return all(m <= c * (1 + 1e-9) for m, c in zip(mem, problem.cap))


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
                if fits(problem, cand):
                    out.append(cand)
    return out


def best_layout(problem: Problem, balancer: str, current: Layout | None, steps_of: StepsOf,
                search: bool = True, known: tuple[Layout, ...] = ()) -> tuple[Layout, float]:
    """(the layout of least simulated step time among the candidates, its step time). Without
    `search` only the balancer's layout, `current` and the `known` layouts (a previous search's
    result) compete; each round of the local search scores its neighbours together (one
    `steps_of` call). Ties go to `current`, then to the balancer's layout."""
    start = generated(problem, balancer)
    first = [current] if current is not None and current.num_stages == start.num_stages else []
    for lay in (start, *known):
        if lay.num_stages == start.num_stages and lay not in first:
            first.append(lay)
    times = steps_of(problem, first)
    i = min(range(len(first)), key=lambda j: times[j])
    best, t_best = first[i], float(times[i])
    seen = {lay.boundaries for lay in first}
    for _ in range(ROUNDS if search else 0):
        cands = [c for c in neighbours(problem, best) if c.boundaries not in seen]
        if not cands:
            break
        seen.update(c.boundaries for c in cands)
        times = steps_of(problem, cands)
        i = min(range(len(cands)), key=lambda j: times[j])
        if not times[i] < t_best * (1 - 1e-12):
            break
        best, t_best = cands[i], float(times[i])
    return best, t_best
