"""`auto` against a moving target: a move pays only if its cost pattern outlasts what the run's own undone moves cost.

A move to the optimum of the latest costs gains its saving for as long as those costs last, and
when they move on, the layout chosen for them can run far slower than a fixed one until the
evidence brings the run back (a reversal, a hot region that moves on). Where the costs change
every few steps, each move lands just before they change again, and the controller chases them:
every move gains a step or two and loses more on the way back.

What the run shows. A fallback (`dynmo.controller.fallback`) that leaves a layout a rebalance
chose ends an episode whose cost the controller can measure: on the steps the moved layout ran
(the history since the move), its step time and the fallback's, both simulated under each
step's own costs. If the moved layout ran longer in total, the move was outpaced, and the time
it lost on the steps it was the slower one (`return_loss`) is what the run paid to come back.

The rule (`persists`). While the run has been outpaced within the last `horizon` steps, a move
to a layout not fixed before step 0 must expect to repay the way back (`way_back`): its saving
per step (under the forecast) times the time its cost pattern is expected to persist must
exceed the way back's price plus the migration. The price is the mean return loss of those
episodes, and at least BACK_STEPS steps (the fallbacks' quickest return) of the candidate's
excess step time over the current layout's on the steps before its pattern began: the run has
shown that its costs move on, and this is what they cost if they move back. The persistence is
the pattern's age (`age`: the number of latest steps on which the candidate has been faster
than the current layout), the estimate that needs no model of the dynamics: a pattern seen for
a steps is as likely to be in the first half of its life as in the second, so its median
remaining life is a (the Copernican, or Lindy, estimate). A run that was never outpaced moves
as before, and so does a change the model announces (its costs do not come back): the rule
reads only the run's own losses, so it costs nothing where the costs last. Pricing the way back
from the start (every run, outpaced or not) waited on lasting changes too, and was not kept
(docs/bench/controller-scenarios.md). Pure.
"""

from __future__ import annotations

from typing import Sequence


def return_loss(moved: Sequence[float], back: Sequence[float]) -> float:
    """The time the moved layout lost on its way back (seconds), if it was outpaced: the sum of
    its step time over the fallback's on the steps it was slower, when its total ran longer than
    the fallback's over the same steps; 0.0 where the move paid."""
    diff = [m - b for m, b in zip(moved, back)]
    return sum(d for d in diff if d > 0) if sum(diff) > 0 else 0.0


def age(gains: Sequence[float]) -> int:
    """The number of latest steps on which the candidate saved time over the current layout."""
    n = 0
    for g in reversed(gains):
        if g <= 0:
            break
        n += 1
    return n


# the steps a way back takes: the fallbacks' two-step rule (`fallback.far_faster`; one step only
# for a layout 5/3 times as slow as a fallback)
BACK_STEPS = 2


def way_back(current_before: Sequence[float], cand_before: Sequence[float], losses: Sequence[float]) -> float:
    """What the way back is expected to cost (seconds) once the run was outpaced (`losses`, the
    return losses of its recent outpaced moves; 0.0 where there are none): their mean, and at
    least BACK_STEPS steps of the candidate's excess step time over the current layout's on the
    steps before its cost pattern began (the costs coming back)."""
    if not losses:
        return 0.0
    excess = 0.0
    if current_before:
        excess = max(0.0, sum(c - o for o, c in zip(current_before, cand_before)) / len(current_before))
    return max(sum(losses) / len(losses), BACK_STEPS * excess)


def persists(saving_s: float, steps: int, back_s: float, migration_s: float) -> bool:
    """A move saving `saving_s` per step whose cost pattern has lasted `steps` steps repays the
    way back (`back_s`) and its migration; always where the way back costs nothing."""
    return back_s <= 0 or saving_s * steps > back_s + migration_s
