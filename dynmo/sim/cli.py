"""`dynmo simulate`: one iteration from stage times, or a whole trace replayed under policies.

    dynmo simulate --input stages.json [--ops]          one iteration, JSON out
    dynmo simulate --trace FILE --stages P --dp D [--policies ...] [--microbatches M]
                   [--scale-blocks N] [--plots DIR] [--json]
        FILE: a trace (dynmo train --trace FILE) or a run folder (its metrics.jsonl is converted).
        Prints a table per policy; see docs/simulator.md "Trace replay".

stages.json (see docs/simulator.md):
    {"schedule": "1F1B", "microbatches": 8,
     "fwd": [0.010, 0.012], "bwd": [0.020, 0.025],     # seconds, per stage (or per stage per mb)
     "wgrad": [...],                                   # optional, zero-bubble schedules
     "comm": 0.001,                                    # optional: number, per link, {"fwd","bwd"}
     "stages_per_rank": 2,                             # optional, multi-stage schedules
     "dp": 30, "grad_bytes": [...], "bandwidth": 1e10, "latency": 1e-5,   # optional
     "allreduce": [...], "allreduce_mode": "overlap",  # optional
     "p2p": "eager"}                                   # optional: or "rendezvous"

Bad input (a wrong type, a value out of range, a shape over the limits below, times so large
that the result overflows): one line `dynmo simulate: error: ...` on stderr, exit code 2.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import replace
from typing import Any

import numpy as np

from dynmo.balance import BalanceError
from dynmo.balance.cli import MAX_LAYER_STAGES
from dynmo.balance.static import check_deepspeed_size
from dynmo.config import BalanceConfig, ConfigError
from dynmo.controller import MIGRATION_BANDWIDTH, MIGRATION_FIXED_S, RESTART_S
from dynmo.engine import ALLREDUCE_MODES, P2P_MODES, SCHEDULES, ScheduleError, SimInputError, canonical_name, simulate
from dynmo.jsonio import (
    ArgumentParser, InputError, NonFiniteError, choice, dumps, fail, integer, number, parse_args,
    read_json, write_json,
)
from dynmo.sim.args import check_shape
from dynmo.sim.trace import MAX_DP, MAX_MICROBATCHES, MAX_STAGES, MAX_STEPS, TraceError

PROG = "dynmo simulate"

# Limits (docs/simulator.md, "Limits and exit codes"); the trace limits live in dynmo.sim.trace.
# One simulated iteration holds ~2-3 ops per stage and microbatch with their times: 10^6
# stage-microbatches take ~0.8 GB and 15-40 s; printing every op (--ops) takes ~4x that memory.
MAX_STAGE_MICROBATCHES = 1_000_000  # stages x microbatches of one iteration
MAX_OPS_STAGE_MICROBATCHES = 250_000  # the same with --ops (every op's start and end printed)
MAX_REPLAY_OPS = 30_000_000  # replay: policies x steps x stages x microbatches (engine work)
MAX_REPLAY_SERIES = 10_000_000  # replay: policies x steps x stages (per-step loads and layouts kept)
MAX_INDENT = 8
WHEN = ("every", "dynamism", "auto")
# every bad-input error of the simulator, the balancers and the [balance] checks is a ValueError
ERRORS = (InputError, SimInputError, ScheduleError, TraceError, BalanceError, ConfigError, ValueError)

KEYS = {
    "schedule", "microbatches", "fwd", "bwd", "wgrad", "comm", "stages_per_rank", "dp",
    "allreduce", "grad_bytes", "bandwidth", "latency", "allreduce_mode", "p2p",
}


def _parser() -> ArgumentParser:
    ap = ArgumentParser(
        prog="dynmo simulate",
        description="With --input: simulate one training iteration of a pipeline schedule from "
        "per-stage times and print JSON (iteration_time, bubble_ratio split into bubble_inherent "
        "and bubble_imbalance, per-rank busy_s / idle_s). With --trace: replay a per-layer cost "
        "trace under static and dynamic balancing policies and print a table.",
    )
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--input", help="stages.json path, or - for stdin")
    src.add_argument("--trace", metavar="FILE", help="trace file (dynmo train --trace) or run folder to replay")
    ap.add_argument("--schedule", help=f"override the schedule ({', '.join(SCHEDULES)})")
    ap.add_argument("--microbatches", type=int, help="override the microbatches per step")
    ap.add_argument("--dp", type=int, help="data-parallel replicas")
    ap.add_argument("--allreduce-mode", choices=ALLREDUCE_MODES, help="override allreduce_mode (--input)")
    ap.add_argument("--p2p", choices=P2P_MODES, help="override the transfer model (default eager)")
    ap.add_argument("--ops", action="store_true", help="--input: include every op's start and end")
    ap.add_argument("--indent", type=int, default=2, help="JSON indent (0: one line)")
    r = ap.add_argument_group("trace replay (--trace)")
    r.add_argument("--stages", type=int, help="pipeline stages (default: the traced run's)")
    r.add_argument("--stages-per-rank", type=int, help="stages per rank for multi-stage schedules")
    r.add_argument("--policies", help="comma-separated: uniform, params, profile-once, optimal, deepspeed, "
                   "diffusion-contiguous, <balancer>+repack, oracle, oracle-window (default: all)")
    r.add_argument("--start", default="default",
                   help="where the dynamic policies start: uniform, params, profile-once, flops, or default (the "
                        "layout a training run starts on, parallel.layout's default: flops)")
    r.add_argument("--oracle-window", type=int, default=None,
                   help="oracle-window: steps per window (default: --window + --confirm)")
    r.add_argument("--scale-blocks", type=int, help="first scale the trace to N transformer blocks (scale_trace)")
    r.add_argument("--cost-scale", type=float, default=1.0, help="with --scale-blocks: multiply layer costs")
    r.add_argument("--params-scale", type=float, default=1.0, help="with --scale-blocks: multiply block params")
    r.add_argument("--noise", type=float, default=0.0, help="with --scale-blocks: lognormal sigma per block and step")
    b = BalanceConfig()  # the DynMo loop's knobs default as in a training config's [balance]
    r.add_argument("--when", default="auto", help="controller trigger: every, dynamism or auto (default auto)")
    r.add_argument("--every", type=int, default=b.every, help=f"with --when every: steps between rebalances (default {b.every})")
    r.add_argument("--window", type=int, default=b.window, help=f"controller's median forecast window (default {b.window})")
    r.add_argument("--min-gain", type=float, default=b.min_gain, help=f"auto: minimum bottleneck reduction (default {b.min_gain})")
    r.add_argument("--confidence", type=float, default=b.confidence,
                   help=f"auto: how sure the evidence must be that a saving is not noise (default {b.confidence})")
    r.add_argument("--confirm", type=int, default=b.confirm,
                   help=f"auto: fresh steps that must confirm a proposed move (default {b.confirm})")
    r.add_argument("--horizon", type=int, default=b.horizon, help=f"auto: steps the saving must repay the migration in (default {b.horizon})")
    r.add_argument("--repack-tolerance", type=float, default=b.repack_tolerance,
                   help=f"+repack: allowed bottleneck growth (default {b.repack_tolerance})")
    r.add_argument("--retune-microbatches", action="store_true",
                   help="+repack: fewer microbatches for the shorter pipeline (as balance.retune_microbatches)")
    r.add_argument("--mig-bandwidth", type=float, default=MIGRATION_BANDWIDTH,
                   help=f"migration bytes/s (default {MIGRATION_BANDWIDTH:g})")
    r.add_argument("--mig-fixed", type=float, default=MIGRATION_FIXED_S,
                   help=f"fixed seconds per migration (default {MIGRATION_FIXED_S})")
    r.add_argument("--restart-s", type=float, default=RESTART_S,
                   help=f"+repack: seconds of the checkpoint restart that takes released workers back (default {RESTART_S:g})")
    r.add_argument("--no-decide-time", action="store_true", help="do not charge the controller's decide time")
    r.add_argument("--comm", type=float, default=0.0, help="seconds per stage-to-stage transfer (default 0)")
    r.add_argument("--link-delay", metavar="S[,S...]",
                   help="extra seconds per activation / gradient transfer: one number (every link) or one per "
                        "link j (stage j <-> j+1), stages - 1 values")
    r.add_argument("--links", default="measure", help="measure: the controller, profile-once and the oracle "
                   "see each link's time (the runtime's default); free: they balance compute only")
    r.add_argument("--profile-steps", type=int, default=None,
                   help="profile-once: the median of steps 1..N (default: the replay's PROFILE_STEPS)")
    r.add_argument("--op-overhead", type=float, default=0.0,
                   help="seconds per forward/backward op spent outside it (1.4e-3 fitted on this machine's gloo runs)")
    r.add_argument("--allreduce-bandwidth", type=float, help="bytes/s of the dp gradient ring all-reduce "
                   "(default: not modelled)")
    r.add_argument("--allreduce-latency", type=float, default=0.0, help="seconds per all-reduce")
    r.add_argument("--shard", default="none", help="none (default), optimizer or full, as parallel.shard: what the "
                   "dp replicas shard (optimizer: the AdamW state; full: weights, gradients and AdamW state, "
                   "FSDP2): sharded migration bytes, and with --allreduce-bandwidth optimizer's parameter "
                   "all-gather after each step, full's per-microbatch all-gathers and reduce-scatters in place "
                   "of the all-reduce")
    e = ap.add_argument_group("expert parallelism (--trace with --ep: the expert replay, dynmo.sim.expert_cli)")
    e.add_argument("--ep", type=int, help="experts of each MoE layer spread over this many dp replicas of its stage")
    e.add_argument("--layouts", choices=("fixed", "dynmo"), default="fixed",
                   help="fixed: the layer layout held (placement alone); dynmo: decided with the placements")
    e.add_argument("--extra-slots", type=int, default=0, help="expert slots per rank beyond N / E, for copies")
    e.add_argument("--copies", type=int, default=0, help="copies of hot experts per layer the oracle may place")
    e.add_argument("--a2a-bandwidth", type=float, default=25e9, help="all-to-all bytes/s per rank (default 2.5e10)")
    e.add_argument("--experts-every", type=int, default=BalanceConfig().experts_every,
                   help="balance.experts_every: steps between placement decisions")
    r.add_argument("--plots", metavar="DIR", help="write PNG plots to DIR")
    r.add_argument("--json", action="store_true", help="print JSON instead of the table")
    r.add_argument("--save-trace", metavar="FILE", help="write the (converted or scaled) trace to FILE")
    return ap


def run(spec: dict, trace: bool = False) -> dict:
    """Simulate a stages.json document (already parsed); return the output document."""
    check_spec(spec, ops=trace)
    res = simulate(
        spec["fwd"],
        spec["bwd"],
        spec.get("schedule", "1F1B"),
        spec.get("microbatches"),
        wgrad=spec.get("wgrad"),
        comm=spec.get("comm", 0.0),
        stages_per_rank=spec.get("stages_per_rank"),
        dp=spec.get("dp", 1),
        allreduce=spec.get("allreduce"),
        grad_bytes=spec.get("grad_bytes"),
        bandwidth=spec.get("bandwidth"),
        latency=spec.get("latency", 0.0),
        allreduce_mode=spec.get("allreduce_mode", "overlap"),
        p2p=spec.get("p2p", "eager"),
        keep_trace=trace,
    )
    return res.as_dict()


def check_cells(schedule: str, stages: int, microbatches: int, ops: bool = False) -> None:
    """One iteration of `schedule` within MAX_STAGE_MICROBATCHES (MAX_OPS_STAGE_MICROBATCHES with --ops)."""
    # ZBV plans max(2 ranks - 1, m) microbatches before dropping the extra ones (as torch)
    planned = max(microbatches, stages - 1) if schedule == "ZBVZeroBubble" else microbatches
    limit, name = ((MAX_OPS_STAGE_MICROBATCHES, "MAX_OPS_STAGE_MICROBATCHES") if ops
                   else (MAX_STAGE_MICROBATCHES, "MAX_STAGE_MICROBATCHES"))
    if stages * planned > limit:
        what = f"{planned} microbatches (ZBVZeroBubble plans max(stages - 1, microbatches))" \
            if planned != microbatches else f"{microbatches} microbatches"
        raise InputError(f"{stages} stages x {what} = {stages * planned} is over the limit {name} = {limit}"
                         f"{' (with --ops)' if ops else ''}; use fewer microbatches or stages")


def check_spec(spec: Any, ops: bool = False) -> None:
    """Check every value of a stages.json document before any work (InputError, one line)."""
    if not isinstance(spec, dict):
        raise SimInputError("the input must be a JSON object with at least fwd and bwd")
    unknown = set(spec) - KEYS
    if unknown:
        raise SimInputError(f"unknown keys {sorted(unknown)}; known keys: {sorted(KEYS)}")
    for key in ("fwd", "bwd"):
        if key not in spec:
            raise SimInputError(f"missing {key!r}: a list of per-stage times in seconds")
    m = spec.get("microbatches")
    if m is not None:
        m = integer("microbatches", m, 1, MAX_MICROBATCHES, limit="MAX_MICROBATCHES")
    stages, per_mb = _stage_times("fwd", spec["fwd"], m)
    _stage_times("bwd", spec["bwd"], m)
    if spec.get("wgrad") is not None:
        _stage_times("wgrad", spec["wgrad"], m)
    mb = per_mb or m
    if mb is None:
        raise SimInputError("fwd gives one time per stage, so the number of microbatches must be given "
                            "(\"microbatches\": M)")
    schedule = spec.get("schedule", "1F1B")
    if not isinstance(schedule, str):
        raise InputError(f"schedule must be a string, one of {', '.join(SCHEDULES)}")
    check_cells(canonical_name(schedule), stages, mb, ops)
    comm = spec.get("comm", 0.0)
    if isinstance(comm, dict):
        for k in ("fwd", "bwd"):
            _times(f"comm.{k}", comm.get(k, 0.0))
    else:
        _times("comm", comm)
    if spec.get("stages_per_rank") is not None:
        integer("stages_per_rank", spec["stages_per_rank"], 1, stages)
    integer("dp", spec.get("dp", 1), 1, MAX_DP, limit="MAX_DP")
    for key in ("allreduce", "grad_bytes"):
        if spec.get(key) is not None:
            _times(key, spec[key])
    if spec.get("bandwidth") is not None:
        number("bandwidth", spec["bandwidth"], positive=True)
    number("latency", spec.get("latency", 0.0))
    choice("allreduce_mode", spec.get("allreduce_mode", "overlap"), ALLREDUCE_MODES)
    choice("p2p", spec.get("p2p", "eager"), P2P_MODES)


def _times(name: str, v: Any) -> None:
    """A finite number >= 0, or a flat list of them."""
    vals = v if isinstance(v, list) else [v]
    if len(vals) > MAX_STAGES:
        raise InputError(f"{name} has {len(vals)} entries, over the limit MAX_STAGES = {MAX_STAGES}")
    for i, x in enumerate(vals):
        number(f"{name}[{i}]" if isinstance(v, list) else name, x)


def _stage_times(name: str, v: Any, m: int | None) -> tuple[int, int | None]:
    """(stages, microbatches given by per-microbatch lists or None) of fwd, bwd or wgrad."""
    if not isinstance(v, list) or not v:
        raise SimInputError(f"{name} must be a non-empty list: one time per stage, or one list of "
                            "per-microbatch times per stage")
    if len(v) > MAX_STAGES:
        raise InputError(f"{name} has {len(v)} stages, over the limit MAX_STAGES = {MAX_STAGES}")
    nested = isinstance(v[0], list)
    per_mb = len(v[0]) if nested else None
    for s, row in enumerate(v):
        if isinstance(row, list) != nested:
            raise SimInputError(f"{name} mixes numbers and lists: give one number per stage, or one list per stage")
        if nested:
            if len(row) != per_mb or not row:
                raise SimInputError(f"{name}[{s}] has {len(row)} per-microbatch times, {name}[0] has {per_mb}: "
                                    "every stage needs one time per microbatch")
            if len(row) > MAX_MICROBATCHES:
                raise InputError(f"{name}[{s}] has {len(row)} microbatches, over the limit "
                                 f"MAX_MICROBATCHES = {MAX_MICROBATCHES}")
            if not all(type(x) is float and 0 <= x < math.inf for x in row):
                for k, x in enumerate(row):
                    number(f"{name}[{s}][{k}]", x)
        else:
            number(f"{name}[{s}]", row)
    if nested and m is not None and per_mb != m:
        raise SimInputError(f"{name} has {per_mb} per-microbatch times per stage but microbatches={m}")
    return len(v), per_mb


def main(argv: list[str] | None = None) -> int:
    args = parse_args(_parser(), argv)
    if isinstance(args, int):
        return args
    try:
        number("--indent", args.indent, 0, MAX_INDENT)
        if args.trace is not None and args.ep is not None:
            from dynmo.sim import expert_cli

            return expert_cli.main(args, vars(_parser().parse_args(["--trace", "x"])))
        if args.ep is not None:
            raise InputError("--ep replays a trace: give --trace")
        if args.trace is not None:
            return _replay_main(args)
        spec = read_json(args.input)
        if isinstance(spec, dict):
            for key, val in (("schedule", args.schedule), ("microbatches", args.microbatches),
                             ("dp", args.dp), ("allreduce_mode", args.allreduce_mode),
                             ("p2p", args.p2p)):
                if val is not None:
                    spec[key] = val
        with np.errstate(all="ignore"):
            out = run(spec, trace=args.ops)
        dumps({k: v for k, v in out.items() if k != "trace"})  # NonFiniteError before anything is printed
        write_json(out, indent=args.indent or None)
    except NonFiniteError:
        return fail(PROG, "the times overflow: the iteration time is not a finite number; rescale the times "
                          "(e.g. to milliseconds)")
    except ERRORS as e:
        return fail(PROG, e)
    except OSError as e:  # --plots or --save-trace cannot write
        return fail(PROG, f"cannot write {e.filename or 'the output'}: {e.strerror or e}")
    return 0


def _check_replay_args(args: argparse.Namespace) -> list[str] | None:
    """Check every replay flag before the trace is read; return the asked policies (None: default)."""
    from dynmo.sim.replay import STARTS, parse_policy

    if args.schedule is not None:
        canonical_name(args.schedule)
    check_shape(args)
    if args.stages_per_rank is not None:
        integer("--stages-per-rank", args.stages_per_rank, 1, MAX_STAGES, limit="MAX_STAGES")
    number("--cost-scale", args.cost_scale, positive=True)
    number("--params-scale", args.params_scale, positive=True)
    choice("--when", args.when, WHEN)
    integer("--every", args.every, 1, MAX_STEPS, limit="MAX_STEPS")
    integer("--window", args.window, 1, MAX_STEPS, limit="MAX_STEPS")
    integer("--horizon", args.horizon, 1, 10**9)
    number("--min-gain", args.min_gain)
    number("--confidence", args.confidence, 0.5, 1)
    integer("--confirm", args.confirm, 0, MAX_STEPS, limit="MAX_STEPS")
    number("--repack-tolerance", args.repack_tolerance)
    number("--mig-bandwidth", args.mig_bandwidth, positive=True, allow_inf=True)
    number("--mig-fixed", args.mig_fixed)
    number("--restart-s", args.restart_s)
    number("--comm", args.comm)
    choice("--links", args.links, ("measure", "free"))
    if args.profile_steps is not None:
        integer("--profile-steps", args.profile_steps, 1, MAX_STEPS, limit="MAX_STEPS")
    choice("--start", args.start, STARTS)
    if args.oracle_window is not None:
        integer("--oracle-window", args.oracle_window, 1, MAX_STEPS, limit="MAX_STEPS")
    args.link_delay_s = _link_delay(args.link_delay)
    number("--op-overhead", args.op_overhead)
    if args.allreduce_bandwidth is not None:
        number("--allreduce-bandwidth", args.allreduce_bandwidth, positive=True)
    number("--allreduce-latency", args.allreduce_latency)
    choice("--shard", args.shard, ("none", "optimizer", "full"))
    if args.policies is None:
        return None
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    if not policies:
        raise InputError("--policies is empty; give e.g. uniform,optimal,oracle")
    for p in policies:
        parse_policy(p)
    return policies


def _check_replay_size(trace, policies: list[str], schedule: str, stages: int, microbatches: int) -> None:
    """The replay's work and kept series within the limits; balancers within theirs."""
    from dynmo.sim.replay import parse_policy

    n, steps = trace.num_layers, len(trace.steps)
    # the static layouts are replayed as the speedups' references (best static) when not asked for
    k = len(set(policies) | {"uniform", "params", "profile-once"})
    if stages > MAX_STAGES:
        raise InputError(f"{stages} stages is over the limit MAX_STAGES = {MAX_STAGES}; give --stages")
    if stages > n:
        raise SimInputError(f"cannot split {n} layers into {stages} stages; scale the trace to more blocks "
                            "(--scale-blocks) or use fewer stages")
    check_cells(schedule, stages, microbatches)
    cells = stages * microbatches
    ops = k * steps * cells
    if ops > MAX_REPLAY_OPS:
        raise InputError(f"{k} policies x {steps} steps x {stages} stages x {microbatches} microbatches = {ops:.3g} "
                         f"is over the limit MAX_REPLAY_OPS = {MAX_REPLAY_OPS:.0e}; replay fewer steps, "
                         "policies (--policies) or microbatches")
    series = k * steps * stages
    if series > MAX_REPLAY_SERIES:
        raise InputError(f"{k} policies x {steps} steps x {stages} stages = {series:.3g} is over the limit "
                         f"MAX_REPLAY_SERIES = {MAX_REPLAY_SERIES:.0e}; replay fewer steps, policies or stages")
    bases = {parse_policy(p)[0] for p in policies}
    if bases - {"uniform"} and n * stages > MAX_LAYER_STAGES:
        raise InputError(f"{n} layers x {stages} stages = {n * stages} is over the balancers' limit "
                         f"MAX_LAYER_STAGES = {MAX_LAYER_STAGES}; use fewer layers or stages")
    if bases & {"params", "deepspeed"}:
        try:
            check_deepspeed_size(n, stages)
        except BalanceError as e:
            raise InputError(f"policy params/deepspeed: {e}; leave it out of --policies") from None


