"""Judging the last migration by the step times measured after it.

Steps before and after a migration differ in more than the layout (the run speeds up as it
warms, per-step dynamism, the machine's load), so their step times are not compared directly.
Each layout's step time is predicted under the *after* steps' own costs by the step-time model,
scaled by how far the model was off for that layout when it ran (measured / predicted: before
the migration for the old layout, after it for the new); the two layouts are compared step by
step (the median of their paired ratio). If the new layout's comes out slower than the old's
by more than the noise of that comparison (beyond the re-pack's tolerance, for a re-pack), the
migration lost: it is undone, and its layout not taken again for the horizon.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from statistics import fmean, median, stdev

from dynmo.controller.steptime import StepTimes
from dynmo.layout import Layout

# windows of measured step times before and after a migration that judge it: a step's time
# carries its straggler microbatches, which the per-layer medians do not, so the judge reads
# the fastest steps of two windows
JUDGE = 2


@dataclass
class Pending:
    """A migration awaiting its verdict: what it left, what it chose, the model's error before it
    (`before`: measured / predicted step time per step) and the steps measured after it
    (`after`: (measured / predicted, the step's costs))."""
    old: Layout
    new: Layout
    before: list[float]
    repack: bool
    after: list[tuple[float, list[float]]] = field(default_factory=list)


@dataclass
class Verdict:
    lost: bool
    t_old: float  # the old layout's step time under the after steps' costs
    t_new: float  # the new layout's


def ready(p: Pending | None, current: Layout, window: int) -> bool:
    """Enough steps ran on the migrated layout to judge it (the first, which pays one-off costs
    as rebuilt stages warm up, does not count)."""
    return p is not None and p.new == current and len(p.after) >= JUDGE * window + 1 and bool(p.before)


def judge_migration(p: Pending, min_gain: float, repack_tolerance: float, steps_s: StepTimes) -> Verdict:
    """The verdict on a `ready` migration. Noise only ever slows a step (a straggler microbatch, a
    busy core): the fastest steps of each window show what its layout can do."""
    after = p.after[1:]
    off_old = min(p.before)
    off_new = min(r for r, _ in after)
    costs = [c for _, c in after]
    n = len(costs)
    times = steps_s(costs + costs, [p.old] * n + [p.new] * n)
    # paired: each step's costs give both layouts' times, and the median of their ratio does not
    # set one step's noise against another's (the medians of each apart called a move 2 % faster
    # on average 4 % slower, on a committed trace's noise)
    ratios = [b / a for a, b in zip(times[:n], times[n:])]
    t_old = off_old * median(times[:n])
    t_new = off_new * median(times[:n]) * median(ratios)
    # lost: slower than the old layout by more than the noise of this comparison or the min_gain
    # floor, or than a re-pack's tolerance. Its noise: the step times' own (their relative spread
    # before the migration), once for each window's fastest step, and the paired ratios' median's
    # (its standard error, 1.2533 s / sqrt(n) for a normal spread s); with one window's noise
    # alone, 2 of 8 migrations judged lost over 40 scenarios had run faster
    step_noise = stdev(p.before) / fmean(p.before) if len(p.before) > 1 else 0.0
    ratio_spread = stdev(ratios) / fmean(ratios) if n > 1 else 0.0
    noise = math.sqrt(2 * step_noise**2 + (1.2533 * ratio_spread) ** 2 / max(n, 1))
    allowed = t_old * (1 + (repack_tolerance if p.repack else 0.0) + max(min_gain, noise))
    return Verdict(t_new > allowed, t_old, t_new)


class Judge:
    """The step times measured since the last decision, and the migration awaiting its verdict."""

    def __init__(self, window: int):
        self.window = window
        # measured step time / the step time the model predicts for the layout that ran, per step
        # since the last decision: how far the model is off for that layout (the schedule's own
        # effects, what a step does besides the pipeline)
        self.step_times: deque[float] = deque(maxlen=JUDGE * window)
        self.pending: Pending | None = None  # the last migration, until judged

    def observe(self, ratio: float, costs: list[float]) -> None:
        """One step's measured / predicted step time, and its per-layer costs."""
        self.step_times.append(ratio)
        if self.pending is not None:
            self.pending.after.append((ratio, list(costs)))

    def expect(self, old: Layout, new: Layout, repack: bool) -> None:
        """A migration from `old` to `new` was decided: judge it once it has run long enough."""
        self.pending = Pending(old, new, list(self.step_times), repack)

    def forget(self) -> None:
        """The model changed: step times no longer compare, and nothing is judged."""
        self.pending = None
        self.step_times.clear()

    def verdict(self, current: Layout, min_gain: float, repack_tolerance: float,
                steps_s: StepTimes) -> tuple[Pending, Verdict] | None:
        """The pending migration and its verdict, once `ready` (it is then no longer pending)."""
        if not ready(self.pending, current, self.window):
            return None
        p, self.pending = self.pending, None
        return p, judge_migration(p, min_gain, repack_tolerance, steps_s)
