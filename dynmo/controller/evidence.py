"""`auto`'s evidence that a move is real and not noise: the gain on each step of the window, then on fresh steps.

The test. Each observed step k gives the relative saving g_k of the proposed layout over the
current one under that step's own costs (the simulated step time of both). Step-to-step
variation of the machine and of the model (noise, per-step dynamism) spreads the g_k; their
standard deviation s over n steps measures it. A move is significant on those n steps when

    mean(g) - t(n-1) x s / sqrt(n) >= margin   and   mean(g) > 0

with t(n-1) a one-sided quantile of Student's t with n-1 degrees of freedom: a saving the
steps' own variation would produce by chance does not move layers. It is tested twice
(`supported`), on the forecast's `window` steps (a large change shows at once) and on up to
EVIDENCE_STEPS observed steps (a gain of a few percent under noise needs more steps to stand
out), each at 97.5%. `margin` is `balance.min_gain` (an optional floor, 0 by default), doubled
after a migration that lost. With no variation (a noise-free replay) the test passes for any
positive saving, and the controller moves for any gain that repays its migration over the
horizon.

The window that proposes a move also chose it (the optimum of the window's forecast), so its
gains there are biased up (the winner's curse). A proposal is therefore confirmed only after
CONFIRM fresh steps that played no part in choosing it: their mean gain must clear the margin,
and the test above, fresh steps included, must still hold.

A change the model announces (a dynamism event: a pruning step, frozen blocks, exits switched
on, the skew) is not the winner's curse: what changed, and when, is known, not selected from
noise. The first window of steps of the changed model (`announced`) therefore moves layers on
its own evidence, the window test above, without waiting for fresh steps: the paper's
Algorithm 1 (profile the changed model, then rebalance), with the test added. Whether the
event's own step already ran the changed model differs between cases (the skew and pruning
change the step that reports them; exits and freezing the next one), so the window that ends
on the event's step + `window` - 1 and the one after it both qualify, once.

Each function takes what it judges and returns a verdict; the controller keeps the state.
"""

from __future__ import annotations

import math
from statistics import fmean, stdev
from typing import Callable, Sequence

from dynmo.layout import Layout

CONFIRM = 2  # fresh steps that must confirm a proposed move (see `confirmed`)
# one-sided 95% quantiles of Student's t by degrees of freedom (1..30); beyond, the normal's
T95 = (6.314, 2.920, 2.353, 2.132, 2.015, 1.943, 1.895, 1.860, 1.833, 1.812, 1.796, 1.782, 1.771, 1.761, 1.753,
       1.746, 1.740, 1.734, 1.729, 1.725, 1.721, 1.717, 1.714, 1.711, 1.708, 1.706, 1.703, 1.701, 1.699, 1.697)
Z95 = 1.645
# one-sided 97.5% quantiles: each of the two tests of `supported` spends half of the 5%
T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
        2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)
Z975 = 1.960
EVIDENCE_STEPS = 20  # the longest run of observed steps the evidence reads (the forecast reads `window`)


def t95(df: int) -> float:
    return T95[df - 1] if 1 <= df <= len(T95) else Z95


def t975(df: int) -> float:
    return T975[df - 1] if 1 <= df <= len(T975) else Z975


def spread(gains: list[float]) -> float:
    """Standard deviation of the per-step gains (0 for fewer than two)."""
    return stdev(gains) if len(gains) > 1 else 0.0


def noise_bound(gains: list[float], n: int, t: Callable[[int], float] = t95) -> float:
    """What the step-to-step variation of `gains` could produce by chance in the mean of n steps."""
    return t(len(gains) - 1) * spread(gains) / math.sqrt(n) if len(gains) > 1 else 0.0

def gains(old_times: Sequence[float], new_times: Sequence[float]) -> list[float]:
    """Per observed step: the relative step-time saving of the proposed layout (its predicted
    step times `new_times`) over the current one (`old_times`), both under that step's own costs."""
    return [(old_t - new_t) / old_t if old_t > 0 else 0.0 for old_t, new_t in zip(old_times, new_times)]


def significant(gains: list[float], margin: float, t: Callable[[int], float] = t95) -> bool:
    """The mean gain clears the margin beyond what the gains' variation could produce (above)."""
    if not gains:
        return False
    mean = fmean(gains)
    return mean > 0 and mean - noise_bound(gains, len(gains), t) >= margin


def supported(gains: list[float], window: int, margin: float) -> bool:
    """Significant on the last `window` steps (a large change shows within the window) or on all
    the steps observed, up to EVIDENCE_STEPS (a small gain needs more steps to stand out of the
    noise); each test at one-sided 97.5%, so that the two together err at most 5% of the time."""
    if significant(gains[-window:], margin, t975):
        return True
    return len(gains) > window and significant(gains, margin, t975)


def confirmed(proposal: tuple | None, observed: int, fresh_max: int, window: int, current: Layout, new: Layout,
              margin: float, gains_of: Callable[[Layout], list[float]]) -> tuple[Layout | None, tuple | None]:
    """(the layout to move to, or None; the proposal that stands after this step).

    The window that proposes a move also chose it (the optimum of the window's forecast), so
    its gain there is biased up; only steps that played no part in choosing it are fair
    evidence. A proposal `(boundaries, steps observed then)` is confirmed once CONFIRM steps were
    observed after it (no more than the evidence holds: `fresh_max`), when their mean gain clears
    the margin and the evidence, fresh steps included, still `supported` it. Under noise the
    forecast's optimum may flip between layouts of the same step time: the proposal stands until
    its own fresh steps judge it; then `new` is proposed afresh."""
    if proposal is not None:
        proposed, since = Layout(proposal[0]), proposal[1]
        fresh = min(observed - since, fresh_max)
        if fresh < min(CONFIRM, window):
            return None, proposal
        if proposed.num_stages == current.num_stages and proposed != current:
            gains = gains_of(proposed)
            if fmean(gains[-fresh:]) > margin and supported(gains, window, margin):
                return proposed, None
    return None, (new.boundaries, observed)


def announced(gains: list[float], window: int, margin: float) -> bool:
    """The first window after an announced change: the window's steps alone, at 97.5%."""
    return len(gains) >= window and significant(gains[-window:], margin, t975)
