"""Replay a per-layer cost trace under balancing policies on a pipeline of any size. Pure.

    from dynmo.sim.replay import replay, ReplayOptions
    results = replay(trace, stages=24, dp=30, policies=["uniform", "optimal", "optimal+repack", "oracle"])
    for r in results: r.policy, r.steps_per_s, r.speedup, r.speedup_vs_best_static, r.workers_final

Per traced step k the costs c_i(k) (forward and backward seconds per microbatch of every layer)
are summed over each stage of the policy's layout, and the event-driven engine runs one
iteration of the schedule with them. Policies:

  uniform, params      static: equal layers per stage (Megatron) / DeepSpeed's partition of
                       the parameter counts, kept for the whole run;
  profile-once         static: what a careful user picks by profiling once -- the optimal
                       contiguous layout of the per-layer median of the costs the profiler
                       measured on steps 1 .. profile_steps (step 0 warms up), with the link
                       times the dynamic policies see; never changed;
  <balancer>           dynamic: `dynmo.loop.DynmoLoop` (the object the trainer drives, built
                       from the same `[balance]` config) observes each step's costs after the
                       step and decides before the next one with that balancer (optimal, deepspeed fed times,
                       diffusion-contiguous, uniform); a migration costs fixed + bytes /
                       bandwidth and the balancer's measured decide time is charged too;
  <balancer>+repack    the same with the controller's re-packing on (`balance.repack = true`,
                       which calls `dynmo.balance.repack`): at a decision point it packs the
                       layers onto the fewest stages whose optimal bottleneck stays within the
                       tolerance; released workers never return; optionally the microbatch
                       count is re-tuned for the shorter pipeline (balance.retune_microbatches);
  oracle               per step the optimal contiguous layout for that step's own costs (and
                       the link times the dynamic policies see), with no migration or decide
                       cost: the oracle bound.

Every result carries its speedup over static uniform (`speedup`) and over the best static
layout a careful user could pick (`speedup_vs_best_static`: the fastest total time among
uniform, params and profile-once, replayed for the comparison when not asked for), and its
cost in worker-seconds (`worker_s`, per-worker throughput): re-packing shows as the same
training on fewer workers.

Links. `ReplayOptions.comm` is the transfer time of an activation (and of its gradient) on
every link between neighbouring stages, `ReplayOptions.link_delay[j]` an extra delay per
transfer on link j (stage j <-> j+1), as the paper's network experiment injects; the engine
adds it to that link's transfers. With `balance.links = "measure"` (the runtime's default)
the controller, profile-once and the oracle see each link's per-microbatch time, as the
runtime's probe measures it: comm + delay_j for the activation, charged to stage j
(`dynmo.balance.Problem.transfer`), and the same for its gradient, charged to stage j+1
(`Problem.transfer_back`); with `"free"` they balance compute only. `replay_link_delays` runs the network experiment: the same trace at link delays
of 0x, 1x, 2x, 4x a base time, link-aware against compute-only.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Sequence

import numpy as np

from dynmo.balance import BALANCERS, BalanceError, Problem, balance
from dynmo.config import BalanceConfig, ConfigError
from dynmo.controller import MIGRATION_BANDWIDTH, MIGRATION_FIXED_S
from dynmo.layout import Layout, imbalance
from dynmo.loop import DynmoLoop, check_balance
from dynmo.record import StepRecord
from dynmo.sim.engine import SimInputError, StageTimes, ring_allreduce_time, simulate_plan
from dynmo.sim.schedules import Plan, build_plan, canonical_name, default_stages_per_rank
from dynmo.sim.trace import Trace

STATIC = ("uniform", "params", "profile-once")
DYNAMIC = ("optimal", "deepspeed", "diffusion-contiguous")
DEFAULT_POLICIES = (*STATIC, *DYNAMIC, *(f"{b}+repack" for b in DYNAMIC), "oracle")
GRAD_BYTES_PER_PARAM = 4  # fp32 gradients in the data-parallel all-reduce
PROFILE_STEPS = 5  # profile-once: steps 1 .. PROFILE_STEPS (step 0 is the warm-up)
LINK_DELAY_FACTORS = (0.0, 1.0, 2.0, 4.0)  # the paper's network experiment: up to 4x


def replay_balance(**knobs) -> BalanceConfig:
    """The `[balance]` section a replay uses by default: the config's, with `when = "auto"`
    (a replay exists to exercise the dynamic policies); `knobs` override fields."""
    return BalanceConfig(**({"when": "auto"} | knobs))


@dataclass
class ReplayOptions:
    schedule: str | None = None  # default: the traced run's
    microbatches: int | None = None  # per replica per step; default: the traced run's
    stages_per_rank: int | None = None  # multi-stage schedules; default: traced virtual_stages or 2
    # the DynMo loop's knobs, as [balance] in a training config; each dynamic policy sets the
    # balancer and re-packing from its name (optimal+repack)
    balance: BalanceConfig = field(default_factory=replay_balance)
    initial: str = "uniform"  # initial layout of the dynamic policies: uniform | params | profile-once
    profile_steps: int = PROFILE_STEPS  # profile-once: median of steps 1 .. profile_steps
    # migration cost: seconds = fixed + bytes / bandwidth (and the controller's prior)
    migration_bandwidth: float = MIGRATION_BANDWIDTH  # bytes/s
    migration_fixed_s: float = MIGRATION_FIXED_S
    charge_decide: bool = True  # add the measured time of the controller's decisions
    # communication
    comm: float = 0.0  # seconds per activation / gradient transfer between stages
    # extra seconds per activation / gradient transfer on link j (stage j <-> j+1), stages - 1
    # values (a re-packed pipeline keeps the first ones); None: no delay
    link_delay: list[float] | None = None
    op_overhead: float = 0.0  # seconds a rank spends per forward / backward op outside it (send/recv posting,
    #                          Python); benchmarks/validate_sim.py fits 1.4 ms on this machine's gloo runs
    p2p: str = "eager"
    allreduce_bandwidth: float | None = None  # bytes/s of the dp ring all-reduce; None: not modelled
    allreduce_latency: float = 0.0

    def check(self) -> None:
        try:
            check_balance(self.balance)
        except ConfigError as e:
            raise SimInputError(str(e)) from None
        if self.balance.when == "never":
            raise SimInputError("balance.when = never keeps every layout static; the dynamic policies need every, dynamism or auto")
        if self.initial not in STATIC:
            raise SimInputError(f"initial must be one of {', '.join(STATIC)}, got {self.initial!r}")
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


@dataclass
class PolicyResult:
    policy: str
    iteration_s: list[float] = field(default_factory=list)  # simulated schedule time per step
    bubble_ratio: list[float] = field(default_factory=list)
    bottleneck_s: list[float] = field(default_factory=list)  # max stage load (s per microbatch)
    stage_loads: list[list[float]] = field(default_factory=list)  # per step, per stage
    layouts: list[list[int]] = field(default_factory=list)  # boundaries per step
    workers: list[int] = field(default_factory=list)  # pipeline ranks x dp per step
    overhead_s: list[float] = field(default_factory=list)  # migration + decide before each step
    microbatches: list[int] = field(default_factory=list)  # per step (changes only by re-tuning)
    migrations: int = 0
    layers_moved: int = 0
    migration_s: float = 0.0
    decide_s: float = 0.0
    tokens_per_step: float | None = None
    speedup: float | None = None  # vs static uniform: its total time / this total time
    speedup_per_worker: float | None = None  # the same per worker-second (credits released workers)
    # vs the best static layout (the fastest of uniform, params, profile-once): its total time / this
    speedup_vs_best_static: float | None = None
    best_static: str | None = None  # which static policy that was

    @property
    def steps(self) -> int:
        return len(self.iteration_s)

    @property
    def total_s(self) -> float:
        return float(sum(self.iteration_s) + self.migration_s + self.decide_s)

    @property
    def worker_s(self) -> float:
        """Worker-seconds used: every step's time x the workers that step ran on."""
        return float(sum((t + o) * w for t, o, w in zip(self.iteration_s, self.overhead_s, self.workers)))

    @property
    def steps_per_s(self) -> float:
        return self.steps / self.total_s if self.total_s > 0 else 0.0

    @property
    def steps_per_worker_s(self) -> float:
        """Steps per worker-second: throughput per worker, over the run."""
        return self.steps / self.worker_s if self.worker_s > 0 else 0.0

    @property
    def tokens_per_s_per_worker(self) -> float | None:
        """Tokens per worker-second (tokens/s per worker, over the run); None without token counts."""
        return None if self.tokens_per_step is None else self.tokens_per_step * self.steps_per_worker_s

    @property
    def tokens_per_s(self) -> float | None:
        return None if self.tokens_per_step is None else self.tokens_per_step * self.steps_per_s

    @property
    def mean_bubble(self) -> float:
        return float(np.mean(self.bubble_ratio)) if self.bubble_ratio else 0.0

    @property
    def workers_mean(self) -> float:
        return float(np.mean(self.workers)) if self.workers else 0.0

    @property
    def workers_final(self) -> int:
        return self.workers[-1] if self.workers else 0

    def as_dict(self, per_step: bool = True) -> dict:
        d = {
            "policy": self.policy, "steps": self.steps, "total_s": self.total_s, "steps_per_s": self.steps_per_s,
            "tokens_per_s": self.tokens_per_s, "speedup": self.speedup, "speedup_per_worker": self.speedup_per_worker,
            "speedup_vs_best_static": self.speedup_vs_best_static, "best_static": self.best_static,
            "worker_s": self.worker_s, "tokens_per_s_per_worker": self.tokens_per_s_per_worker,
            "steps_per_worker_s": self.steps_per_worker_s, "mean_bubble": self.mean_bubble,
            "workers_mean": self.workers_mean, "workers_final": self.workers_final,
            "migrations": self.migrations, "layers_moved": self.layers_moved, "migration_s": self.migration_s,
            "decide_s": self.decide_s, "mean_bottleneck_s": float(np.mean(self.bottleneck_s)) if self.bottleneck_s else 0.0,
        }
        if per_step:
            d |= {"iteration_s": self.iteration_s, "bubble_ratio": self.bubble_ratio, "bottleneck_s": self.bottleneck_s,
                  "stage_loads": self.stage_loads, "layouts": self.layouts, "workers": self.workers,
                  "overhead_s": self.overhead_s, "microbatches": self.microbatches}
        return d


