"""When and how to rebalance: the DynMo loop's decisions (paper Algorithm 1, automated). Pure.

The runtime feeds the controller each step's measured per-layer cost; the controller answers
with a new layout or nothing. No torch here, so the simulator can replay the same policy.

Forecast: per-layer cost is the median of the last `window` steps. A median ignores one-step
spikes (timing noise, a GC pause) and follows a real step change after ceil(window / 2)
steps, which is what per-step dynamism (MoE, MoD) needs.

Triggers (`when`):
  never    keep the initial layout;
  every    rebalance every `every` steps (the paper's fixed frequency);
  dynamism rebalance once after each step that changed the model (a pruning step, a block
           frozen, the skew switched on: events of type "dynamism"), from the cost measured
           over the `window` steps after the change (the paper's Algorithm 1: profile, then
           rebalance; one step's profile on a busy machine can be off by half);
  auto     rebalance when the layout is predicted to pay off, and the evidence says the gain
           is not noise (below).
Whatever the trigger, a rebalance must cut the predicted step time by the margin (`min_gain`)
and repay its migration over the horizon; `auto` and `dynamism` decisions are judged by the
measured step time afterwards (below), `every` (the user's fixed schedule) is not.

Step time. Layouts are compared by the step time they predict (`step_time`): with stage loads
s_j per microbatch (link times and worker speeds included), a GPipe/1F1B step takes
(m - 1) x max_j s_j + sum_j s_j -- one microbatch through every stage (fill and drain), the
rest at the pace of the slowest stage. The saving of a rebalance over the next `horizon` steps
must exceed the migration's predicted cost (fixed + bytes / bandwidth, re-fitted from every
migration measured).

`auto` against noise. A loaded machine, a straggler microbatch or per-step dynamism (MoE
routing) make each step's costs noisy, and the layout that is optimal for a forecast fitted
to that noise looks better than it is (the winner's curse). So `auto` moves layers only when
  - the forecast (per-layer median of the last `window` steps) saves `min_gain` of the step time;
  - the saving shows on nearly every observed step of the window, each evaluated under its own
    costs (all of a window of up to 4 steps, 80% of a longer one): one slow step, or a short
    slow phase of a worker, is not a change in the model, while a real step change shows on
    every step after it;
  - the proposed move is confirmed on 2 fresh steps (`_confirmed`), so a real change is acted
    on `window` + 2 steps after it happened (5 by default);
  - going back to a layout left within the horizon needs twice the gain (no ping-pong);
  - and after each migration the controller judges it by the measured step time
    (`_judge_last_migration`): a migration that made the step slower by more than `min_gain`
    is undone, its layout is never chosen again in the run, and the margin doubles.
Replayed figures and the trade-off between reaction time and false moves are in
docs/controller.md.

Re-packing (`repack=True`, paper Algorithm 1's optional step): when the model has shrunk (the
forecast total cost fell by `min_gain` below the largest seen: workers never come back, so a
model that may still grow keeps them), the controller packs the layers onto the fewest
pipeline positions 0..k-1 whose predicted step time stays within `repack_tolerance` of the
best all-worker layout's, on the forecast and on nearly every step of the window; the runtime
releases the rest. Its event reports both step times. With identical workers any k of them
are equivalent, so keeping the prefix loses nothing; with measured per-worker speeds the
balancer gets the kept workers' speeds.

Re-tuning microbatches after a re-pack (`retune_microbatches`): the paper's DynMo keeps the
microbatch count (its appendix E.4 names this as a gap). A shorter pipeline needs fewer
microbatches to hide its fill/drain bubble, and fewer, larger microbatches cost less fixed
per-microbatch overhead. We pick the fewest microbatches m' that divide the local batch and
keep both the schedule's inherent bubble, (p'-1)/(m'+p'-1), and the activations a 1F1B stage
holds in flight, min(m', p')/m' of the local batch, no worse than before the re-pack.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field, replace
from statistics import median

from dynmo.balance import Problem, balance
from dynmo.config import BalanceConfig
from dynmo.layout import Layout

# Migration cost model before the first migration is measured: seconds = fixed + bytes / bandwidth
MIGRATION_FIXED_S = 0.01  # ~10 ms seen here
MIGRATION_BANDWIDTH = 1e9  # bytes/s
CONFIRM = 2  # `auto`: fresh steps that must confirm a proposed move (see Controller._confirmed)
# windows of measured step times before and after a migration that judge it: a step's time
# carries its straggler microbatches, which the per-layer medians do not, so the judge reads
# the fastest steps of two windows
JUDGE = 2


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
    best_step_s: float = 0.0  # a re-pack: the step time of the best layout on all of today's workers


def step_time(loads: list[float], microbatches: int) -> float:
    """Seconds of one GPipe/1F1B step whose stages take `loads` per microbatch (link times
    included): one microbatch passes every stage (the fill and the drain), the other m - 1
    follow at the pace of the slowest stage. Exact for equal stages, and what the simulator's
    engine gives within its op overheads for unequal ones; the controller compares layouts,
    and re-packing keeps its tolerance, in this step time rather than in one stage's load."""
    return (microbatches - 1) * max(loads) + sum(loads)


