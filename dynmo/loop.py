"""The DynMo loop of one run: observe -> forecast -> decide -> apply -> refit. Pure (no torch).

    loop = DynmoLoop(cfg.balance, microbatches=4, schedule="1f1b", layer_params=params)
    for step in ...:
        decision = loop.decide(step, layout, steps_left)   # before the step (one rank decides)
        if decision: <migrate>; loop.applied(decision, microbatches)
        <train the step>
        loop.observe(record)                                # the step's StepRecord

The trainer (`dynmo.train`) and the simulator's replay (`dynmo.sim.replay`) both drive this
object, so a trace replayed at the traced shape sees the decisions the run made. What it
adds to the pure decision core (`dynmo.controller.Controller`):
  - the cost the controller sees: the measured per-layer cost of the typical microbatch
    (`balance.cost = "time"`, with measured worker speeds divided out) or the parameter count,
    scaled by each layer's pruning density where the run reports one (`"params"`);
  - per-layer memory for a memory cap: state + the activations of the most microbatches any
    stage keeps in flight (conservative: the layer may land on the first stage);
  - the bytes a migration ships: the measured state per layer once a step was observed;
  - the refit of the migration cost model from every migration the step's events report;
  - dropping the forecast after a decision is applied (costs measured under the old layout
    include its stage effects).

`check_balance` is the one validation of the `[balance]` section.
"""

from __future__ import annotations

from dynmo.config import BalanceConfig, ConfigError
from dynmo.controller import MIGRATION_BANDWIDTH, MIGRATION_FIXED_S, Controller, Decision, retune_microbatches
from dynmo.layout import Layout
from dynmo.record import StepRecord
from dynmo.schedules import held_microbatches

WHEN = ("never", "every", "dynamism", "auto")
COSTS = ("time", "params")
PIPELINE_BALANCERS = ("optimal", "deepspeed", "diffusion-contiguous", "uniform")
BYTES_PER_PARAM = 16  # fp32 weights + gradients + AdamW exp_avg and exp_avg_sq: 4 x 4 B


def bytes_per_param(shard: str = "none", dp: int = 1) -> float:
    """What a layer holds per parameter on one worker, and ships when it migrates: fp32 weights
    and gradients (8 B) and AdamW's two moments (8 B), split over the `dp` data-parallel
    replicas: the moments with `parallel.shard = "optimizer"`, everything with `"full"`."""
    if dp <= 1 or shard == "none":
        return BYTES_PER_PARAM
    return BYTES_PER_PARAM / dp if shard == "full" else BYTES_PER_PARAM - 8 + 8 / dp


def check_balance(b: BalanceConfig) -> None:
    """Raise ConfigError naming the first bad `[balance]` value and what to use instead."""
    if b.when not in WHEN:
        raise ConfigError(f"unknown balance.when {b.when!r}; choose never, every, dynamism or auto")
    if b.cost not in COSTS:
        raise ConfigError(f"unknown balance.cost {b.cost!r}; choose time or params")
    if b.balancer not in PIPELINE_BALANCERS:
        raise ConfigError(
            f"balance.balancer {b.balancer!r} cannot drive a pipeline; choose optimal, deepspeed, "
            "diffusion-contiguous or uniform (diffusion breaks contiguity)"
        )
    if b.every < 1 or b.window < 1:
        raise ConfigError("balance.every and balance.window must be >= 1")
    if not 0.5 < b.confidence < 1:
        raise ConfigError(f"balance.confidence must be above 0.5 and below 1 (e.g. 0.95), got {b.confidence}")
    if b.confirm < 0:
        raise ConfigError(f"balance.confirm must be >= 0 (fresh steps that confirm a move), got {b.confirm}")
    if not b.repack_tolerance >= 0:
        raise ConfigError(f"balance.repack_tolerance must be >= 0, got {b.repack_tolerance}")
    if not 0 <= b.repack_shrink < 1:
        raise ConfigError(f"balance.repack_shrink must be in [0, 1) (a fraction of the peak total cost), got {b.repack_shrink}")
    if b.repack and b.when == "never":
        raise ConfigError("balance.repack = true needs a controller: set balance.when to every, dynamism or auto")
    if b.workers not in ("measure", "equal"):
        raise ConfigError(f"unknown balance.workers {b.workers!r}; choose equal or measure")
    if b.links not in ("measure", "free"):
        raise ConfigError(f"unknown balance.links {b.links!r}; choose measure or free")
    if b.speeds and min(b.speeds) <= 0:
        raise ConfigError(f"balance.speeds must be positive, got {b.speeds}")
    if b.memory_gb < 0:
        raise ConfigError(f"balance.memory_gb must be >= 0 (0 = no cap), got {b.memory_gb}")


