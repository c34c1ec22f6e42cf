"""`auto`'s defences against noise that live across steps: the confidence spread over the looks at
the same evidence, the window of an announced change, a large change's two steps restarting the
evidence, and each migration remembered when decided and judged once measured (undone if it
lost). The policy and its reasons are in the package docstring (`dynmo.controller`); the tests
themselves are `dynmo.controller.evidence` and `dynmo.controller.judge`.

`Safeguards` is a mixin of the `Controller`: it reads and updates the controller's state (`cfg`,
`history`, `observed`, `epoch`, `changed_at`, `jumps`, `suspect`, `large`, `margin`, `lost`,
`left`, `judge`, `proposal`, `searched`, `steady`) through its scoring
(`dynmo.controller.scoring.Scoring`). Pure.
"""

from __future__ import annotations

from statistics import median

from dynmo.controller import evidence
from dynmo.controller.decision import Decision
from dynmo.layout import Layout


class Safeguards:
    """Large changes, the confidence of the looks, the announced window, and the migration judge."""

    def _large_change(self, t: float, layout: Layout) -> None:
        """A step whose time departs from the forecast's by far more than the steps before it did
        (`evidence.large_change`), followed by a step that departs as far the same way, restarts
        the evidence at the first of them: the steps before describe another model. The forecast
        of before is kept, to prefer layouts that survive a reversal."""
        past = self.history_times([layout])[0]
        ref = median(past[-self.cfg.window:])
        rel = t / ref - 1 if ref > 0 else 0.0
        if self.suspect is not None:  # the step before departed far: does this one agree?
            ref0, sign, before = self.suspect
            self.suspect = None
            if evidence.confirms_large(t / ref0 - 1 if ref0 > 0 else 0.0, sign):
                first = self.history[-1]
                self.history.clear()
                self.history.append(first)
                self.large = before
                self.proposal = self.searched = self.steady = None
                self.epoch = self.observed - 1
                # as an announced change: nothing to judge across it, and a layout that lost
                # before may win now; the change's two steps are not the noise's spread
                self.judge.forget()
                self.lost.clear()
                self.jumps.pop()
                return
        elif evidence.large_change(rel, self.jumps, self.cfg.window):
            self.suspect = (ref, 1 if rel > 0 else -1, self.forecast())
        self.jumps.append(abs(rel))


    def confidence_now(self) -> float:
        """`balance.confidence` spread over the looks at the evidence since it last started afresh
        (the run's start, a migration, an announced change): the tests run at every step, on
        overlapping steps, and each block of EVIDENCE_STEPS steps is one more chance for noise
        to pass them, so the k-th block's tests run at 1 - (1 - confidence) / k (Bonferroni). A
        model that changes and says so, or a migration, starts it again at `confidence`."""
        blocks = max(1, -(-(self.observed - self.epoch) // evidence.EVIDENCE_STEPS))
        return 1 - (1 - self.cfg.confidence) / blocks


    def _announced_window(self) -> bool:
        """The window holds the first `window` steps from the announced change's step, or from
        the step after it (`evidence.announced`)."""
        since = self.observed - self.changed_at + 1  # steps observed from the change's step on
        return self.cfg.when == "auto" and self.changed_at > 0 and self.cfg.window <= since <= self.cfg.window + 1


    def _decided(self, step: int, current: Layout, d: Decision) -> Decision:
        """Remember what a decision left and what it predicted, to judge it once measured."""
        self.left[current.boundaries] = step
        self.judge.expect(current, d.layout, d.released > 0)
        self.via = d.reason
        return d

    def _judge_last_migration(self, current: Layout, layer_bytes: list[int], steps_left: int) -> Decision | None:
        """A migration that lost doubles the margin; a rebalance that lost is undone and its
        layout not chosen again for the horizon (a re-pack or a grow that lost only raises the
        margin: undoing one is a restart or a release, not a migration)."""
        judged = self.judge.verdict(current, self.cfg.min_gain, self.cfg.repack_tolerance, self._steps_under)
        if judged is None or not judged[1].lost:
            return None
        chk, v = judged
        self.margin = max(2 * self.margin, 0.02)
        if chk.repack or chk.old.num_stages != current.num_stages:
            return None
        self.lost[current.boundaries] = self.observed
        self.via = "revert"
        cost = self.migration_cost(layer_bytes, current, chk.old)
        return Decision(chk.old, 0.0, 0.0, (v.t_new - v.t_old) * max(0, min(self.cfg.horizon, steps_left)), cost,
                        predicted_step_s=v.t_old, current_step_s=v.t_new, reason="revert")
