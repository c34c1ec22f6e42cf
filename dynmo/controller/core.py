"""The `Controller`: the state of the DynMo loop's decisions, and `decide` as a sequence of named steps.

The policy and its reasons are in the package docstring (`dynmo.controller`); each step's
judgement lives in its own module (`evidence`, `judge`, `repack`, `migration`, `steptime`), and
the `Controller`'s own steps in its mixins: the proposals (`rebalancing.Rebalancing`), the
pre-registered fallbacks (`fallback.Fallbacks`), the re-pack and the grow (`packing.Packing`),
`auto`'s defences that span steps (`safeguards.Safeguards`) and the scoring of layouts
(`scoring.Scoring`). What it decides is a `Decision` (`decision`).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from statistics import median

from dynmo.config import BalanceConfig
from dynmo.controller import evidence, migration
from dynmo.controller.decision import Decision
from dynmo.controller.evidence import CONFIRM
from dynmo.controller.fallback import Fallbacks
from dynmo.controller.judge import JUDGE, Judge
from dynmo.controller.migration import MIGRATION_BANDWIDTH, MIGRATION_FIXED_S
from dynmo.controller.packing import Packing
from dynmo.controller.rebalancing import Rebalancing
from dynmo.controller.safeguards import Safeguards
from dynmo.controller.scoring import HistoryTimes, Scoring
from dynmo.controller.steptime import StepModel
from dynmo.layout import Layout

__all__ = ["CONFIRM", "JUDGE", "RESTART_S", "Controller", "Decision"]

# the prior cost of growing back (checkpoint, relaunch, resume) until a restart was measured:
# generous, so that the first grow needs a lasting saving
RESTART_S = 60.0


@dataclass
class Controller(Rebalancing, Fallbacks, Packing, Safeguards, Scoring):
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
    # layouts a measured step time showed slower -> the observed steps then: not chosen again for
    # the horizon (the costs they lost on may have moved on since)
    lost: dict = field(default_factory=dict)
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
    # auto: test the current layout every step against the layouts fixed before any cost was seen
    # (the start, the priors'), and move to one at once when it is faster beyond the recent steps'
    # noise (`fallback`); False: the controller without them
    fallback: bool = True
    # the layout of the first decision (a resumed run's: the one it resumed on): a fallback
    start: Layout | None = None
    via: str = ""  # the reason of the decision that chose the current layout ("": the start)
    # auto: (step, seconds) of each move a fallback undid after it ran slower (`persistence`)
    outpaced: list = field(default_factory=list)
    # auto: per fallback (and the layouts it was compared with), its simulated step time on each
    # observed step, by the step's number in the run (`fallback.Fallbacks._record`)
    fallback_record: dict = field(default_factory=dict, repr=False)

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
        """judge -> trigger -> forecast -> re-pack -> fallback (`auto`) -> propose (with `auto`'s evidence)."""
        c = self.cfg
        self.widest = max(self.widest, current.num_stages)
        if self.start is None:
            self.start = current
        self.lost = {b: at for b, at in self.lost.items() if self.observed - at <= c.horizon}
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
        if c.when == "auto" and self.fallback:
            d = self._fall_back(step, current, layer_bytes, steps_left)
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
