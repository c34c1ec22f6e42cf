"""The command line of `dynmo simulate`: its flags, their help and defaults, and its examples.

Only argparse: the checks of the values are `dynmo.sim.cli` (--input), `dynmo.sim.replay_flags`
(--trace) and `dynmo.sim.expert_cli` (--ep). Pure.
"""

from __future__ import annotations

import argparse
import textwrap

from dynmo.config import BalanceConfig
from dynmo.controller import MIGRATION_BANDWIDTH, MIGRATION_FIXED_S, RESTART_S
from dynmo.engine import ALLREDUCE_MODES, P2P_MODES, SCHEDULES
from dynmo.jsonio import ArgumentParser

EXAMPLES = """\
examples:
  dynmo simulate --input stages.json --indent 0
  dynmo simulate --trace docs/bench/traces/skewed-static.jsonl --scale-blocks 48 --stages 24 --dp 30 \\
      --policies uniform,optimal,oracle --plots plots24
  dynmo simulate --trace docs/bench/traces/moe-static.jsonl --stages 4 --dp 8 --ep 4 --layouts dynmo
"""
DESCRIPTION = ("With --input: simulate one training iteration of a pipeline schedule from per-stage times and "
               "print JSON (iteration_time, bubble_ratio split into bubble_inherent and bubble_imbalance, per-rank "
               "busy_s / idle_s). With --trace: replay a per-layer cost trace under static and dynamic balancing "
               "policies and print a table.")


def build_parser() -> ArgumentParser:
    """The parser of `dynmo simulate`: its help ends with examples (`EXAMPLES`)."""
    ap = ArgumentParser(prog="dynmo simulate", description=textwrap.fill(DESCRIPTION, 78), epilog=EXAMPLES,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
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
