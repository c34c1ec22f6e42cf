"""`dynmo simulate --trace T --ep E`: a MoE trace replayed with expert parallelism.

    dynmo simulate --trace moe.jsonl --stages 16 --dp 8 --ep 8 [--scale-blocks 32] [--microbatches 64]
                   [--layouts fixed|dynmo] [--extra-slots S --copies C] [--a2a-bandwidth B]
                   [--experts-every N] [--window W] [--min-gain G] [--confidence P] [--horizon H]
                   [--mig-bandwidth B] [--mig-fixed S] [--json]

The experts of every MoE layer spread over E data-parallel replicas of its stage; the policies
static, dynmo (the trainer's `balance.experts = "auto"`, and with `--layouts dynmo` its layer
controller too) and the per-step oracle (`dynmo.sim.replay.expert_policies`; what is modelled:
`dynmo.sim.replay.experts`). Prints the table of benchmarks/replay_experts.py for the one trace,
or with `--json` every figure and the per-step series. The layer replay's own options (policies,
starts, links, sharding, plots) do not apply and are refused in one line, exit 2, as is a trace
without routing or an E that does not divide the experts or dp.
"""

from __future__ import annotations

import argparse

from dynmo.jsonio import InputError, integer, write_json
from dynmo.sim.args import check_shape
from dynmo.sim.trace import MAX_DP

# the layer replay's own options: with --ep, any value but the parser's default is refused
NOT_WITH_EP = ("policies", "start", "oracle_window", "stages_per_rank", "cost_scale", "params_scale", "when", "every",
               "confirm", "repack_tolerance", "retune_microbatches", "restart_s", "no_decide_time", "comm",
               "link_delay", "links", "profile_steps", "op_overhead", "allreduce_bandwidth", "allreduce_latency",
               "shard", "plots", "save_trace", "schedule", "p2p")


def check(args: argparse.Namespace, defaults: dict) -> None:
    """Every --ep flag in range, and none of the layer replay's own: InputError (one line)."""
    for name in NOT_WITH_EP:
        if getattr(args, name) != defaults[name]:
            raise InputError(f"--{name.replace('_', '-')} does not apply with --ep (the expert replay); "
                             "leave it out or replay without --ep")
    integer("--ep", args.ep, 1, MAX_DP, limit="MAX_DP")
    check_shape(args)


def main(args: argparse.Namespace, defaults: dict) -> int:
    from dynmo.sim.replay.expert_policies import replay_experts
    from dynmo.sim.replay.expert_render import split_line, table_lines
    from dynmo.sim.replay.experts import ExpertOptions
    from dynmo.sim.trace import load_trace, scale_trace

    check(args, defaults)
    opts = ExpertOptions(microbatches=args.microbatches, extra_slots=args.extra_slots, copies=args.copies,
                         a2a_bandwidth=args.a2a_bandwidth, every=args.experts_every, window=args.window,
                         min_gain=args.min_gain, confidence=args.confidence, horizon=args.horizon,
                         mig_fixed=args.mig_fixed, mig_bandwidth=args.mig_bandwidth)
    opts.check()
    trace = load_trace(args.trace)
    if args.scale_blocks:
        trace = scale_trace(trace, args.scale_blocks, noise=args.noise)
    h = trace.header
    stages = args.stages or h.pp * h.virtual_stages
    dp = args.dp or h.dp
    out = replay_experts(trace, stages, dp, args.ep, opts, layouts=args.layouts)
    if args.json:
        write_json({"trace": str(args.trace), "ep": args.ep, **out.as_dict()}, indent=args.indent or None)
        return 0
    sh = out.shape
    print(f"trace: {args.trace}, {sh['moe_layers']} MoE layers of {sh['experts']} experts, {sh['steps']} steps")
    print(f"replay: {sh['schedule']}, {stages} stages x {dp} dp, E = {args.ep} ({sh['groups']} EP groups a stage), "
          f"{sh['microbatches']} microbatches, layer layout {args.layouts}")
    for line in table_lines([(str(args.trace), args.ep, out)]):
        print(line)
    print(split_line(str(args.trace), out))
    return 0
