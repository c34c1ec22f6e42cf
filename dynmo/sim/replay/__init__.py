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
                       tolerance, and grows back (a restart charged restart_s) when the
                       work returns; optionally the microbatch
                       count is re-tuned for the shorter pipeline (balance.retune_microbatches);
  oracle               per step the fastest layout for that step's own costs (and the link
                       times the dynamic policies see) among the controller's candidates and
                       every layout another policy ran then, with no migration or decide
                       cost: the oracle bound;
  oracle-window        one layout per window of W steps (ReplayOptions.oracle_window, default
                       balance.window + balance.confirm), chosen in hindsight among the
                       controller's candidates for the window's costs and every layout another
                       policy ran in it, migrations charged between windows: the bound of a
                       controller that follows lasting changes; never below the best static
                       layout, never above the per-step oracle.

The dynamic policies start on ReplayOptions.initial (uniform, params, profile-once, flops, or default:
the layout a training run starts on, `default_start`: flops). `flops` also replays as a static policy.

Every result carries its speedup over static uniform (`speedup`) and over the best static
layout a careful user could pick (`speedup_vs_best_static`: the fastest total time among
uniform, params and profile-once, replayed for the comparison when not asked for), the same
two over the last half of the steps (`speedup_second_half`, `speedup_vs_best_static_second_half`),
each dynamic policy's share of each oracle's gain over the best static layout
(`capture_oracle`, `capture_oracle_window`), and its cost in worker-seconds (`worker_s`,
per-worker throughput): re-packing shows as the same training on fewer workers.

Links. `ReplayOptions.comm` is the transfer time of an activation (and of its gradient) on
every link between neighbouring stages, `ReplayOptions.link_delay[j]` an extra delay per
transfer on link j (stage j <-> j+1), as the paper's network experiment injects; the engine
adds it to that link's transfers. With `balance.links = "measure"` (the runtime's default)
the controller, profile-once and the oracle see each link's per-microbatch time, as the
runtime's probe measures it: comm + delay_j for the activation, charged to stage j
(`dynmo.balance.Problem.transfer`), and the same for its gradient, charged to stage j+1
(`Problem.transfer_back`); with `"free"` they balance compute only. `replay_link_delays` runs the network experiment: the same trace at link delays
of 0x, 1x, 2x, 4x a base time, link-aware against compute-only.

Units. `replay_units` replays one sublayer trace (each block's attention and MLP halves as two
units) with half-block units and, merged, with whole blocks: the best static layout, the balance
gap, dynmo and the oracle of each (`dynmo.sim.replay.units`).
"""

from __future__ import annotations

from dynmo.sim.replay.links import LINK_MODES, replay_link_delays
from dynmo.sim.replay.options import (
    DEFAULT_POLICIES, DYNAMIC, GRAD_BYTES_PER_PARAM, LINK_DELAY_FACTORS, ORACLES, PROFILE_STEPS, STARTS, STATIC,
    ReplayOptions, default_oracle_window, default_policies, default_start, parse_policy, replay_balance,
)
from dynmo.sim.replay.policies import profile_costs, profile_once_layout
from dynmo.sim.replay.render import link_delay_table, summary_table, trace_summary
from dynmo.sim.replay.result import CAPTURE_MIN_GAIN, PolicyResult, capture
from dynmo.sim.replay.run import replay
from dynmo.sim.replay.units import UNIT_POLICIES, balance_gap, load_sublayer_trace, replay_units

__all__ = [
    "CAPTURE_MIN_GAIN", "DEFAULT_POLICIES", "DYNAMIC", "GRAD_BYTES_PER_PARAM", "LINK_DELAY_FACTORS", "LINK_MODES",
    "ORACLES", "PROFILE_STEPS", "STARTS", "STATIC", "UNIT_POLICIES", "PolicyResult", "ReplayOptions", "balance_gap",
    "capture", "default_oracle_window", "default_policies", "default_start", "link_delay_table",
    "load_sublayer_trace", "parse_policy", "profile_costs", "profile_once_layout", "replay", "replay_balance",
    "replay_link_delays", "replay_units", "summary_table", "trace_summary",
]