def retune_microbatches(local_batch: int, microbatches: int, stages: int, new_stages: int) -> int:
    """Fewest microbatches for `new_stages` stages that keep the inherent bubble and the
    in-flight activations of `microbatches` on `stages` stages (see the module docstring)."""
    bubble = (stages - 1) / (microbatches + stages - 1)
    held = min(microbatches, stages) / microbatches
    for m in range(1, local_batch + 1):
        if local_batch % m:
            continue
        if (new_stages - 1) / (m + new_stages - 1) <= bubble + 1e-12 and min(m, new_stages) / m <= held + 1e-12:
            return m
    return microbatches


@dataclass
class Controller:
    """The decision core: a forecast of per-layer cost and the triggers above. `cfg` holds the
    knobs (`[balance]`: when, every, balancer, window, min_gain, horizon, repack,
    repack_tolerance, memory_gb)."""

    cfg: BalanceConfig = field(default_factory=BalanceConfig)
    microbatches: int = 4
    # What the runtime measured about the workers and the memory (None = not modelled):
    speeds: list[float] | None = None  # per pipeline position, relative (1 = reference)
    # per stage boundary j: seconds stage j spends sending one microbatch's activations to j+1, and
    # seconds stage j+1 spends sending its gradient back (each charged to its sender)
    transfer: list[float] | None = None
    transfer_back: list[float] | None = None
    memory: list[float] | None = None  # per layer: bytes it needs on a worker (state + activations in flight)
    capacity: float | None = None  # bytes per worker; default: cfg.memory_gb (0 = no cap)
    # migration cost model: seconds = fixed_s + bytes / bandwidth, refitted from each migration
    fixed_s: float = MIGRATION_FIXED_S
    bandwidth: float = MIGRATION_BANDWIDTH
    history: deque = field(default_factory=deque)
    pending: bool = False  # when = "dynamism": the model changed and no rebalance followed yet
    # `auto`'s defences against noise (see the module docstring):
    margin: float = -1.0  # gain a decision needs; starts at cfg.min_gain, doubled after a migration that lost
    left: dict = field(default_factory=dict)  # layout boundaries -> step it was left at
    lost: set = field(default_factory=set)  # layouts a measured step time showed slower: never again
    # measured step time / the step time the model predicts for the layout that ran, per step
    # since the last decision: how far the model is off for that layout (the schedule's own
    # effects, what a step does besides the pipeline)
    step_times: deque = field(default_factory=deque)
    check: dict | None = None  # the last migration, until its measured step time is judged
    peak_total: float = 0.0  # the largest forecast total cost seen (re-packing waits for the model to shrink)
    proposal: tuple | None = None  # (layout boundaries, observed steps then): a move awaiting fresh evidence
    observed: int = 0  # steps observed

    def __post_init__(self) -> None:
        if self.cfg.window < 1:
            raise ValueError("balance.window must be >= 1")
        if self.capacity is None and self.cfg.memory_gb > 0:
            self.capacity = self.cfg.memory_gb * 2**30
        self.history = deque(maxlen=self.cfg.window)
        self.step_times = deque(maxlen=JUDGE * self.cfg.window)
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
        self.history.append(list(layer_costs))
        self.observed += 1
        if len(self.history) == self.history.maxlen:
            self.peak_total = max(self.peak_total, sum(self.forecast()))
        if changed:
            self.check = None  # the step time changed for another reason: nothing to judge
            self.proposal = None
            self.lost.clear()  # a layout that lost on the old model may win on the new one
            self.step_times.clear()
        if step_s is not None and step_s > 0 and layout is not None:
            model = self.step_s(self.problem(layer_costs, layout.num_stages, layout), layout)
            if model > 0:
                self.step_times.append(step_s / model)
                if self.check is not None:
                    self.check["after"].append((step_s / model, list(layer_costs)))

    def forecast(self) -> list[float] | None:
        if not self.history:
            return None
        return [median(col) for col in zip(*self.history)]

    def observe_migration(self, nbytes: int, seconds: float) -> None:
        """Refit the cost model: keep the fixed part, fit bandwidth to what was seen."""
        if nbytes > 0 and seconds > self.fixed_s:
            self.bandwidth = nbytes / (seconds - self.fixed_s)
        elif seconds > 0:
            self.fixed_s = seconds

    def migration_cost(self, layer_bytes: list[int], current: Layout, new: Layout) -> float:
        moved = current.moves_to(new)
        return self.fixed_s + sum(layer_bytes[m.layer] for m in moved) / self.bandwidth if moved else 0.0

    def step_s(self, problem: Problem, layout: Layout) -> float:
        """Predicted step time of `layout` under `problem`'s costs (`step_time`)."""
        return step_time(problem.loads_of_assignment(layout.owner()), self.microbatches)

    def problem(self, costs: list[float], stages: int, current: Layout | None = None) -> Problem:
        """The balancing problem for the first `stages` pipeline positions."""
        return Problem(
            costs=costs,
            stages=stages,
            memory=self.memory if self.capacity else None,
            capacity=self.capacity or None,
            speeds=self.speeds[:stages] if self.speeds else None,
            transfer=self.transfer[: stages - 1] if self.transfer and stages > 1 else None,
            transfer_back=self.transfer_back[: stages - 1] if self.transfer_back and stages > 1 else None,
            current=list(current.boundaries) if current is not None else None,
        )

    def decide(self, step: int, current: Layout, layer_bytes: list[int], steps_left: int) -> Decision | None:
        c = self.cfg
        if c.when == "never":
            return None
        if c.when != "every":  # `every` is the paper's fixed frequency: the user's schedule, not judged
            revert = self._judge_last_migration(current, layer_bytes, steps_left)
            if revert is not None:
                return revert
        if c.when == "every" and (step == 0 or step % c.every):
            return None
        if c.when == "dynamism":
            # profile the changed model for a window of steps (one step on a busy machine can be
            # off by half), then rebalance once
            if not self.pending or len(self.history) < c.window:
                return None
            self.pending = False
        costs = self.forecast()
        if costs is None or len(self.history) < c.window and c.when == "auto":
            return None
        if c.repack and current.num_stages > 1:
            d = self._repack(step, costs, current, layer_bytes, steps_left)
            if d is not None:
                return d
        problem = self.problem(costs, current.num_stages, current)
        result = balance(problem, c.balancer)
        if result.boundaries is None:
            raise ValueError(f"balancer {c.balancer!r} gave a non-contiguous layout; pipelines need a contiguous one")
        new = Layout(tuple(result.boundaries))
        if new == current or new.boundaries in self.lost:
            return None
        now = max(problem.loads_of_assignment(current.owner()))
        t_now = self.step_s(problem, current)
        t_new = self.step_s(problem, new)
        gain = (t_now - t_new) * max(0, min(c.horizon, steps_left))
        cost = self.migration_cost(layer_bytes, current, new)
        # every trigger: the step must fall by the margin and repay the migration over the horizon
        margin = self.margin
        if c.when == "auto" and step - self.left.get(new.boundaries, -10**9) <= c.horizon:
            margin *= 2  # going back to a layout left within the horizon needs twice the evidence
        if t_now - t_new < margin * t_now or gain <= cost:
            self.proposal = None
            return None
        if c.when == "auto":
            if not self.consistent(current, new, margin):
                self.proposal = None
                return None
            new = self._confirmed(current, new, margin)
            if new is None:
                return None
            t_new = self.step_s(problem, new)
            gain = (t_now - t_new) * max(0, min(c.horizon, steps_left))
            cost = self.migration_cost(layer_bytes, current, new)
            result = replace(result, bottleneck=max(problem.loads_of_assignment(new.owner())))
        return self._decided(step, current, Decision(new, result.bottleneck, now, gain, cost,
                                                     predicted_step_s=t_new, current_step_s=t_now, reason="rebalance"))

    def _decided(self, step: int, current: Layout, d: Decision) -> Decision:
        """Remember what a decision left and what it predicted, to judge it once measured."""
        self.left[current.boundaries] = step
        self.check = {"old": current, "new": d.layout, "before": list(self.step_times), "after": [],
                      "ratio": d.predicted_step_s / d.current_step_s if d.current_step_s > 0 else 1.0,
                      "repack": d.released > 0}
        return d

    def _confirmed(self, current: Layout, new: Layout, margin: float) -> Layout | None:
        """The layout to move to once a proposal is confirmed, else None (and `new` proposed).

        The window that proposes a move also chose it (the optimum of the window's forecast),
        so its gain there is biased up; only steps that played no part in choosing it are fair
        evidence. A proposal is confirmed when the mean gain of CONFIRM steps observed after it
        (no more than the window holds) clears the margin. Under noise the forecast's optimum
        may flip between layouts of the same bottleneck: the proposal stands until its own
        fresh steps judge it."""
        if self.proposal is not None:
            proposed, since = Layout(self.proposal[0]), self.proposal[1]
            fresh = min(self.observed - since, len(self.history))
            if fresh < min(CONFIRM, self.cfg.window):
                return None
            self.proposal = None
            if proposed.num_stages == current.num_stages and proposed != current:
                gains = self.per_step_gains(current, proposed)[-fresh:]
                if sum(gains) / len(gains) >= margin:
                    return proposed
        self.proposal = (new.boundaries, self.observed)
        return None

    def consistent(self, current: Layout, new: Layout, margin: float) -> bool:
        """Whether `new` beats `current` by `margin` of the step time on nearly every observed
        step of the window, each step's costs evaluated on their own: all of a window of up to 4
        steps, all but one of 5 to 9, and so on (80%). One step a noisy machine slowed, or a
        forecast fitted to the window's noise (the winner's curse), does not move layers; a real
        change in cost shows on every step after it."""
        gains = self.per_step_gains(current, new)
        need = -(-len(gains) * 4 // 5)  # ceil(0.8 n)
        return sum(g >= margin for g in gains) >= need

    def per_step_gains(self, current: Layout, new: Layout) -> list[float]:
        """Per observed step of the window: the relative step-time saving of `new` over `current`
        under that step's own costs."""
        gains = []
        for costs in self.history:
            problem = self.problem(costs, current.num_stages, current)
            old_t = self.step_s(problem, current)
            new_t = self.step_s(problem, new)
            gains.append((old_t - new_t) / old_t if old_t > 0 else 0.0)
        return gains

    def per_step_gain(self, current: Layout, new: Layout) -> float:
        """Median of `per_step_gains`."""
        gains = self.per_step_gains(current, new)
        return median(gains) if gains else 0.0

    def _judge_last_migration(self, current: Layout, layer_bytes: list[int], steps_left: int) -> Decision | None:
        """Once JUDGE windows of steps ran on the last migration's layout, judge it by measurement.

        Steps before and after a migration differ in more than the layout (the run speeds up
        as it warms, per-step dynamism, the machine's load), so their step times are not
        compared directly. Each layout's step time is predicted under the *after* steps' own
        costs by the step-time model, scaled by how far the model was off for that layout when
        it ran (measured / predicted: before the migration for the old layout, after it for
        the new). If the new layout's comes out slower than the old's (beyond the re-pack's
        tolerance, for a re-pack), the migration lost: the margin doubles and a rebalance is
        undone."""
        chk = self.check
        # the first step on a new layout pays one-off costs (rebuilt stages warm up): leave it out
        if chk is None or chk["new"] != current or len(chk["after"]) < JUDGE * self.cfg.window + 1 or not chk["before"]:
            return None
        self.check = None
        old, new, after = chk["old"], chk["new"], chk["after"][1:]
        # noise only ever slows a step (a straggler microbatch, a busy core): the fastest steps
        # of each window show what its layout can do
        off_old = min(chk["before"])
        off_new = min(r for r, _ in after)
        t_old = median(off_old * self.step_s(self.problem(c, old.num_stages, old), old) for _, c in after)
        t_new = median(off_new * self.step_s(self.problem(c, new.num_stages, new), new) for _, c in after)
        # lost: slower than the old layout by more than the margin (within it, step-time noise
        # could not tell), or than a re-pack's tolerance
        allowed = t_old * (1 + (self.cfg.repack_tolerance if chk["repack"] else 0.0) + self.cfg.min_gain)
        if t_new <= allowed:
            return None
        self.margin = max(2 * self.margin, 0.02)
        if chk["repack"] or old.num_stages != current.num_stages:
            return None  # released workers do not come back; the higher margin guards the next decision
        self.lost.add(current.boundaries)  # within the run, never return to a layout that lost
        cost = self.migration_cost(layer_bytes, current, old)
        return Decision(old, 0.0, 0.0, (t_new - t_old) * max(0, min(self.cfg.horizon, steps_left)), cost,
                        predicted_step_s=t_old, current_step_s=t_new, reason="revert")

    def _repack(self, step: int, costs: list[float], current: Layout, layer_bytes: list[int], steps_left: int) -> Decision | None:
        """The fewest pipeline positions 0..k-1 whose predicted step time stays within
        `repack_tolerance` of the best all-worker layout's, once the model has shrunk (its
        forecast total cost fell by `min_gain` from the largest seen): released workers never
        come back, so a model that may still grow keeps them."""
        c, p = self.cfg, current.num_stages
        if sum(costs) > (1 - c.min_gain) * self.peak_total:
            return None
        problem = self.problem(costs, p, current)
        best = balance(problem, "optimal")
        t_best = self.step_s(problem, Layout(tuple(best.boundaries)))
        limit = t_best * (1 + c.repack_tolerance) * (1 + 1e-9)
        for k in range(1, p):
            sub = self.problem(costs, k)
            result = balance(sub, c.balancer)  # the runtime keeps positions 0..k-1
            if result.boundaries is None:
                continue
            new = Layout(tuple(result.boundaries))
            t_k = self.step_s(sub, new)
            if t_k <= limit:
                break
        else:
            return None
        if c.when != "every" and not self._fits_on_most_steps(current, new, k):
            return None
        now = max(problem.loads_of_assignment(current.owner()))
        t_now = self.step_s(problem, current)
        cost = self.migration_cost(layer_bytes, current, new)
        gain = (t_now - t_k) * max(0, min(c.horizon, steps_left))
        return self._decided(step, current, Decision(new, result.bottleneck, now, gain, cost, released=p - k,
                                                  predicted_step_s=t_k, current_step_s=t_now, reason="repack",
                                                  best_step_s=t_best))

    def _fits_on_most_steps(self, current: Layout, new: Layout, k: int) -> bool:
        """The re-pack keeps its tolerance on nearly every observed step (as `consistent`)."""
        ok = 0
        for costs in self.history:
            full = self.problem(costs, current.num_stages, current)
            best = balance(full, "optimal")
            t_best = self.step_s(full, Layout(tuple(best.boundaries)))
            t_k = self.step_s(self.problem(costs, k), new)
            ok += t_k <= t_best * (1 + self.cfg.repack_tolerance) * (1 + 1e-9)
        return ok >= -(-len(self.history) * 4 // 5)