def _replay_main(args: argparse.Namespace) -> int:
    from dynmo.sim.replay import ReplayOptions, default_policies, replay, replay_balance, summary_table, trace_summary
    from dynmo.sim.trace import load_trace, scale_trace

    asked = _check_replay_args(args)
    trace = load_trace(args.trace)
    if args.scale_blocks:
        trace = scale_trace(trace, args.scale_blocks, cost_scale=args.cost_scale,
                            params_scale=args.params_scale, noise=args.noise)
    if args.save_trace:
        trace.write(args.save_trace)
    balance = replay_balance(when=args.when, every=args.every, window=args.window, min_gain=args.min_gain,
                             confidence=args.confidence, confirm=args.confirm, horizon=args.horizon, repack_tolerance=args.repack_tolerance,
                             retune_microbatches=args.retune_microbatches, links=args.links)
    opts = ReplayOptions(
        schedule=args.schedule, microbatches=args.microbatches, stages_per_rank=args.stages_per_rank,
        balance=balance, migration_bandwidth=args.mig_bandwidth,
        migration_fixed_s=args.mig_fixed, restart_s=args.restart_s, charge_decide=not args.no_decide_time, comm=args.comm,
        op_overhead=args.op_overhead,
        p2p=args.p2p or "eager", allreduce_bandwidth=args.allreduce_bandwidth,
        allreduce_latency=args.allreduce_latency, shard=args.shard, initial=args.start,
        oracle_window=args.oracle_window,
        **({"profile_steps": args.profile_steps} if args.profile_steps is not None else {}),
    )
    policies = asked or default_policies(trace, opts)
    h = trace.header
    stages = args.stages or h.pp * h.virtual_stages
    if args.link_delay_s is not None:
        delay = args.link_delay_s * (stages - 1) if len(args.link_delay_s) == 1 else args.link_delay_s
        if len(delay) != stages - 1:
            raise InputError(f"--link-delay has {len(delay)} values; give one number or one per link "
                             f"(stages - 1 = {stages - 1})")
        opts = replace(opts, link_delay=delay or None)
    _check_replay_size(trace, policies, canonical_name(args.schedule or h.schedule), stages,
                       args.microbatches or h.microbatches)
    with np.errstate(all="ignore"):
        results = replay(trace, stages, args.dp, policies, opts)
    info = trace_summary(trace)
    shape = _shape(trace, results, args, opts)
    notes = _missing(trace, opts, shape)
    dumps([info, shape, [r.as_dict(per_step=False) for r in results]])  # NonFiniteError if a result overflowed
    plots = []
    if args.plots:
        from dynmo.sim.plots import write_plots

        title = f"{info['case']}, {shape['stages']} stages x {shape['dp']} dp"
        plots = [str(p) for p in write_plots(results, args.plots, title)]
    if args.json:
        doc = {"trace": info, "replay": shape, "not_modelled": notes, "plots": plots,
               "policies": [r.as_dict() for r in results]}
        write_json(doc, indent=args.indent or None)
        return 0
    print(f"trace: {args.trace} ({info['source']}), case {info['case']}, {info['layers']} layers, "
          f"{info['steps']} steps, dynamism at steps {info['dynamism_steps'] or 'none'}")
    print(f"replay: {shape['schedule']}, {shape['stages']} stages on {shape['ranks']} ranks x {shape['dp']} dp "
          f"= {shape['workers']} workers, {shape['microbatches']} microbatches, controller when={opts.balance.when}"
          + {"optimizer": f", optimizer state sharded over the {shape['dp']} replicas",
             "full": f", weights, gradients and optimizer state sharded over the {shape['dp']} replicas (FSDP2)"}
          .get(opts.shard, ""))
    print(summary_table(results))
    print("speedup: total time of static uniform / this policy's (migrations and decide time included); "
          "/worker: the same per worker-second; bottleneck: mean slowest stage per microbatch")
    for n in notes:
        print(f"not modelled: {n}")
    for p in plots:
        print(f"wrote {p}")
    return 0


