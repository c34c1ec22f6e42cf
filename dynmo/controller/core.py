"""The `Controller`: the state of the DynMo loop's decisions, and `decide` as a sequence of named steps.

The policy and its reasons are in the package docstring (`dynmo.controller`); each step's
judgement lives in its own module (`evidence`, `judge`, `repack`, `migration`, `steptime`).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from statistics import median

from dynmo.balance import BalanceError, Problem
from dynmo.config import BalanceConfig
from dynmo.controller import candidates, evidence, migration
from dynmo.controller.evidence import CONFIRM
from dynmo.controller.judge import JUDGE, Judge
from dynmo.controller.migration import MIGRATION_BANDWIDTH, MIGRATION_FIXED_S
from dynmo.controller.repack import grow, repack
from dynmo.controller.scoring import HistoryTimes, Scoring
from dynmo.controller.steptime import StepModel
from dynmo.layout import Layout
from dynmo.plan import named_layout

__all__ = ["CONFIRM", "JUDGE", "RESTART_S", "Controller", "Decision"]

# the prior cost of growing back (checkpoint, relaunch, resume) until a restart was measured:
# generous, so that the first grow needs a lasting saving
RESTART_S = 60.0


@dataclass
class Decision:
    layout: Layout
    predicted_bottleneck: float  # seconds per microbatch on the slowest stage, new layout
    current_bottleneck: float  # same, current layout, under the same forecast
    predicted_gain_s: float  # over the horizon
    predicted_cost_s: float  # migration
    released: int = 0  # pipeline positions released by a re-pack (per replica)
    predicted_step_s: float = 0.0  # step time of the new layout (`step_time`), under the forecast
    current_step_s: float = 0.0  # the same, current layout
    reason: str = ""  # "rebalance", "repack" or "revert" (a migration that lost, undone)
    best_step_s: float = 0.0  # a re-pack: the step time of the best layout on every worker the run started with


@dataclass
class Controller(Scoring):
    """The decision core: a forecast of per-layer cost and the triggers of `dynmo.controller`.
    `cfg` holds the knobs (`[balance]`: when, every, balancer, window, min_gain, horizon, repack,
    repack_tolerance, memory_gb)."""

    cfg: BalanceConfig = field(default_factory=BalanceConfig)
    microbatches: int = 4
    schedule: str = "1f1b"  # the schedule that runs: layouts are compared in its simulated step time
    stages_per_rank: int | None = None  # multi-stage schedules; default: the schedule's
    # What the runtime measured about the workers and the memory (None = not modelled):
    speeds: list[float] | None = None  # per pipeline position, relative (1 = reference)
    transfer: list[float] | None = None  # per link j: seconds of one microbatch's activations j -> j+1
    transfer_back: list[float] | None = None  # per link j: seconds of its gradient j+1 -> j
    boundary_bytes: list[int] | None = None  # per cut after unit i: one microbatch's bytes (transfer prices the smallest)
    memory: list[float] | None = None  # per layer: bytes it needs on a worker (state + activations in flight)
    capacity: float | None = None  # bytes per worker; default: cfg.memory_gb (0 = no cap)
    # migration cost model: seconds = fixed_s + bytes / bandwidth, refitted from each migration
    fixed_s: float = MIGRATION_FIXED_S
    bandwidth: float = MIGRATION_BANDWIDTH
    history: deque = field(default_factory=deque)  # per-layer costs of the last steps (the evidence; the forecast reads `window`)
    pending: bool = False  # when = "dynamism": the model changed and no rebalance followed yet
    # `auto`'s defences against noise:
    margin: float = -1.0  # gain a decision needs; starts at cfg.min_gain, doubled after a migration that lost
    left: dict = field(default_factory=dict)  # layout boundaries -> step it was left at
    lost: set = field(default_factory=set)  # layouts a measured step time showed slower: never again
    judge: Judge = field(init=False)  # measured step times, and the last migration until judged
    model: StepModel = field(init=False)  # the objective: simulated step time of a layout
    peak_total: float = 0.0  # the largest forecast total cost seen (re-packing waits for the model to shrink)
    proposal: tuple | None = None  # (layout boundaries, observed steps then): a move awaiting fresh evidence
    observed: int = 0  # steps observed
    searched: Layout | None = None  # the last local search's best layout, a candidate until the next search
    widest: int = 0  # the most pipeline positions the run has had: re-packing's reference, growing's target
    restart_s: float = RESTART_S  # seconds a checkpoint restart onto more workers costs; re-fitted when measured
    steady: Layout | None = None  # auto: the optimum of every observed step's costs, searched once a window
    changed_at: int = 0  # auto: the observed steps when the model last announced a change (0: none pending)
    epoch: int = 0  # auto: the observed steps when the evidence last started afresh (`confidence_now`)
    jumps: deque = field(default_factory=lambda: deque(maxlen=evidence.JUMP_STEPS))  # auto: |step time / forecast's - 1| seen
    large: list | None = None  # auto: a large change's step restarted the evidence: the forecast of before it
    suspect: tuple | None = None  # auto: (reference step time, sign, forecast) of a step that departed far
    repack_memo: dict = field(default_factory=dict, repr=False)  # re-packing: each observed step's best step time
    # the history's steps' predicted step times, each (step, layout) simulated once
    cache: HistoryTimes = field(default_factory=HistoryTimes, init=False, repr=False)
    # auto: what was known of the layers before step 0, {"params": per-layer parameters, "flops":
    # per-layer nominal multiply-adds} (either may be missing): their layouts and uniform's are
    # candidates beside the balancer's, so that a start on one of them is judged against the
    # others on measured steps rather than left for one noisy forecast's optimum
    priors: dict = field(default_factory=dict)
    prior_memo: dict = field(default_factory=dict, repr=False)  # stages -> the priors' layouts

    def __post_init__(self) -> None:
        if self.cfg.window < 1:
            raise ValueError("balance.window must be >= 1")
        if self.capacity is None and self.cfg.memory_gb > 0:
            self.capacity = self.cfg.memory_gb * 2**30
        self.history = deque(maxlen=max(self.cfg.window, evidence.EVIDENCE_STEPS))
        self.judge = Judge(self.cfg.window)
        self.model = StepModel(self.schedule, self.stages_per_rank)
        if self.margin < 0:
            self.margin = self.cfg.min_gain

    def dynamism(self) -> None:
        """The model's work changed this step: costs from before it no longer apply."""
        if self.cfg.when == "dynamism":
            self.history.clear()
            self.pending = True

    def observe(self, layer_costs: list[float], step_s: float | None = None, changed: bool = False,
                layout: Layout | None = None) -> None:
        """One step's per-layer costs, and, if known, its measured step time and the layout it
        ran on. `changed`: the model changed in this step (a dynamism event)."""
        large = self.cfg.when == "auto" and layout is not None and len(self.history) >= self.cfg.window
        judged = step_s is not None and step_s > 0 and layout is not None
        # the step's simulated time on the layout it ran on, once: large changes and the judge read it
        t_step = self._step_under(layer_costs, layout) if large or judged else 0.0
        if large:
            self._large_change(t_step, layout)
        self.history.append(list(layer_costs))
        self.cache.measured(self.history[-1], (self.model.fwd_share, self.model.wgrad_share))
        self.observed += 1
        if len(self.history) >= self.cfg.window:
            self.peak_total = max(self.peak_total, sum(self.forecast()))
        if changed:
            self.changed_at = self.observed  # the changed model's first window may move on its own evidence
            self.epoch = self.observed - 1
            self.judge.forget()  # the step time changed for another reason: nothing to judge
            # a standing proposal stays: its fresh steps, on the changed model, confirm it or not
            # (dropping it here let a model that changes every 5 steps outrun every confirmation)
            self.lost.clear()  # a layout that lost on the old model may win on the new one
        if judged and t_step > 0:
            self.judge.observe(step_s / t_step, layer_costs)

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

    def observe_migration(self, nbytes: int, seconds: float) -> None:
        """Refit the migration cost model from a measured migration."""
        self.fixed_s, self.bandwidth = migration.refit(self.fixed_s, self.bandwidth, nbytes, seconds)

    def applied(self, microbatches: int) -> None:
        """A decision was applied (the run now has `microbatches` per replica): costs and step
        times measured under the old layout include its stage effects, and a proposal made
        against it no longer applies."""
        self.history.clear()
        self.judge.step_times.clear()
        self.proposal = None
        self.searched = self.steady = None
        self.changed_at = 0
        self.epoch = self.observed
        self.large = self.suspect = None
        self.microbatches = microbatches

    def forecast(self) -> list[float] | None:
        """Per-layer median of the last `window` steps' costs."""
        if not self.history:
            return None
        return [median(col) for col in zip(*list(self.history)[-self.cfg.window:])]

    def migration_cost(self, layer_bytes: list[int], current: Layout, new: Layout) -> float:
        return migration.migration_cost(self.fixed_s, self.bandwidth, layer_bytes, current, new)

    def decide(self, step: int, current: Layout, layer_bytes: list[int], steps_left: int) -> Decision | None:
        """judge -> trigger -> forecast -> re-pack -> propose (with `auto`'s evidence)."""
        c = self.cfg
        self.widest = max(self.widest, current.num_stages)
        # `every` is the paper's fixed frequency: the user's schedule, not judged
        revert = self._judge_last_migration(current, layer_bytes, steps_left) if c.when not in ("never", "every") else None
        if revert is not None:
            return revert
        if not self._triggered(step):
            return None
        costs = self.forecast()
        if costs is not None and self.large is not None and c.when == "auto":
            return self._after_large_change(step, costs, current, layer_bytes, steps_left)
        if costs is None or len(self.history) < c.window and c.when == "auto":
            return None
        if c.repack and current.num_stages < self.widest:
            d = self._grow(step, costs, current, layer_bytes, steps_left)
            if d is not None:
                return d
        if c.repack and current.num_stages > 1:
            d = self._repack(step, costs, current, layer_bytes, steps_left)
            if d is not None:
                return d
        return self._rebalance(step, costs, current, layer_bytes, steps_left)

    def _triggered(self, step: int) -> bool:
        """`every`'s period; `dynamism`'s window after a change, once per change."""
        c = self.cfg
        if c.when == "never" or c.when == "every" and (step == 0 or step % c.every):
            return False
        if c.when == "dynamism":
            if not self.pending or len(self.history) < c.window:
                return False
            self.pending = False
        return True

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

    def confidence_now(self) -> float:
        """`balance.confidence` spread over the looks at the evidence since it last started afresh
        (the run's start, a migration, an announced change): the tests run at every step, on
        overlapping steps, and each block of EVIDENCE_STEPS steps is one more chance for noise
        to pass them, so the k-th block's tests run at 1 - (1 - confidence) / k (Bonferroni). A
        model that changes and says so, or a migration, starts it again at `confidence`."""
        blocks = max(1, -(-(self.observed - self.epoch) // evidence.EVIDENCE_STEPS))
        return 1 - (1 - self.cfg.confidence) / blocks

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

    def _announced_window(self) -> bool:
        """The window holds the first `window` steps from the announced change's step, or from
        the step after it (`evidence.announced`)."""
        since = self.observed - self.changed_at + 1  # steps observed from the change's step on
        return self.cfg.when == "auto" and self.changed_at > 0 and self.cfg.window <= since <= self.cfg.window + 1

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
                    horizon: int, layer_bytes: list[int]) -> Decision:
        loads = problem.loads_of_assignment
        return self._decided(step, current, Decision(
            new, max(loads(new.owner())), max(loads(current.owner())), (t_now - t_new) * horizon,
            self.migration_cost(layer_bytes, current, new), predicted_step_s=t_new, current_step_s=t_now,
            reason="rebalance"))

    def _decided(self, step: int, current: Layout, d: Decision) -> Decision:
        """Remember what a decision left and what it predicted, to judge it once measured."""
        self.left[current.boundaries] = step
        self.judge.expect(current, d.layout, d.released > 0)
        return d

    def _judge_last_migration(self, current: Layout, layer_bytes: list[int], steps_left: int) -> Decision | None:
        """A migration that lost doubles the margin; a rebalance that lost is undone and its
        layout never chosen again in the run (a re-pack or a grow that lost only raises the
        margin: undoing one is a restart or a release, not a migration)."""
        judged = self.judge.verdict(current, self.cfg.min_gain, self.cfg.repack_tolerance, self._steps_under)
        if judged is None or not judged[1].lost:
            return None
        chk, v = judged
        self.margin = max(2 * self.margin, 0.02)
        if chk.repack or chk.old.num_stages != current.num_stages:
            return None
        self.lost.add(current.boundaries)
        cost = self.migration_cost(layer_bytes, current, chk.old)
        return Decision(chk.old, 0.0, 0.0, (v.t_new - v.t_old) * max(0, min(self.cfg.horizon, steps_left)), cost,
                        predicted_step_s=v.t_old, current_step_s=v.t_new, reason="revert")

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
