"""`auto`'s evidence that a move is real and not noise: the gain on each step of the window, then on fresh steps.

Each function takes what it judges (the window's costs, a way to time a layout under one
step's costs) and returns a verdict; the controller keeps the state.
"""

from __future__ import annotations

from typing import Callable, Iterable

from dynmo.layout import Layout

CONFIRM = 2  # fresh steps that must confirm a proposed move (see `confirmed`)

StepTime = Callable[[list[float], Layout], float]  # (one step's per-layer costs, layout) -> predicted step seconds


def per_step_gains(window: Iterable[list[float]], step_s: StepTime, current: Layout, new: Layout) -> list[float]:
    """Per observed step of the window: the relative step-time saving of `new` over `current`
    under that step's own costs."""
    gains = []
    for costs in window:
        old_t, new_t = step_s(costs, current), step_s(costs, new)
        gains.append((old_t - new_t) / old_t if old_t > 0 else 0.0)
    return gains


def consistent(gains: list[float], margin: float) -> bool:
    """Whether the gain clears `margin` on nearly every observed step of the window: all of a
    window of up to 4 steps, all but one of 5 to 9, and so on (80%). One step a noisy machine
    slowed, or a forecast fitted to the window's noise (the winner's curse), does not move
    layers; a real change in cost shows on every step after it."""
    need = -(-len(gains) * 4 // 5)  # ceil(0.8 n)
    return sum(g >= margin for g in gains) >= need


def confirmed(proposal: tuple | None, observed: int, fresh_max: int, window: int, current: Layout, new: Layout,
              margin: float, gains_of: Callable[[Layout], list[float]]) -> tuple[Layout | None, tuple | None]:
    """(the layout to move to, or None; the proposal that stands after this step).

    The window that proposes a move also chose it (the optimum of the window's forecast), so
    its gain there is biased up; only steps that played no part in choosing it are fair
    evidence. A proposal `(boundaries, steps observed then)` is confirmed when the mean gain of
    CONFIRM steps observed after it (no more than the window holds: `fresh_max`) clears the
    margin. Under noise the forecast's optimum may flip between layouts of the same bottleneck:
    the proposal stands until its own fresh steps judge it; then `new` is proposed afresh."""
    if proposal is not None:
        proposed, since = Layout(proposal[0]), proposal[1]
        fresh = min(observed - since, fresh_max)
        if fresh < min(CONFIRM, window):
            return None, proposal
        if proposed.num_stages == current.num_stages and proposed != current:
            gains = gains_of(proposed)[-fresh:]
            if sum(gains) / len(gains) >= margin:
                return proposed, None
    return None, (new.boundaries, observed)
