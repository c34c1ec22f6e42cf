"""When and how to rebalance: the DynMo loop's decisions (paper Algorithm 1, automated). Pure.

The runtime feeds the controller each step's measured per-layer cost; the controller answers
with a new layout or nothing. No torch here, so the simulator can replay the same policy.

Forecast: per-layer cost is the median of the last `window` steps. A median ignores one-step
spikes (timing noise, a GC pause) and follows a real step change after ceil(window / 2)
steps (2 with the default window of 3), which is what per-step dynamism (MoE, MoD) needs.

Triggers (`when`):
  never    keep the initial layout;
  every    rebalance every `every` steps (the paper's fixed frequency);
  dynamism rebalance once after each step that changed the model (a pruning step, a block
           frozen, the skew switched on: events of type "dynamism"), from the cost measured
           on the step after the change (the paper's Algorithm 1: profile, then rebalance);
  auto     rebalance when the predicted saving over the next `horizon` steps exceeds the
           predicted migration cost, and the bottleneck falls by at least `min_gain`
           (a hysteresis that keeps noise from moving layers back and forth), and the new
           layout also beats the current one by `min_gain` on the median step of the window
           (each observed step's costs evaluated on their own; see below).
The predicted saving of one step is (bottleneck_now − bottleneck_new) × slots, where slots =
microbatches + stages − 1 is how many bottleneck-stage slots a 1F1B/GPipe step waits through.
The migration cost model is fixed + bytes / bandwidth, re-fitted from every migration measured.

Per-step check (`auto`): the new layout is the optimum of the forecast, so under per-step noise
(MoE routing) it is fitted to the forecast's noise and its forecast gain is biased up (the
winner's curse): a median of per-layer medians can favour a layout that is worse than the current
one on most of the observed steps. So `auto` also needs the per-step gain, (bottleneck_now −
bottleneck_new) / bottleneck_now under each step's own costs in the window, to exceed `min_gain`
on the median step (the majority of the window). A real step change keeps the 2-step reaction:
the window's two post-change steps are the majority. Replayed at paper scale (`dynmo bench`'s
traces) this takes MoE under `optimal` from 5 migrations (0.975x of static) to 1 (0.994x).
A gate on the estimated noise level alone was tried and dropped (docs/controller.md): the skewed
model's bottleneck is about as noisy step to step as MoE's, but its gains are real.

Re-packing (`repack=True`, paper Algorithm 1's optional step): at a decision point, if the
fewest workers whose optimal bottleneck stays within (1 + repack_tolerance) of the best
all-worker bottleneck (`dynmo.balance.repack`, ours) are fewer than today's, the decision is
that smaller layout; the runtime keeps pipeline positions 0..k-1 and releases the rest. With
identical workers any k of them are equivalent, so keeping the prefix loses nothing; with
measured per-worker speeds the balancer gets the kept workers' speeds. Workers never come
back, so `auto` re-packs only from a full forecast window.

Re-tuning microbatches after a re-pack (`retune_microbatches`): the paper's DynMo keeps the
microbatch count (its appendix E.4 names this as a gap). A shorter pipeline needs fewer
microbatches to hide its fill/drain bubble, and fewer, larger microbatches cost less fixed
per-microbatch overhead. We pick the fewest microbatches m' that divide the local batch and
keep both the schedule's inherent bubble, (p'-1)/(m'+p'-1), and the activations a 1F1B stage
holds in flight, min(m', p')/m' of the local batch, no worse than before the re-pack.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from statistics import median

from dynmo.balance import Problem, balance, repack
from dynmo.config import BalanceConfig
from dynmo.layout import Layout

# Migration cost model before the first migration is measured: seconds = fixed + bytes / bandwidth
MIGRATION_FIXED_S = 0.01  # ~10 ms seen here
MIGRATION_BANDWIDTH = 1e9  # bytes/s


@dataclass
class Decision:
    layout: Layout
    predicted_bottleneck: float  # seconds per microbatch on the slowest stage, new layout
    current_bottleneck: float  # same, current layout, under the same forecast
    predicted_gain_s: float  # over the horizon
    predicted_cost_s: float  # migration
    released: int = 0  # pipeline positions released by a re-pack (per replica)


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
    transfer: list[float] | None = None  # per stage boundary: seconds to ship one microbatch's activations
    memory: list[float] | None = None  # per layer: bytes it needs on a worker (state + activations in flight)
    capacity: float | None = None  # bytes per worker; default: cfg.memory_gb (0 = no cap)
    # migration cost model: seconds = fixed_s + bytes / bandwidth, refitted from each migration
    fixed_s: float = MIGRATION_FIXED_S
    bandwidth: float = MIGRATION_BANDWIDTH
    history: deque = field(default_factory=deque)
    pending: bool = False  # when = "dynamism": the model changed and no rebalance followed yet

    def __post_init__(self) -> None:
        if self.cfg.window < 1:
            raise ValueError("balance.window must be >= 1")
        if self.capacity is None and self.cfg.memory_gb > 0:
            self.capacity = self.cfg.memory_gb * 2**30
        self.history = deque(maxlen=self.cfg.window)

    def dynamism(self) -> None:
        """The model's work changed this step: costs from before it no longer apply."""
        if self.cfg.when == "dynamism":
            self.history.clear()
            self.pending = True

    def observe(self, layer_costs: list[float]) -> None:
        self.history.append(list(layer_costs))

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

    def problem(self, costs: list[float], stages: int, current: Layout | None = None) -> Problem:
        """The balancing problem for the first `stages` pipeline positions."""
        return Problem(
            costs=costs,
            stages=stages,
            memory=self.memory if self.capacity else None,
            capacity=self.capacity or None,
            speeds=self.speeds[:stages] if self.speeds else None,
            transfer=self.transfer[: stages - 1] if self.transfer and stages > 1 else None,
            current=list(current.boundaries) if current is not None else None,
        )

    def decide(self, step: int, current: Layout, layer_bytes: list[int], steps_left: int) -> Decision | None:
        c = self.cfg
        if c.when == "never":
            return None
        if c.when == "every" and (step == 0 or step % c.every):
            return None
        if c.when == "dynamism":
            if not self.pending or not self.history:
                return None
            self.pending = False
        costs = self.forecast()
        if costs is None or len(self.history) < c.window and c.when == "auto":
            return None
        if c.repack and current.num_stages > 1:
            d = self._repack(costs, current, layer_bytes, steps_left)
            if d is not None:
                return d
        problem = self.problem(costs, current.num_stages, current)
        result = balance(problem, c.balancer)
        if result.boundaries is None:
            raise ValueError(f"balancer {c.balancer!r} gave a non-contiguous layout; pipelines need a contiguous one")
        new = Layout(tuple(result.boundaries))
        if new == current:
            return None
        now = max(problem.loads_of_assignment(current.owner()))
        slots = self.microbatches + current.num_stages - 1
        gain = (now - result.bottleneck) * slots * max(0, min(c.horizon, steps_left))
        cost = self.migration_cost(layer_bytes, current, new)
        if c.when == "auto" and (now - result.bottleneck < c.min_gain * now or gain <= cost
                                 or self.per_step_gain(current, new) < c.min_gain):
            return None
        return Decision(new, result.bottleneck, now, gain, cost)

    def per_step_gain(self, current: Layout, new: Layout) -> float:
        """Median over the window's observed steps of the relative bottleneck saving of `new`
        over `current`, each step's costs evaluated on their own (see the module docstring)."""
        gains = []
        for costs in self.history:
            problem = self.problem(costs, current.num_stages, current)
            old_b = max(problem.loads_of_assignment(current.owner()))
            new_b = max(problem.loads_of_assignment(new.owner()))
            gains.append((old_b - new_b) / old_b if old_b > 0 else 0.0)
        return median(gains) if gains else 0.0

    def _repack(self, costs: list[float], current: Layout, layer_bytes: list[int], steps_left: int) -> Decision | None:
        p = current.num_stages
        problem = self.problem(costs, p, current)
        packed = repack(problem, self.cfg.repack_tolerance)
        k = len(packed.workers)
        if k >= p:
            return None
        result = balance(self.problem(costs, k), self.cfg.balancer)  # the runtime keeps positions 0..k-1
        best = balance(problem, "optimal").bottleneck
        if result.bottleneck > best * (1 + self.cfg.repack_tolerance) * (1 + 1e-9):
            return None  # the kept prefix is slower than the workers the re-packer would keep
        new = Layout(tuple(result.boundaries))
        now = max(problem.loads_of_assignment(current.owner()))
        cost = self.migration_cost(layer_bytes, current, new)
        slots_now, slots_new = self.microbatches + p - 1, self.microbatches + k - 1
        gain = (now * slots_now - result.bottleneck * slots_new) * max(0, min(self.cfg.horizon, steps_left))
        return Decision(new, result.bottleneck, now, gain, cost, released=p - k)
