"""The `Controller`'s proposals: the balancer's layout for the forecast and its candidates (a
previous local search's result, the priors' layouts, the optimum of every observed step), each
worth its margin and its migration and, under `auto`, supported by the evidence; and the layout
two steps of a large change call for. The policy and its reasons are in the package docstring
(`dynmo.controller`); the evidence's tests are `dynmo.controller.evidence`.

`Rebalancing` is a mixin of the `Controller`: it reads the controller's state (`cfg`, `history`,
`observed`, `margin`, `lost`, `left`, `proposal`, `searched`, `steady`, `large`, `priors`,
`prior_memo`) and its scoring (`dynmo.controller.scoring.Scoring`), and hands each decision to
`_decided` (`dynmo.controller.safeguards.Safeguards`). Pure.
"""

from __future__ import annotations

from statistics import median

from dynmo.balance import BalanceError, Problem
from dynmo.controller import candidates, evidence, persistence
from dynmo.controller.decision import Decision
from dynmo.layout import Layout
from dynmo.plan import named_layout


class Rebalancing:
    """`decide`'s propose and evidence steps: a new layout on the current pipeline positions."""

    def _rebalance(self, step: int, costs: list[float], current: Layout, layer_bytes: list[int],
                   steps_left: int) -> Decision | None:
        """The balancer's layout for the forecast, if the step falls by the margin and repays the
        migration over the horizon; with `auto`, only on the window's and fresh steps' evidence,
        and failing that, the optimum of all the observed steps (`steady`) on all their evidence."""
        c = self.cfg
        problem = self.problem(costs, current.num_stages, current)
        # the local search runs once a window; in between its last result stays a candidate
        search = self.observed % c.window == 0 or self.searched is None
        known = (self.searched,) if self.searched is not None and not search else ()
        if c.when == "auto":
            known = (*known, *self.prior_layouts(problem, current.num_stages))
        scored: dict[tuple, float] = {}  # the candidates' step times, current's included

        def steps_of(pr: Problem, layouts: list[Layout]) -> list[float]:
            times = self.steps_s(pr, layouts)
            scored.update(zip((lay.boundaries for lay in layouts), times))
            return times

        new, t_new = candidates.best_layout(problem, c.balancer, current, steps_of, search, known)
        if search:
            self.searched = new
        t_now = scored[current.boundaries] if current.boundaries in scored else self.step_s(problem, current)
        horizon = max(0, min(c.horizon, steps_left))

        def options():
            yield new, t_now, t_new
            if c.when == "auto" and len(self.history) > c.window:
                yield self._steady_option(current, search)
            if c.when == "auto" and self.proposal is not None and self.proposal[0] != new.boundaries:
                yield self._standing_option(problem, current, t_now, scored)  # `new` itself was just judged

        rejected = False  # a candidate failed the margin, the repayment or the evidence
        confidence = self.confidence_now()
        for cand, t_old, t_cand in options():
            if cand is None or cand == current or cand.boundaries in self.lost:
                continue
            rejected = True
            margin = self.margin
            if c.when == "auto" and step - self.left.get(cand.boundaries, -10**9) <= c.horizon:
                margin *= 2  # going back to a layout left within the horizon needs twice the evidence
            if t_old - t_cand < margin * t_old or (t_old - t_cand) * horizon <= self.migration_cost(layer_bytes, current, cand):
                continue
            if c.when == "auto" and not (cand is new and self._announced_window()) \
                    and not self._outlasts(step, problem, current, cand, t_old - t_cand, layer_bytes):
                continue  # an announced change says what changed: its costs do not come back
            if c.when != "auto":
                return self._rebalanced(step, problem, current, cand, t_old, t_cand, horizon, layer_bytes)
            if cand is new and self._announced_window() and evidence.announced(
                    self.per_step_gains(current, cand), c.window, margin, confidence):
                self.changed_at, self.proposal = 0, None  # once per change
                return self._rebalanced(step, problem, current, cand, t_old, t_cand, horizon, layer_bytes)
            if not evidence.supported(self.per_step_gains(current, cand), c.window, margin, confidence):
                continue
            chosen, self.proposal = evidence.confirmed(self.proposal, self.observed, len(self.history), c.window,
                                                       current, cand, margin, lambda p: self.per_step_gains(current, p),
                                                       c.confirm, confidence)
            if chosen is None:
                return None
            if chosen != cand:  # an earlier proposal, confirmed: its step times under this forecast
                t_old = t_now
                t_cand = scored[chosen.boundaries] if chosen.boundaries in scored else self.step_s(problem, chosen)
            return self._rebalanced(step, problem, current, chosen, t_old, t_cand, horizon, layer_bytes)
        if rejected:
            self.proposal = None
        return None

    def _outlasts(self, step: int, problem: Problem, current: Layout, cand: Layout, saving_s: float,
                  layer_bytes: list[int]) -> bool:
        """The move to `cand` repays the way back over the time its cost pattern is expected to
        persist, once moves were outpaced within the horizon (`persistence`); a layout fixed
        before step 0 carries no such risk."""
        recent = [loss for at, loss in self.outpaced if step - at <= self.cfg.horizon]
        if not recent or self.start == cand or cand in self.prior_layouts(problem, current.num_stages):
            return True
        old_t, new_t = self.history_times([current, cand])
        steps = persistence.age(evidence.gains(old_t, new_t))
        back = persistence.way_back(old_t[:len(old_t) - steps], new_t[:len(new_t) - steps], recent)
        return persistence.persists(saving_s, steps, back, self.migration_cost(layer_bytes, current, cand))

    def prior_layouts(self, problem: Problem, stages: int) -> tuple[Layout, ...]:
        """uniform's layout and those of `priors` on `stages` stages, each within the memory cap."""
        if stages not in self.prior_memo:
            units = len(problem.costs)
            lays = [named_layout("uniform", units, stages)] if units >= stages else []
            for name, costs in self.priors.items():
                if costs is not None and len(costs) == units >= stages:
                    try:
                        lays.append(named_layout(name, units, stages, layer_params=costs, flops=costs))
                    except BalanceError:  # DeepSpeed's partition refuses problems beyond its size limit
                        continue
            self.prior_memo[stages] = tuple(dict.fromkeys(lays))
        return tuple(lay for lay in self.prior_memo[stages] if candidates.fits(problem, lay))


    def _after_large_change(self, step: int, costs: list[float], current: Layout, layer_bytes: list[int],
                            steps_left: int) -> Decision | None:
        """Two steps of a large change are evidence enough (`evidence.large_change`): the best
        layout under their costs, if it saves the margin and repays the migration; among the
        layouts within the margin of it, the one fastest under the forecast of before the change,
        so that a reversal of the change finds the run on a layout still good. Once: the
        following steps are judged by the usual evidence."""
        before, self.large = self.large, None
        problem = self.problem(costs, current.num_stages, current)
        best, t_best = candidates.best_layout(problem, self.cfg.balancer, current, self.steps_s)
        near = [lay for lay in [best, *candidates.neighbours(problem, best)]
                if lay != current and lay.boundaries not in self.lost]
        times = self.steps_s(problem, near + [current])  # one pass: the candidates and the current layout
        t_now = times.pop()
        near = [(lay, t) for lay, t in zip(near, times) if t <= t_best * (1 + self.margin)]
        if not near:
            return None
        new, t_cand = near[0]
        if before is not None and len(near) > 1:
            old = self.steps_s(self.problem(before, current.num_stages, current), [lay for lay, _ in near])
            new, t_cand = near[min(range(len(near)), key=lambda i: old[i])]
        horizon = max(0, min(self.cfg.horizon, steps_left))
        if t_now - t_cand < self.margin * t_now or (t_now - t_cand) * horizon <= self.migration_cost(layer_bytes, current, new):
            return None
        return self._rebalanced(step, problem, current, new, t_now, t_cand, horizon, layer_bytes)


    def _standing_option(self, problem: Problem, current: Layout, t_now: float,
                         scored: dict) -> tuple[Layout | None, float, float]:
        """(the standing proposal, the current layout's and its step time under the forecast): a
        proposal is judged on its own fresh steps (`evidence.confirmed`), so the window's optimum
        flipping to a layout of the same step time, or failing its evidence on one step, does not
        drop it before they came (a lasting gain of 10-20 % under a committed trace's noise was
        proposed four times and moved on none, 15 steps after the change)."""
        proposed = Layout(self.proposal[0])
        if proposed.num_stages != current.num_stages:
            return None, 0.0, 0.0
        t = scored[proposed.boundaries] if proposed.boundaries in scored else self.step_s(problem, proposed)
        return proposed, t_now, t

    def _steady_option(self, current: Layout, search: bool) -> tuple[Layout | None, float, float]:
        """(the optimum of the per-layer median over every observed step, the mean step time of
        `current` and of it over those steps). A gain of a few percent under noise needs more
        steps than the window to stand out, and the window's own optimum moves with the window's
        noise; this one holds still while the evidence gathers. Searched once a window."""
        if search or self.steady is None or self.steady.num_stages != current.num_stages:
            long = [median(col) for col in zip(*self.history)]
            self.steady, _ = candidates.best_layout(self.problem(long, current.num_stages, current), self.cfg.balancer,
                                                    current, self.steps_s, search=True)
        if self.steady == current:
            return None, 0.0, 0.0
        old_t, new_t = self.history_times([current, self.steady])
        return self.steady, sum(old_t) / len(old_t), sum(new_t) / len(new_t)

    def _rebalanced(self, step: int, problem: Problem, current: Layout, new: Layout, t_now: float, t_new: float,
                    horizon: int, layer_bytes: list[int], reason: str = "rebalance") -> Decision:
        loads = problem.loads_of_assignment
        return self._decided(step, current, Decision(
            new, max(loads(new.owner())), max(loads(current.owner())), (t_now - t_new) * horizon,
            self.migration_cost(layer_bytes, current, new), predicted_step_s=t_new, current_step_s=t_now,
            reason=reason))