def default_policies(trace: Trace, options: ReplayOptions | None = None) -> list[str]:
    """All policies; without the +repack ones when the schedule runs several stages per rank."""
    opts = options or ReplayOptions()
    v = _schedule(trace, opts)[1]
    return [p for p in DEFAULT_POLICIES if v == 1 or not p.endswith("+repack")]


def parse_policy(name: str) -> tuple[str, bool]:
    """'optimal+repack' -> ('optimal', True). Raises on unknown names."""
    base, _, extra = name.partition("+")
    if extra not in ("", "repack"):
        raise SimInputError(f"unknown policy suffix in {name!r}; only +repack exists")
    if base == "oracle" or base in STATIC:
        if extra:
            raise SimInputError(f"{base} cannot re-pack; re-packing needs a dynamic policy (e.g. optimal+repack)")
        return base, False
    if base not in BALANCERS or not BALANCERS[base][1]:
        contiguous = sorted(b for b, (_, c) in BALANCERS.items() if c)
        raise SimInputError(f"unknown policy {name!r}: use uniform, params, profile-once, oracle or a contiguous "
                            f"balancer ({', '.join(contiguous)}), optionally with +repack")
    return base, extra == "repack"


def _schedule(trace: Trace, opts: ReplayOptions) -> tuple[str, int]:
    """The schedule to replay and its stages per rank."""
    h = trace.header
    name = canonical_name(opts.schedule or h.schedule)
    v = opts.stages_per_rank
    if v is None:
        v = default_stages_per_rank(name)
        if v > 1 and h.virtual_stages > 1 and canonical_name(h.schedule) == name:
            v = h.virtual_stages
    return name, int(v)


