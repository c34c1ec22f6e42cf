"""How the controller scores layouts: the balancing problem of its measured workers and links,
the simulated step time of layouts under it, and the evidence's per-step times on the history.

`Scoring` is the `Controller`'s base: the methods that turn per-layer costs into step times
(`dynmo.controller.steptime.StepModel` simulates them); `HistoryTimes` keeps the history's
predicted step times so that each (step, layout) pair is simulated once. Pure.
"""

from __future__ import annotations

from typing import Callable, Iterable, Sequence

from dynmo.balance import Problem, cut_factors
from dynmo.controller import evidence
from dynmo.controller.steptime import positions_problem
from dynmo.layout import Layout


class HistoryTimes:
    """Predicted step times on the observed steps, {step's costs: {layout boundaries: seconds}}:
    the evidence reads every step of the history at each decision, and each (step, layout) pair
    is simulated once, with the forward/backward split measured on that step. What else the
    times depend on (the workers, the links, the microbatch count) is the `key`: the cache is
    emptied when it changes."""

    def __init__(self) -> None:
        self._times: dict[tuple, dict[tuple, float]] = {}
        self._shares: dict[tuple, tuple] = {}
        self._key: tuple = ()

    def measured(self, costs: Sequence[float], shares: tuple) -> None:
        """A step was observed with per-layer `costs`, split forward/backward by `shares`."""
        self._shares[tuple(costs)] = shares

    def times(self, history: Iterable[Sequence[float]], layouts: list[Layout], key: tuple,
              simulate: Callable[[list[list[float]], list[Layout], list], Sequence[float]]) -> list[list[float]]:
        """Per layout, its step time under each step of `history` (oldest first); the pairs not
        simulated yet go to `simulate(steps, layouts, shares)` together."""
        steps = [tuple(c) for c in history]
        if key != self._key:
            self._times, self._key = {}, key
        self._times = {c: self._times.get(c, {}) for c in steps}  # forget steps that left the history
        self._shares = {c: self._shares[c] for c in steps if c in self._shares}
        todo = [(c, lay) for lay in layouts for c in dict.fromkeys(steps) if lay.boundaries not in self._times[c]]
        if todo:
            times = simulate([list(c) for c, _ in todo], [lay for _, lay in todo], [self._shares.get(c) for c, _ in todo])
            for (c, lay), t in zip(todo, times):
                self._times[c][lay.boundaries] = t
        return [[self._times[c][lay.boundaries] for c in steps] for lay in layouts]


class Scoring:
    """The `Controller`'s step-time methods; it supplies `model` (a `StepModel`), `microbatches`,
    `history`, `cache`, and the measured `speeds`, `transfer`, `transfer_back`, `memory`,
    `capacity`, `boundary_bytes` (per cut after unit i: one microbatch's bytes; `transfer` prices
    the smallest, a cut between blocks)."""

    def step_s(self, problem: Problem, layout: Layout) -> float:
        """Predicted step time of `layout` under `problem`'s costs: the running schedule, simulated."""
        return self.model.step_s(problem, layout, self.microbatches)

    def steps_s(self, problem: Problem, layouts: list[Layout]) -> list[float]:
        """`step_s` of each of `layouts` under one problem, simulated together."""
        return self.model.steps_s([problem] * len(layouts), layouts, self.microbatches).tolist()

    def _steps_under(self, steps: list[list[float]], layouts: list[Layout],
                     shares: list[tuple | None] | None = None) -> list[float]:
        """Predicted step time of each layout under the per-layer costs of its step (pairwise),
        split forward/backward by `shares` (per pair; default the latest measured)."""
        problems = [self.problem(costs, lay.num_stages, lay) for costs, lay in zip(steps, layouts)]
        return self.model.steps_s(problems, layouts, self.microbatches, shares).tolist()

    def step_times(self, steps: list[list[float]], layout: Layout) -> list[float]:
        """Predicted step time of `layout` under each of `steps`' per-layer costs (what the expert
        balancer scores placements with: the layer layout's own objective)."""
        return self._steps_under(steps, [layout] * len(steps))

    def _step_under(self, costs: list[float], layout: Layout) -> float:
        """Predicted step time of `layout` under one step's per-layer costs."""
        return self._steps_under([costs], [layout])[0]

    def problem(self, costs: list[float], stages: int, current: Layout | None = None) -> Problem:
        """The balancing problem for the first `stages` pipeline positions."""
        return positions_problem(costs, stages, current, self.speeds, self.transfer, self.transfer_back,
                                 self.memory if self.capacity else None, self.capacity or None,
                                 cut_factors(self.boundary_bytes))

    def per_step_gains(self, current: Layout, new: Layout) -> list[float]:
        """Per observed step: the relative step-time saving of `new` over `current` (oldest first)."""
        old_t, new_t = self.history_times([current, new])
        return evidence.gains(old_t, new_t)

    def history_times(self, layouts: list[Layout]) -> list[list[float]]:
        """Per layout: its predicted step time under each step of the history (oldest first).
        Each (step, layout) pair is simulated once while the step stays in the history; the
        missing ones are simulated together."""
        key = tuple(tuple(x) if x is not None else None
                    for x in (self.speeds, self.transfer, self.transfer_back, self.boundary_bytes)) + (self.microbatches,)
        return self.cache.times(self.history, layouts, key, self._steps_under)

