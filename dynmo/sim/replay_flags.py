"""The flags of a trace replay (`dynmo simulate --trace`), each checked before the trace is read.

Bad values raise InputError (one line; `dynmo simulate: error: ...`, exit 2). The flags checked
the same way with and without --ep are `dynmo.sim.args`. Pure.
"""

from __future__ import annotations

import argparse

from dynmo.engine import canonical_name
from dynmo.jsonio import InputError, choice, integer, number
from dynmo.sim.args import check_shape
from dynmo.sim.trace import MAX_STAGES, MAX_STEPS

WHEN = ("every", "dynamism", "auto")


def check_replay_args(args: argparse.Namespace) -> list[str] | None:
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
    args.link_delay_s = link_delay(args.link_delay)
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


def link_delay(text: str | None) -> list[float] | None:
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
