"""What a replay is asked to do: the policies, the `[balance]` knobs, the schedule, the links and
what the data-parallel replicas shard."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from dynmo.balance import BALANCERS
from dynmo.config import BalanceConfig, ConfigError, ParallelConfig
from dynmo.controller import MIGRATION_BANDWIDTH, MIGRATION_FIXED_S, RESTART_S
from dynmo.engine import SimInputError, canonical_name, default_stages_per_rank
from dynmo.loop import check_balance
from dynmo.sim.trace import Trace

STATIC = ("uniform", "params", "profile-once")  # the static layouts "best static" is the fastest of
# static layouts known before step 0 beyond those: replayed when asked for, and a place to start
PRIOR = ("flops",)
DYNAMIC = ("optimal", "deepspeed", "diffusion-contiguous")
ORACLES = ("oracle-window", "oracle")  # the bounds: per window of steps (migrations charged), per step (free)
DEFAULT_POLICIES = (*STATIC, *DYNAMIC, *(f"{b}+repack" for b in DYNAMIC), *ORACLES)
# where the dynamic policies start: a static layout, or "default", the layout a training run starts on
STARTS = (*STATIC, *PRIOR, "default")
GRAD_BYTES_PER_PARAM = 4  # fp32 gradients in the data-parallel all-reduce
PARAM_BYTES_PER_PARAM = 4  # fp32 parameters (and gradients) in the sharded runs' all-gathers (reduce-scatters)
SHARDS = ("none", "optimizer", "full")  # the parallel.shard values, all modelled
PROFILE_STEPS = 5  # profile-once: steps 1 .. PROFILE_STEPS (step 0 is the warm-up)
LINK_DELAY_FACTORS = (0.0, 1.0, 2.0, 4.0)  # the paper's network experiment: up to 4x


def replay_balance(**knobs) -> BalanceConfig:
    """The `[balance]` section a replay uses by default: the config's, with `when = "auto"`
    (a replay exists to exercise the dynamic policies); `knobs` override fields."""
    return BalanceConfig(**({"when": "auto"} | knobs))


def default_start() -> str:
    """The static layout a training run starts on when its config does not say: the default of
    `parallel.layout` (`dynmo.plan.initial_layout` lays it out before step 0; "flops").
    `ReplayOptions.initial = "default"` resolves to it, so the replay starts where a real run does."""
    start = ParallelConfig().layout.strip().lower()
    if start not in (*STATIC, *PRIOR):  # an explicit layout fits one model only; the replay cannot start there
        raise SimInputError(f"parallel.layout defaults to {start!r}, which the replay cannot start from; "
                            f"give one of {', '.join((*STATIC, *PRIOR))}")
    return start


def start_layout_name(initial: str) -> str:
    """The static policy whose layout the dynamic policies start on (`ReplayOptions.initial`)."""
    return default_start() if initial == "default" else initial


def default_oracle_window(balance: BalanceConfig) -> int:
    """oracle-window's steps per window: the controller's forecast window plus the fresh steps
    that confirm a move, the shortest change an evidence-driven controller acts on."""
    return balance.window + balance.confirm


@dataclass
class ReplayOptions:
    schedule: str | None = None  # default: the traced run's
    microbatches: int | None = None  # per replica per step; default: the traced run's
    stages_per_rank: int | None = None  # multi-stage schedules; default: traced virtual_stages or 2
    # the DynMo loop's knobs, as [balance] in a training config; each dynamic policy sets the
    # balancer and re-packing from its name (optimal+repack)
    balance: BalanceConfig = field(default_factory=replay_balance)
    # where the dynamic policies start: uniform | params | profile-once | flops | default (`default_start`:
    # the layout a training run starts on, `parallel.layout`'s default)
    initial: str = "default"
    profile_steps: int = PROFILE_STEPS  # profile-once: median of steps 1 .. profile_steps
    # oracle-window: steps per window; None: balance.window + balance.confirm (`default_oracle_window`)
    oracle_window: int | None = None
    # migration cost: seconds = fixed + bytes / bandwidth (and the controller's prior)
    migration_bandwidth: float = MIGRATION_BANDWIDTH  # bytes/s
    migration_fixed_s: float = MIGRATION_FIXED_S
    # growing back after a re-pack is a checkpoint restart: its seconds (and the controller's prior)
    restart_s: float = RESTART_S
    charge_decide: bool = True  # add the measured time of the controller's decisions
    # the controller's pre-registered fallbacks (`dynmo.controller`); False replays it without them,
    # to measure what they change
    fallback: bool = True
    # communication
    comm: float = 0.0  # seconds per activation / gradient transfer between stages
    # extra seconds per activation / gradient transfer on link j (stage j <-> j+1), stages - 1
    # values (a re-packed pipeline keeps the first ones); None: no delay
    link_delay: list[float] | None = None
    op_overhead: float = 0.0  # seconds a rank spends per forward / backward op outside it (send/recv posting,
    #                          Python); benchmarks/validate_sim.py fits 1.4 ms on this machine's gloo runs
    p2p: str = "eager"
    allreduce_bandwidth: float | None = None  # bytes/s of the dp ring all-reduce; None: not modelled
    allreduce_latency: float = 0.0  # seconds per all-reduce (and per sharded run's all-gather, reduce-scatter)
    # as parallel.shard, over the replay's dp replicas; migrations ship the sharded bytes, and with
    # allreduce_bandwidth: "optimizer", the AdamW moments split (ZeRO-1): each step adds the parameter
    # all-gather after the optimizer step; "full", weights, gradients and moments split (FSDP2, every
    # unit its own root): no gradient all-reduce, each forward op adds its units' all-gathers and
    # each backward op their all-gathers and reduce-scatters
    shard: str = "none"

    @property
    def window_steps(self) -> int:
        """oracle-window's steps per window: `oracle_window`, else `default_oracle_window`."""
        return int(self.oracle_window) if self.oracle_window is not None else default_oracle_window(self.balance)

    def check(self) -> None:
        try:
            check_balance(self.balance)
        except ConfigError as e:
            raise SimInputError(str(e)) from None
        if self.balance.when == "never":
            raise SimInputError("balance.when = never keeps every layout static; the dynamic policies need every, dynamism or auto")
        if self.initial not in STARTS:
            raise SimInputError(f"initial (the dynamic policies' start) must be one of {', '.join(STARTS)}, "
                                f"got {self.initial!r}")
        if self.oracle_window is not None and (isinstance(self.oracle_window, bool) or not isinstance(
                self.oracle_window, (int, np.integer)) or self.oracle_window < 1):
            raise SimInputError(f"oracle_window must be an integer >= 1 (steps per window), got {self.oracle_window!r}")
        if not self.op_overhead >= 0 or not self.comm >= 0 or not np.isfinite(self.comm + self.op_overhead):
            raise SimInputError("comm and op_overhead are finite seconds >= 0")
        if isinstance(self.profile_steps, bool) or not isinstance(self.profile_steps, (int, np.integer)) \
                or self.profile_steps < 1:
            raise SimInputError(f"profile_steps must be an integer >= 1, got {self.profile_steps!r}")
        if self.link_delay is not None:
            try:
                d = np.asarray(self.link_delay, dtype=float)
            except (TypeError, ValueError):
                d = np.asarray([np.nan])
            if d.ndim != 1 or not np.all(np.isfinite(d)) or np.any(d < 0):
                raise SimInputError("link_delay must be a list of finite seconds >= 0, one per link between stages")
        if not self.migration_bandwidth > 0:
            raise SimInputError("migration bandwidth must be > 0 bytes/s (use inf for free migrations)")
        if self.microbatches is not None and self.microbatches < 1:
            raise SimInputError("microbatches must be >= 1")
        if self.shard not in SHARDS:
            raise SimInputError(f"shard must be one of {', '.join(SHARDS)}, got {self.shard!r}")


