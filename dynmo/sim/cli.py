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
"""

from __future__ import annotations

import argparse
import json
import sys

from dynmo.config import BalanceConfig
from dynmo.controller import MIGRATION_BANDWIDTH, MIGRATION_FIXED_S
from dynmo.jsonio import read_json
from dynmo.sim.engine import ALLREDUCE_MODES, P2P_MODES, SimInputError, simulate
from dynmo.sim.schedules import SCHEDULES, ScheduleError
from dynmo.sim.trace import TraceError

KEYS = {
    "schedule", "microbatches", "fwd", "bwd", "wgrad", "comm", "stages_per_rank", "dp",
    "allreduce", "grad_bytes", "bandwidth", "latency", "allreduce_mode", "p2p",
}


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
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
    r.add_argument("--policies", help="comma-separated: uniform, params, optimal, deepspeed, "
                   "diffusion-contiguous, <balancer>+repack, oracle (default: all)")
    r.add_argument("--scale-blocks", type=int, help="first scale the trace to N transformer blocks (scale_trace)")
    r.add_argument("--cost-scale", type=float, default=1.0, help="with --scale-blocks: multiply layer costs")
    r.add_argument("--params-scale", type=float, default=1.0, help="with --scale-blocks: multiply block params")
    r.add_argument("--noise", type=float, default=0.0, help="with --scale-blocks: lognormal sigma per block and step")
    b = BalanceConfig()  # the DynMo loop's knobs default as in a training config's [balance]
    r.add_argument("--when", default="auto", help="controller trigger: every, dynamism or auto (default auto)")
    r.add_argument("--every", type=int, default=b.every, help=f"with --when every: steps between rebalances (default {b.every})")
    r.add_argument("--window", type=int, default=b.window, help=f"controller's median forecast window (default {b.window})")
    r.add_argument("--min-gain", type=float, default=b.min_gain, help=f"auto: minimum bottleneck reduction (default {b.min_gain})")
    r.add_argument("--horizon", type=int, default=b.horizon, help=f"auto: steps the saving must repay the migration in (default {b.horizon})")
    r.add_argument("--repack-tolerance", type=float, default=b.repack_tolerance,
                   help=f"+repack: allowed bottleneck growth (default {b.repack_tolerance})")
    r.add_argument("--retune-microbatches", action="store_true",
                   help="+repack: fewer microbatches for the shorter pipeline (as balance.retune_microbatches)")
    r.add_argument("--mig-bandwidth", type=float, default=MIGRATION_BANDWIDTH,
                   help=f"migration bytes/s (default {MIGRATION_BANDWIDTH:g})")
    r.add_argument("--mig-fixed", type=float, default=MIGRATION_FIXED_S,
                   help=f"fixed seconds per migration (default {MIGRATION_FIXED_S})")
    r.add_argument("--no-decide-time", action="store_true", help="do not charge the controller's decide time")
    r.add_argument("--comm", type=float, default=0.0, help="seconds per stage-to-stage transfer (default 0)")
    r.add_argument("--op-overhead", type=float, default=0.0,
                   help="seconds per forward/backward op spent outside it (1.4e-3 fitted on this machine's gloo runs)")
    r.add_argument("--allreduce-bandwidth", type=float, help="bytes/s of the dp gradient ring all-reduce "
                   "(default: not modelled)")
    r.add_argument("--allreduce-latency", type=float, default=0.0, help="seconds per all-reduce")
    r.add_argument("--plots", metavar="DIR", help="write PNG plots to DIR")
    r.add_argument("--json", action="store_true", help="print JSON instead of the table")
    r.add_argument("--save-trace", metavar="FILE", help="write the (converted or scaled) trace to FILE")
    return ap


def run(spec: dict, trace: bool = False) -> dict:
    """Simulate a stages.json document (already parsed); return the output document."""
    if not isinstance(spec, dict):
        raise SimInputError("the input must be a JSON object with at least fwd and bwd")
    unknown = set(spec) - KEYS
    if unknown:
        raise SimInputError(f"unknown keys {sorted(unknown)}; known keys: {sorted(KEYS)}")
    for key in ("fwd", "bwd"):
        if key not in spec:
            raise SimInputError(f"missing {key!r}: a list of per-stage times in seconds")
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


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.trace is not None:
        try:
            return _replay_main(args)
        except (SimInputError, ScheduleError, TraceError, ValueError) as e:
            print(f"dynmo simulate: {e}", file=sys.stderr)
            return 2
    try:
        spec = read_json(args.input)
    except ValueError as e:
        print(f"dynmo simulate: {e}", file=sys.stderr)
        return 2
    if isinstance(spec, dict):
        for key, val in (("schedule", args.schedule), ("microbatches", args.microbatches),
                         ("dp", args.dp), ("allreduce_mode", args.allreduce_mode),
                         ("p2p", args.p2p)):
            if val is not None:
                spec[key] = val
    try:
        out = run(spec, trace=args.ops)
    except (SimInputError, ScheduleError) as e:
        print(f"dynmo simulate: {e}", file=sys.stderr)
        return 2
    print(json.dumps(out, indent=args.indent or None))
    return 0


def _replay_main(args: argparse.Namespace) -> int:
    from dynmo.sim.replay import ReplayOptions, default_policies, replay, replay_balance, summary_table, trace_summary
    from dynmo.sim.trace import load_trace, scale_trace

    trace = load_trace(args.trace)
    if args.scale_blocks:
        trace = scale_trace(trace, args.scale_blocks, cost_scale=args.cost_scale,
                            params_scale=args.params_scale, noise=args.noise)
    if args.save_trace:
        trace.write(args.save_trace)
    balance = replay_balance(when=args.when, every=args.every, window=args.window, min_gain=args.min_gain,
                             horizon=args.horizon, repack_tolerance=args.repack_tolerance,
                             retune_microbatches=args.retune_microbatches)
    opts = ReplayOptions(
        schedule=args.schedule, microbatches=args.microbatches, stages_per_rank=args.stages_per_rank,
        balance=balance, migration_bandwidth=args.mig_bandwidth,
        migration_fixed_s=args.mig_fixed, charge_decide=not args.no_decide_time, comm=args.comm,
        op_overhead=args.op_overhead,
        p2p=args.p2p or "eager", allreduce_bandwidth=args.allreduce_bandwidth,
        allreduce_latency=args.allreduce_latency,
    )
    policies = [p.strip() for p in args.policies.split(",") if p.strip()] if args.policies else default_policies(trace, opts)
    results = replay(trace, args.stages, args.dp, policies, opts)
    info = trace_summary(trace)
    shape = _shape(trace, results, args, opts)
    notes = _missing(trace, opts, shape)
    plots = []
    if args.plots:
        from dynmo.sim.plots import write_plots

        title = f"{info['case']}, {shape['stages']} stages x {shape['dp']} dp"
        plots = [str(p) for p in write_plots(results, args.plots, title)]
    if args.json:
        doc = {"trace": info, "replay": shape, "not_modelled": notes, "plots": plots,
               "policies": [r.as_dict() for r in results]}
        print(json.dumps(doc, indent=args.indent or None))
        return 0
    print(f"trace: {args.trace} ({info['source']}), case {info['case']}, {info['layers']} layers, "
          f"{info['steps']} steps, dynamism at steps {info['dynamism_steps'] or 'none'}")
    print(f"replay: {shape['schedule']}, {shape['stages']} stages on {shape['ranks']} ranks x {shape['dp']} dp "
          f"= {shape['workers']} workers, {shape['microbatches']} microbatches, controller when={opts.balance.when}")
    print(summary_table(results))
    print("speedup: total time of static uniform / this policy's (migrations and decide time included); "
          "/worker: the same per worker-second; bottleneck: mean slowest stage per microbatch")
    for n in notes:
        print(f"not modelled: {n}")
    for p in plots:
        print(f"wrote {p}")
    return 0


def _shape(trace, results, args, opts) -> dict:
    from dynmo.sim.schedules import canonical_name

    h = trace.header
    first = results[0]
    stages = len(first.layouts[0]) - 1
    dp = args.dp or h.dp
    return {"schedule": canonical_name(opts.schedule or h.schedule), "stages": stages,
            "ranks": first.workers[0] // dp, "dp": dp, "workers": first.workers[0],
            "microbatches": opts.microbatches or h.microbatches, "stages_per_rank": stages // (first.workers[0] // dp)}


def _missing(trace, opts, shape) -> list[str]:
    """What this replay leaves out, said in the output."""
    out = []
    if shape["dp"] > 1 and not opts.allreduce_bandwidth:
        out.append("data-parallel gradient all-reduce (give --allreduce-bandwidth bytes/s)")
    if opts.comm == 0:
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


if __name__ == "__main__":
    sys.exit(main())
