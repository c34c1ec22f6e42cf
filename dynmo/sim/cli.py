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

This module holds the limits, the --input path (stages.json checked, then simulated) and the
replay's run; the flags are `dynmo.sim.parser`, the replay flags' checks `dynmo.sim.replay_flags`,
the replay's output `dynmo.sim.report`, and --ep `dynmo.sim.expert_cli`.
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
from dynmo.config import ConfigError
from dynmo.engine import ALLREDUCE_MODES, P2P_MODES, SCHEDULES, ScheduleError, SimInputError, canonical_name, simulate
from dynmo.jsonio import (
    InputError, NonFiniteError, choice, dumps, fail, integer, number, parse_args, read_json, write_json,
)
from dynmo.sim.parser import build_parser
from dynmo.sim.replay_flags import WHEN, check_replay_args
from dynmo.sim.report import not_modelled, replay_shape, write_report
from dynmo.sim.trace import MAX_DP, MAX_MICROBATCHES, MAX_STAGES, TraceError

__all__ = ["KEYS", "MAX_INDENT", "MAX_OPS_STAGE_MICROBATCHES", "MAX_REPLAY_OPS", "MAX_REPLAY_SERIES",
           "MAX_STAGE_MICROBATCHES", "WHEN", "build_parser", "check_cells", "check_spec", "main", "run"]

PROG = "dynmo simulate"

# Limits (docs/simulator.md, "Limits and exit codes"); the trace limits live in dynmo.sim.trace.
# One simulated iteration holds ~2-3 ops per stage and microbatch with their times: 10^6
# stage-microbatches take ~0.8 GB and 15-40 s; printing every op (--ops) takes ~4x that memory.
MAX_STAGE_MICROBATCHES = 1_000_000  # stages x microbatches of one iteration
MAX_OPS_STAGE_MICROBATCHES = 250_000  # the same with --ops (every op's start and end printed)
MAX_REPLAY_OPS = 30_000_000  # replay: policies x steps x stages x microbatches (engine work)
MAX_REPLAY_SERIES = 10_000_000  # replay: policies x steps x stages (per-step loads and layouts kept)
MAX_INDENT = 8
# every bad-input error of the simulator, the balancers and the [balance] checks is a ValueError
ERRORS = (InputError, SimInputError, ScheduleError, TraceError, BalanceError, ConfigError, ValueError)

KEYS = {
    "schedule", "microbatches", "fwd", "bwd", "wgrad", "comm", "stages_per_rank", "dp",
    "allreduce", "grad_bytes", "bandwidth", "latency", "allreduce_mode", "p2p",
}


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
    args = parse_args(build_parser(), argv)
    if isinstance(args, int):
        return args
    try:
        number("--indent", args.indent, 0, MAX_INDENT)
        if args.trace is not None and args.ep is not None:
            from dynmo.sim import expert_cli

            return expert_cli.main(args, vars(build_parser().parse_args(["--trace", "x"])))
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
    from dynmo.sim.replay import ReplayOptions, default_policies, replay, replay_balance, trace_summary
    from dynmo.sim.trace import load_trace, scale_trace

    asked = check_replay_args(args)
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
    shape = replay_shape(trace, results, args, opts)
    notes = not_modelled(trace, opts, shape)
    dumps([info, shape, [r.as_dict(per_step=False) for r in results]])  # NonFiniteError if a result overflowed
    plots = []
    if args.plots:
        from dynmo.sim.plots import write_plots

        title = f"{info['case']}, {shape['stages']} stages x {shape['dp']} dp"
        plots = [str(p) for p in write_plots(results, args.plots, title)]
    write_report(args, info, shape, opts, results, notes, plots)
    return 0


if __name__ == "__main__":
    sys.exit(main())