class DynmoLoop:
    def __init__(self, cfg: BalanceConfig, *, microbatches: int, schedule: str, layer_params: list[int],
                 stages_per_rank: int | None = None,
                 layer_bytes: list[int] | None = None, speeds: list[float] | None = None,
                 transfer: list[float] | None = None, transfer_back: list[float] | None = None,
                 boundary_bytes: list[int] | None = None, layer_flops: list[float] | None = None,
                 migration_fixed_s: float = MIGRATION_FIXED_S,
                 migration_bandwidth: float = MIGRATION_BANDWIDTH):
        check_balance(cfg)
        self.cfg = cfg
        self.schedule = schedule
        self.layer_params = list(layer_params)
        # what a migration ships per layer: a prior until the first step is measured
        self.layer_bytes = list(layer_bytes) if layer_bytes else [BYTES_PER_PARAM * p for p in self.layer_params]
        self.controller = Controller(cfg, microbatches, schedule, stages_per_rank, speeds=speeds, transfer=transfer,
                                     transfer_back=transfer_back, boundary_bytes=boundary_bytes,
                                     fixed_s=migration_fixed_s, bandwidth=migration_bandwidth,
                                     priors={"params": self.layer_params, "flops": layer_flops})
        self.profile_s = 0.0  # profiler bookkeeping since the last decision

    @property
    def speeds(self) -> list[float] | None:
        return self.controller.speeds

    @property
    def transfer(self) -> list[float] | None:
        return self.controller.transfer

    @property
    def transfer_back(self) -> list[float] | None:
        return self.controller.transfer_back

    @property
    def boundary_bytes(self) -> list[int] | None:
        """Per cut after unit i: the bytes of one microbatch crossing it (a boundary between a
        block's halves carries the block's carry too); the link times price the smallest."""
        return self.controller.boundary_bytes

    def decide(self, step: int, layout: Layout, steps_left: int) -> Decision | None:
        return self.controller.decide(step, layout, self.layer_bytes, steps_left)

    def retuned_microbatches(self, local_batch: int, microbatches: int, stages: int, new_stages: int) -> int | None:
        """After a re-pack onto `new_stages`: the microbatch count to use, or None to keep it."""
        if new_stages >= stages or not self.cfg.retune_microbatches:
            return None
        return retune_microbatches(local_batch, microbatches, stages, new_stages)

    def applied(self, microbatches: int) -> None:
        """A decision was applied (the run now has `microbatches` per replica)."""
        self.controller.applied(microbatches)
        self.profile_s = 0.0

    def event(self, decision: Decision, decide_s: float) -> dict:
        """The fields a decision adds to its migration event."""
        ctl = self.controller
        return {
            "reason": f"balance.when={self.cfg.when}",
            "balancer": self.cfg.balancer,
            "current_bottleneck_s": decision.current_bottleneck,
            "predicted_bottleneck_s": decision.predicted_bottleneck,
            "predicted_gain_s": decision.predicted_gain_s,
            "current_step_s": decision.current_step_s,
            "predicted_step_s": decision.predicted_step_s,
            "decision": decision.reason,
            "predicted_migration_s": decision.predicted_cost_s,
            "decide_s": decide_s,
            "profile_s": self.profile_s,
            "speeds": ctl.speeds,
            "transfer_s": ctl.transfer,
            "transfer_back_s": ctl.transfer_back,
            "boundary_bytes": ctl.boundary_bytes,
        } | ({"best_step_s": decision.best_step_s, "repack_tolerance": self.cfg.repack_tolerance}
             if decision.reason == "repack" else {})

    def worker_free(self, costs, layout: Layout | None) -> list[float]:
        """Measured per-layer costs on `layout`'s workers as the controller keeps them: time on a
        worker of speed s is cost / s, undone."""
        ctl = self.controller
        costs = [float(c) for c in costs]
        if ctl.speeds and layout is not None and layout.num_stages <= len(ctl.speeds):
            owner = layout.owner()
            costs = [c * ctl.speeds[owner[i]] for i, c in enumerate(costs)]
        return costs

    def step_times(self, steps: list[list[float]], layout: Layout) -> list[float]:
        """The simulated step time of `layout` under each of `steps`' measured per-layer costs
        (as a record carries them, on `layout`'s workers): what the expert balancer scores
        placements with, the layer controller's own objective."""
        return self.controller.step_times([self.worker_free(c, layout) for c in steps], layout)

    def observe(self, rec: StepRecord) -> None:
        """Take in one step: its costs, memory and events (dynamism, migrations)."""
        ctl = self.controller
        self.profile_s += rec.profile_s
        if rec.microbatches:
            ctl.microbatches = rec.microbatches  # a re-pack may have re-tuned it
        if rec.layer_state_bytes:
            self.layer_bytes = [int(x) for x in rec.layer_state_bytes]  # what a migration ships, measured
        layout = Layout(tuple(rec.layout)) if rec.layout else None
        if self.cfg.cost == "params":
            density = rec.stats.get("prune_density") or [None] * len(self.layer_params)
            costs = [c * (1.0 if d is None else d) for c, d in zip(self.layer_params, density)]
        else:
            costs = self.worker_free(rec.layer_cost_s, layout)  # typical microbatch: robust to one slowed microbatch
        if layout is not None and rec.layer_act_bytes and rec.layer_state_bytes:
            S = layout.num_stages
            held = held_microbatches(self.schedule, rec.microbatches or ctl.microbatches, S)
            ctl.memory = [s + held * a for s, a in zip(rec.layer_state_bytes, rec.layer_act_bytes)]
        if rec.dynamism:
            ctl.dynamism()
        ctl.model.observe_shares(rec.layer_fwd_s, rec.layer_bwd_s, rec.layer_wgrad_s)  # forward / backward apart
        ctl.observe(costs, rec.step_s or None, changed=bool(rec.dynamism), layout=layout)
        for e in rec.migrations:
            ctl.observe_migration(e["bytes"], e["seconds"])
        for e in rec.events:
            if e.get("restart_s"):  # a checkpoint restart that took workers back, measured
                ctl.observe_restart(float(e["restart_s"]))
