"""The `Controller`'s re-pack and grow: the fewest pipeline positions within the tolerance once
the model shrank, and the released workers back through a checkpoint restart when the packed
layout no longer holds it (the judgement is `dynmo.controller.repack`; the policy, the package
docstring, `dynmo.controller`).

`Packing` is a mixin of the `Controller`: it reads the controller's state (`cfg`, `history`,
`peak_total`, `microbatches`, `widest`, `restart_s`, `repack_memo`) and its scoring
(`dynmo.controller.scoring.Scoring`), and hands each decision to `_decided`
(`dynmo.controller.safeguards.Safeguards`). Pure.
"""

from __future__ import annotations

from dynmo.controller.decision import Decision
from dynmo.controller.repack import grow, repack
from dynmo.layout import Layout


class Packing:
    """`decide`'s re-pack step, its mirror the grow, and the restart's measured cost."""

    def _grow(self, step: int, costs: list[float], current: Layout, layer_bytes: list[int],
              steps_left: int) -> Decision | None:
        """The released workers back, through a checkpoint restart (`repack.grow`)."""
        horizon = max(0, min(self.cfg.horizon, steps_left))
        self._prune_memo()
        cost = self.restart_s  # the layers come back from the checkpoint the restart reads
        g = grow(self.cfg, costs, current, self.widest, self.problem, self.steps_s, list(self.history), horizon, cost,
                 self.repack_memo)
        if g is None:
            return None
        problem = self.problem(costs, self.widest)
        return self._decided(step, current, Decision(
            g.layout, max(problem.loads_of_assignment(g.layout.owner())),
            max(self.problem(costs, current.num_stages, current).loads_of_assignment(current.owner())),
            (g.current_step_s - g.step_s) * horizon, cost, predicted_step_s=g.step_s, current_step_s=g.current_step_s,
            reason="grow"))

    def _prune_memo(self) -> None:
        """What the re-pack's and the grow's memo holds for steps that left the history goes."""
        keep = {tuple(c) for c in self.history}
        self.repack_memo = {key: t for key, t in self.repack_memo.items() if key[0] in keep}

    def observe_restart(self, seconds: float) -> None:
        """A grow's restart was measured: the next one is priced at it."""
        if seconds > 0:
            self.restart_s = seconds

    def _repack(self, step: int, costs: list[float], current: Layout, layer_bytes: list[int],
                steps_left: int) -> Decision | None:
        self._prune_memo()
        r = repack(self.cfg, costs, current, self.peak_total, self.problem, self.steps_s, list(self.history),
                   self.microbatches, self.widest, self.repack_memo)
        if r is None:
            return None
        problem = self.problem(costs, current.num_stages, current)
        t_now = self.step_s(problem, current)
        gain = (t_now - r.step_s) * max(0, min(self.cfg.horizon, steps_left))
        return self._decided(step, current, Decision(
            r.layout, r.bottleneck, max(problem.loads_of_assignment(current.owner())), gain,
            self.migration_cost(layer_bytes, current, r.layout), released=current.num_stages - r.layout.num_stages,
            predicted_step_s=r.step_s, current_step_s=t_now, reason="repack", best_step_s=r.best_step_s))