def _link_delay(text: str | None) -> list[float] | None:
    """--link-delay: seconds, one number or a comma-separated list; None when not given."""
    if text is None:
        return None
    parts = [p.strip() for p in str(text).split(",")]
    if len(parts) > MAX_STAGES:
        raise InputError(f"--link-delay has {len(parts)} values, over the limit MAX_STAGES = {MAX_STAGES}")
    out = []
    for p in parts:
        try:
            v = float(p)
        except ValueError:
            raise InputError(f"--link-delay: {p!r:.40} is not a number of seconds; give e.g. 0.01 or 0.01,0") from None
        number("--link-delay", v)
        out.append(v)
    return out


def _shape(trace, results, args, opts) -> dict:
    from dynmo.engine import canonical_name

    h = trace.header
    first = results[0]
    stages = len(first.layouts[0]) - 1
    dp = args.dp or h.dp
    return {"schedule": canonical_name(opts.schedule or h.schedule), "stages": stages,
            "ranks": first.workers[0] // dp, "dp": dp, "workers": first.workers[0],
            "microbatches": opts.microbatches or h.microbatches, "stages_per_rank": stages // (first.workers[0] // dp),
            "shard": opts.shard}


def _missing(trace, opts, shape) -> list[str]:
    """What this replay leaves out, said in the output."""
    out = []
    sharded = opts.shard == "optimizer" and shape["dp"] > 1
    full = opts.shard == "full" and shape["dp"] > 1
    if shape["dp"] > 1 and not opts.allreduce_bandwidth:
        if full:
            out.append("FSDP collectives: each unit's parameter all-gathers before its forward and its backward and "
                       "its gradient reduce-scatter, per microbatch (give --allreduce-bandwidth bytes/s)")
        else:
            out.append("data-parallel gradient all-reduce" + (" and the sharded optimizer's parameter all-gather"
                       if sharded else "") + " (give --allreduce-bandwidth bytes/s)")
    if sharded:
        out.append("sharding beyond the optimizer state (weights and gradients stay whole on every replica), "
                   "reduce-scatter (the gradients are all-reduced, as the runtime does) and per-worker memory "
                   "(the saving shows in migration bytes only)")
        if "prune" in trace.header.case:
            out.append("pruning with a sharded optimizer: the runtime does not run it yet (a what-if)")
    if full:
        out.append(_full_missing(trace, opts))
        refused = _full_refused(trace)
        if refused:
            out.append(f"{' and '.join(refused)} with parallel.shard = \"full\": the runtime does not run it yet "
                       "(a what-if)")
    if "freeze" in trace.header.case and _measured_bytes_rescaled(trace, opts, shape["dp"]):
        out.append("frozen layers' missing AdamW state: the traced run's measured state bytes are rescaled to "
                   "this replay's sharding as if every layer held weights, gradients and both moments")
    if opts.comm == 0 and not opts.link_delay:
        out.append("stage-to-stage transfer time (give --comm seconds)")
    if opts.op_overhead == 0:
        out.append("per-op runtime overhead outside the measured compute (give --op-overhead seconds)")
    if "ZeroBubble" in shape["schedule"] and any(s.wgrad is None for s in trace.steps):
        out.append("measured weight-gradient split: the zero-bubble schedules take wgrad = bwd / 2")
    if not opts.balance.retune_microbatches:
        out.append("micro-batch re-tuning after re-packing (give --retune-microbatches)")
    if shape["stages_per_rank"] > 1:
        out.append("re-packing: the runtime re-packs only with one stage per rank, so +repack policies are left out")
    out.append("per-layer cost changes caused by the placement itself (costs are replayed as traced)")
    return out