def default_policies(trace: Trace, options: ReplayOptions | None = None) -> list[str]:
    """All policies; without the +repack ones when the schedule runs several stages per rank."""
    opts = options or ReplayOptions()
    v = schedule_of(trace, opts)[1]
    return [p for p in DEFAULT_POLICIES if v == 1 or not p.endswith("+repack")]


def parse_policy(name: str) -> tuple[str, bool]:
    """'optimal+repack' -> ('optimal', True). Raises on unknown names."""
    base, _, extra = name.partition("+")
    if extra not in ("", "repack"):
        raise SimInputError(f"unknown policy suffix in {name!r}; only +repack exists")
    if base in ORACLES or base in STATIC or base in PRIOR:
        if extra:
            raise SimInputError(f"{base} cannot re-pack; re-packing needs a dynamic policy (e.g. optimal+repack)")
        return base, False
    if base not in BALANCERS or not BALANCERS[base][1]:
        contiguous = sorted(b for b, (_, c) in BALANCERS.items() if c)
        raise SimInputError(f"unknown policy {name!r}: use uniform, params, profile-once, flops, oracle, oracle-window or "
                            f"a contiguous "
                            f"balancer ({', '.join(contiguous)}), optionally with +repack")
    return base, extra == "repack"


def schedule_of(trace: Trace, opts: ReplayOptions) -> tuple[str, int]:
    """The schedule to replay and its stages per rank."""
    h = trace.header
    name = canonical_name(opts.schedule or h.schedule)
    v = opts.stages_per_rank
    if v is None:
        v = default_stages_per_rank(name)
        if v > 1 and h.virtual_stages > 1 and canonical_name(h.schedule) == name:
            v = h.virtual_stages
    return name, int(v)