class _Runner:
    """Builds plans once per shape and simulates one step for a layout."""

    def __init__(self, trace: Trace, dp: int, opts: ReplayOptions, stages: int):
        h = trace.header
        self.opts, self.dp = opts, dp
        self.schedule, self.v = _schedule(trace, opts)
        self.delay = None  # injected delay per link (stage j <-> j+1), on the replay's stages
        if opts.link_delay is not None:
            self.delay = np.asarray(opts.link_delay, dtype=float)
            if self.delay.shape != (max(stages - 1, 0),):
                raise SimInputError(f"link_delay needs one value per link between the {stages} stages: "
                                    f"{stages - 1} values, got {self.delay.size}")
        self.m = int(opts.microbatches or h.microbatches)
        self.fwd, self.bwd, self.wgrad = trace.fwd(), trace.bwd(), trace.wgrad()
        self.costs = self.fwd + self.bwd
        self.observed = trace.controller_costs()  # what the runtime's controller sees
        # sequences per replica per step, for re-tuning: M microbatches of the traced size
        seq = int(h.config.get("model", {}).get("seq_len") or 0)
        per_mb = h.tokens_per_microbatch // seq if h.tokens_per_microbatch and seq else 1
        self.local_batch = per_mb * self.m
        self.params = np.asarray(h.params, dtype=float)
        self.plans: dict[tuple[int, int], Plan] = {}

    def link_times(self, stages: int) -> list[float] | None:
        """Per link j (stage j <-> j+1) of the first `stages` positions: the seconds per
        microbatch and direction, as the runtime's probe measures them -- comm + delay_j,
        charged by the load model to stage j for the activation and to stage j+1 for its
        gradient; 0 where both stages share a rank (the engine hands over for free there).
        None with `balance.links = "free"` or when every link is free."""
        if self.opts.balance.links == "free" or stages < 2:
            return None
        t = np.full(stages - 1, float(self.opts.comm))
        if self.delay is not None:
            t = t + self.delay[: stages - 1]
        rank = self.plan(stages).stage_rank
        t = np.where([rank[j] != rank[j + 1] for j in range(stages - 1)], t, 0.0)
        return t.tolist() if np.any(t > 0) else None

    def profile_costs(self) -> np.ndarray:
        """profile-once's per-layer costs: the median over steps 1 .. profile_steps of what the
        runtime's profiler measured (step 0, the warm-up, left out unless it is the only one)."""
        n = len(self.observed)
        lo = 1 if n > 1 else 0
        return np.median(self.observed[lo:min(n, 1 + self.opts.profile_steps)], axis=0)

    def plan(self, stages: int, m: int | None = None) -> Plan:
        m = m or self.m
        if (stages, m) not in self.plans:
            if stages % self.v:
                raise SimInputError(f"{self.schedule} with {self.v} stages per rank needs a multiple of {self.v} stages, got {stages}")
            self.plans[(stages, m)] = build_plan(self.schedule, stages // self.v, m, stages_per_rank=self.v)
        return self.plans[(stages, m)]

    def step(self, k: int, layout: Layout, res: PolicyResult, m: int | None = None) -> None:
        """Simulate step k on `layout` with m microbatches (default M; the local batch is kept,
        so a microbatch is M / m times the traced size and costs that much more)."""
        m = m or self.m
        scale = self.m / m
        b = np.asarray(layout.boundaries[:-1])
        f = np.add.reduceat(self.fwd[k], b) * scale
        bw = np.add.reduceat(self.bwd[k], b) * scale
        w = None if self.wgrad is None else np.add.reduceat(self.wgrad[k], b) * scale
        ar = 0.0
        if self.opts.allreduce_bandwidth and self.dp > 1:
            grad_bytes = np.add.reduceat(self.params, b) * GRAD_BYTES_PER_PARAM
            ar = ring_allreduce_time(grad_bytes, self.dp, self.opts.allreduce_bandwidth, self.opts.allreduce_latency)
        o = self.opts.op_overhead
        # an injected delay is per transfer: it does not grow with a re-tuned microbatch's size
        delay = None if self.delay is None else self.delay[: layout.num_stages - 1]
        times = StageTimes.build(f + o, bw + o, m, wgrad=w, comm=self.opts.comm * scale, allreduce=ar,
                                 link_delay=delay)
        plan = self.plan(layout.num_stages, m)
        sim = simulate_plan(plan, times, dp=self.dp, p2p=self.opts.p2p, split_bubble=False)
        loads = ((f + bw) / scale).tolist()  # per traced-size microbatch, comparable across policies
        res.iteration_s.append(sim.iteration_time)
        res.bubble_ratio.append(sim.bubble_ratio)
        res.stage_loads.append(loads)
        res.bottleneck_s.append(max(loads))
        res.layouts.append(list(layout.boundaries))
        res.workers.append(plan.num_ranks * self.dp)
        res.microbatches.append(m)


def _static_layout(name: str, trace: Trace, stages: int, runner: _Runner) -> Layout:
    if name == "uniform":
        return Layout.uniform(trace.num_layers, stages)
    if name == "profile-once":
        links = runner.link_times(stages)
        return profile_once_layout(runner.profile_costs(), stages, links, links)
    return Layout(tuple(balance(Problem(costs=trace.header.params, stages=stages), "deepspeed").boundaries))


def profile_once_layout(costs, stages: int, transfer: Sequence[float] | None = None,
                        transfer_back: Sequence[float] | None = None) -> Layout:
    """The optimal contiguous layout (min-max stage load, `dynmo.balance` optimal) of per-layer
    `costs`, with per-link `transfer` seconds charged to the stage sending the activations and
    `transfer_back` to the stage sending the gradients."""
    r = balance(Problem(costs=[float(c) for c in costs], stages=stages, transfer=transfer,
                        transfer_back=transfer_back), "optimal")
    return Layout(tuple(r.boundaries))


def _moved_bytes(old: Layout, new: Layout, workers: Sequence[int], layer_bytes: Sequence[int]) -> tuple[int, int]:
    """Layers whose worker changes (new stage j runs on old worker workers[j]) and their bytes."""
    a = old.owner()
    b = [workers[j] for j in new.owner()]
    moved = [i for i in range(len(a)) if a[i] != b[i]]
    return len(moved), int(sum(layer_bytes[i] for i in moved))


def replay(trace: Trace, stages: int | None = None, dp: int | None = None,
           policies: Sequence[str] | None = None, options: ReplayOptions | None = None) -> list[PolicyResult]:
    """Replay `trace` on `stages` pipeline stages x `dp` replicas under each policy.

    `stages` and `dp` default to the traced run's; `policies` to `default_policies`. `speedup` is relative to static
    uniform, `speedup_vs_best_static` to the fastest of the static policies (uniform, params, profile-once; each
    replayed for the comparison even when not asked for, and then not returned).
    """
    opts = options or ReplayOptions()
    opts.check()
    h = trace.header
    stages = int(stages or h.pp * h.virtual_stages)
    dp = int(dp or h.dp)
    if dp < 1:
        raise SimInputError(f"dp must be >= 1, got {dp}")
    if stages > trace.num_layers:
        raise SimInputError(f"cannot split {trace.num_layers} layers into {stages} stages; "
                            "scale the trace to more blocks (--scale-blocks) or use fewer stages")
    if policies is None:
        policies = default_policies(trace, opts)
    parsed = [(p, *parse_policy(p)) for p in policies]
    runner = _Runner(trace, dp, opts, stages)
    if runner.v > 1 and any(rp for _, _, rp in parsed):
        raise SimInputError(f"re-packing needs one stage per rank (GPipe or 1F1B), as in the runtime; "
                            f"{runner.schedule} runs {runner.v}: drop the +repack policies")
    runner.plan(stages)  # fail early on a bad shape
    tokens = None
    if h.tokens_per_microbatch:
        tokens = float(h.tokens_per_microbatch) * runner.m * dp
    out: dict[str, PolicyResult] = {}
    for name, base, rp in parsed:
        if name in out:
            continue
        res = PolicyResult(name, tokens_per_step=tokens)
        if base in STATIC:
            _run_static(trace, runner, _static_layout(base, trace, stages, runner), res)
        elif base == "oracle":
            _run_oracle(trace, runner, stages, res)
        else:
            _run_dynamic(trace, runner, stages, base, rp, opts, res)
        out[name] = res
    # the static references, replayed for the comparison when not asked for
    statics: dict[str, PolicyResult] = {}
    for name in STATIC:
        if name in out:
            statics[name] = out[name]
            continue
        ref = PolicyResult(name, tokens_per_step=tokens)
        try:
            layout = _static_layout(name, trace, stages, runner)
        except BalanceError:
            if name == "params":  # DeepSpeed's partition is refused beyond its size limit: not a reference then
                continue
            raise
        _run_static(trace, runner, layout, ref)
        statics[name] = ref
    ref = statics["uniform"]
    best = min(statics.values(), key=lambda r: r.total_s)  # ties: the first in STATIC order
    for r in out.values():
        r.speedup = ref.total_s / r.total_s if r.total_s > 0 else None
        r.speedup_per_worker = ref.worker_s / r.worker_s if r.worker_s > 0 else None
        r.speedup_vs_best_static = best.total_s / r.total_s if r.total_s > 0 else None
        r.best_static = best.policy
    return _ordered(out, [p for p, _, _ in parsed])


def _ordered(out: dict[str, PolicyResult], names: list[str]) -> list[PolicyResult]:
    seen, res = set(), []
    for n in names:
        if n not in seen:
            seen.add(n)
            res.append(out[n])
    return res


def _run_static(trace: Trace, runner: _Runner, layout: Layout, res: PolicyResult) -> None:
    for k in range(len(trace.steps)):
        res.overhead_s.append(0.0)
        runner.step(k, layout, res)


def _run_oracle(trace: Trace, runner: _Runner, stages: int, res: PolicyResult) -> None:
    transfer = runner.link_times(stages)
    for k in range(len(trace.steps)):
        r = balance(Problem(costs=runner.costs[k].tolist(), stages=stages, transfer=transfer,
                            transfer_back=transfer), "optimal")
        res.overhead_s.append(0.0)
        runner.step(k, r.layout, res)


def _run_dynamic(trace: Trace, runner: _Runner, stages: int, balancer: str, do_repack: bool,
                 opts: ReplayOptions, res: PolicyResult) -> None:
    """The trainer's loop, on traced costs: decide before each step, observe after it."""
    h = trace.header
    links = runner.link_times(stages)  # the same each way: the engine's transfers are symmetric
    loop = DynmoLoop(replace(opts.balance, balancer=balancer, repack=do_repack), microbatches=runner.m,
                     schedule=runner.schedule, layer_params=h.params, layer_bytes=h.layer_bytes,
                     transfer=links, transfer_back=links,
                     migration_fixed_s=opts.migration_fixed_s, migration_bandwidth=opts.migration_bandwidth)
    layout = _static_layout(opts.initial, trace, stages, runner)
    m = runner.m
    n_steps = len(trace.steps)
    for k, st in enumerate(trace.steps):
        lbytes = st.state_bytes or h.layer_bytes  # what this step's migration ships
        t0 = time.perf_counter()
        decision = loop.decide(k, layout, n_steps - k)
        decide_s = time.perf_counter() - t0 if opts.charge_decide else 0.0
        overhead = decide_s
        events = [e for e in st.events if e.get("type") == "dynamism"]  # the traced run's own migrations do not apply
        if decision is not None and decision.layout != layout:
            new = decision.layout
            # a re-pack keeps pipeline positions 0..k-1 (as the runtime), so compare owners directly
            moved, nbytes = _moved_bytes(layout, new, list(range(new.num_stages)), lbytes)
            seconds = opts.migration_fixed_s + nbytes / opts.migration_bandwidth if moved else 0.0
            if moved:
                res.migrations += 1
                res.layers_moved += moved
                res.migration_s += seconds
                overhead += seconds
                events.append({"type": "migration", "bytes": nbytes, "seconds": seconds})
            m = loop.retuned_microbatches(runner.local_batch, m, layout.num_stages, new.num_stages) or m
            layout = new
            loop.applied(m)
        res.decide_s += decide_s
        res.overhead_s.append(overhead)
        runner.step(k, layout, res, m)
        loop.observe(StepRecord(step=k, layout=list(layout.boundaries), microbatches=m,
                                layer_cost_s=runner.observed[k].tolist(), layer_state_bytes=list(lbytes),
                                step_s=res.iteration_s[-1], events=events))


def summary_table(results: Sequence[PolicyResult]) -> str:
    """The replay table: throughput, speedups (over static uniform and over the best static
    layout), bubble, workers and worker-seconds, per-worker throughput, migrations."""
    tok = any(r.tokens_per_s is not None for r in results)
    per_worker = "tok/s/wkr" if tok else "steps/wkr-s"
    head = (f"{'policy':<28} {'steps/s':>8} " + (f"{'tokens/s':>10} " if tok else "") +
            f"{'speedup':>7} {'vs best':>7} {'/worker':>7} {'bubble':>6} {'bottleneck':>10} {'workers':>11} "
            f"{'worker-s':>10} {per_worker:>11} {'migr':>5} {'moved':>5} {'migr s':>7} {'decide s':>8}")
    lines = [head, "-" * len(head)]
    for r in results:
        bn = float(np.mean(r.bottleneck_s)) if r.bottleneck_s else 0.0
        workers = f"{r.workers_mean:.1f}/{r.workers_final}"
        pw = f"{(r.tokens_per_s_per_worker or 0):>11.2f}" if tok else f"{r.steps_per_worker_s:>11.3g}"
        lines.append(
            f"{r.policy:<28} {r.steps_per_s:>8.3f} " + (f"{(r.tokens_per_s or 0):>10.0f} " if tok else "") +
            f"{(r.speedup or 0):>7.3f} {(r.speedup_vs_best_static or 0):>7.3f} {(r.speedup_per_worker or 0):>7.3f} "
            f"{r.mean_bubble:>6.3f} {bn * 1e3:>8.2f}ms {workers:>11} {r.worker_s:>10.1f} {pw} "
            f"{r.migrations:>5} {r.layers_moved:>5} {r.migration_s:>7.3f} {r.decide_s:>8.4f}"
        )
    best = next((r.best_static for r in results if r.best_static), None)
    if best:
        lines.append(f"vs best: total time of the best static layout ({best}, of {', '.join(STATIC)}) / this policy's; "
                     f"worker-s: worker-seconds over the run; {per_worker}: "
                     + ("tokens" if tok else "steps") + " per worker-second")
    return "\n".join(lines)


LINK_MODES = ("measure", "free")  # balance.links: link-aware, compute-only


def replay_link_delays(trace: Trace, base_s: float, stages: int | None = None, dp: int | None = None,
                       links: Sequence[int] | None = None, factors: Sequence[float] = LINK_DELAY_FACTORS,
                       policies: Sequence[str] = ("uniform", "profile-once", "optimal"),
                       options: ReplayOptions | None = None) -> list[dict]:
    """The paper's network experiment: the same trace replayed with a delay of f x `base_s`
    seconds per activation / gradient transfer injected on `links` (indices j of the links
    stage j <-> j+1; default: every link) for each f in `factors`, once with link-aware
    balancing (`balance.links = "measure"`: the controller, profile-once and the oracle see
    each link's time) and once compute-only (`"free"`). `options` gives everything else.

    One row per (factor, links mode, policy): the delay, the policy's total and mean step
    time, its speedups over static uniform and over the best static layout under that delay,
    migrations and final layout. `link_delay_table(rows)` prints them side by side."""
    opts = options or ReplayOptions()
    h = trace.header
    S = int(stages or h.pp * h.virtual_stages)
    if not base_s >= 0 or not np.isfinite(base_s):
        raise SimInputError(f"base_s must be finite seconds >= 0, got {base_s}")
    chosen = sorted(set(range(S - 1) if links is None else (int(j) for j in links)))
    if any(not 0 <= j < S - 1 for j in chosen):
        raise SimInputError(f"links are indices 0..{S - 2} of the links between the {S} stages, got {chosen}")
    rows = []
    for f in factors:
        delay = [float(f) * base_s if j in chosen else 0.0 for j in range(S - 1)]
        for mode in LINK_MODES:
            o = replace(opts, link_delay=delay, balance=replace(opts.balance, links=mode))
            for r in replay(trace, S, dp, policies, o):
                rows.append({
                    "factor": float(f), "delay_s": float(f) * base_s, "delayed_links": chosen, "links": mode,
                    "policy": r.policy, "total_s": r.total_s, "mean_iteration_s": float(np.mean(r.iteration_s)),
                    "speedup": r.speedup, "speedup_vs_best_static": r.speedup_vs_best_static,
                    "best_static": r.best_static, "migrations": r.migrations, "layout_final": r.layouts[-1],
                })
    return rows


def link_delay_table(rows: Sequence[dict]) -> str:
    """Markdown table of `replay_link_delays` rows: per delay and policy, the mean step time
    with link-aware and with compute-only balancing, and the ratio compute-only / link-aware
    of their total times (> 1: seeing the links paid)."""
    by = {(r["factor"], r["policy"], r["links"]): r for r in rows}
    keys = list(dict.fromkeys((r["factor"], r["policy"]) for r in rows))
    out = ["| delay (x base) | delay s | policy | s/step link-aware | s/step compute-only | compute-only / link-aware "
           "| migrations (aware, free) | final layout link-aware | final layout compute-only |",
           "|---:|---:|---|---:|---:|---:|---:|---|---|"]
    for f, p in keys:
        a, b = by.get((f, p, "measure")), by.get((f, p, "free"))
        if a is None or b is None:
            continue
        ratio = b["total_s"] / a["total_s"] if a["total_s"] > 0 else float("nan")
        same = a["layout_final"] == b["layout_final"]
        out.append(f"| {f:g} | {a['delay_s']:.4g} | {p} | {a['mean_iteration_s']:.4f} | {b['mean_iteration_s']:.4f} | "
                   f"{ratio:.3f} | {a['migrations']}, {b['migrations']} | {_short(a['layout_final'])} | "
                   f"{'same' if same else _short(b['layout_final'])} |")
    return "\n".join(out)


def _short(boundaries: Sequence[int]) -> str:
    """Stage sizes of a layout, e.g. 3+4+3 (boundaries are long at paper scale)."""
    return "+".join(str(b - a) for a, b in zip(boundaries, boundaries[1:]))


def trace_summary(trace: Trace) -> dict:
    """Shape and dynamics of a trace, for the CLI header and JSON."""
    c = trace.costs()
    h = trace.header
    return {
        "case": h.case, "source": h.source, "layers": trace.num_layers, "steps": len(trace.steps),
        "traced_pp": h.pp, "traced_dp": h.dp, "schedule": h.schedule, "microbatches": h.microbatches,
        "dynamism_steps": trace.dynamism_steps(),
        "total_cost_first_last_s": [float(c[0].sum()), float(c[-1].sum())],
        "layer_imbalance_last": imbalance(c[-1].tolist()),
    }