def _full_missing(trace, opts) -> str:
    """What the replay leaves out of parallel.shard = "full"."""
    from dynmo.sim.replay.runner import traced_shard

    s = "per-worker memory, the units being gathered included (the saving shows in migration bytes only)"
    if opts.allreduce_bandwidth:
        s = ("overlap of the FSDP collectives with compute (each runs inside its forward or backward op; FSDP2's "
             "prefetch is not modelled), " + s)
        if traced_shard(trace) == "full":
            s += (f"; the traced run sharded fully at dp {trace.header.dp}: its measured layer times hold its own "
                  "collectives, and the modelled ones come on top")
    return s


def _full_refused(trace) -> list[str]:
    """The traced run's features the runtime refuses with parallel.shard = "full"."""
    case = trace.header.case
    model = trace.header.config.get("model")
    tied = isinstance(model, dict) and model.get("tie_embeddings") is True
    return [what for what, on in (("pruning", "prune" in case), ("freezing", "freeze" in case),
                                  ("early exit", "early-exit" in case), ("tied embeddings", tied)) if on]


def _measured_bytes_rescaled(trace, opts, dp: int) -> bool:
    """Whether the replay scales the trace's measured state bytes (its sharding differs from the traced run's)."""
    from dynmo.loop import bytes_per_param
    from dynmo.sim.replay.runner import traced_shard

    h = trace.header
    return any(s.state_bytes is not None for s in trace.steps) and \
        bytes_per_param(opts.shard, dp) != bytes_per_param(traced_shard(trace), h.dp)


if __name__ == "__main__":
    sys.exit(main())
