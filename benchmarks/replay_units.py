"""What finer placement units buy: one sublayer trace replayed with block units and with sublayer units.

    python benchmarks/replay_units.py TRACE.jsonl [TRACE2.jsonl ...] [--blocks 48 --stages 24 --dp 30 --microbatches 96]

Each trace comes from a run with `parallel.unit = "sublayer"` (kinds E, a m per block, L: each
block's attention half and MLP half timed as two units). It is scaled to --blocks blocks with no
added noise (`scale_trace`, which keeps the halves) and replayed on --stages stages x --dp
replicas with --microbatches microbatches twice: with sublayer units, and with whole blocks
(`merge_units` of the same scaled trace, so both replays run the same per-step costs and differ
only in where a stage boundary may fall). One row per trace and unit kind:

  best static        the fastest static layout (uniform, params, profile-once) and its total seconds;
  balance gap        per step, the slowest stage of the optimal contiguous layout (`dynmo.balance`,
                     min-max) over the perfectly balanced stage load (the step's total cost / stages),
                     median over the run's second half: 1 is a perfect split, the excess is what the
                     size of the units leaves unbalanced;
  dynmo              total seconds of policy `optimal` with `balance.when = auto`, started from
                     uniform (migrations and decide time included), and its migrations;
  oracle             total seconds of the oracle (each step's best layout, changed for free);
  sublayer / block   the sublayer row's best static, dynmo and oracle totals over the block row's
                     (< 1: the finer units are faster).

Pure; no torch.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

from dynmo.balance import BalanceError, Problem, balance
from dynmo.sim.engine import SimInputError
from dynmo.sim.replay import ReplayOptions, replay, replay_balance
from dynmo.sim.trace import SUBLAYER, Trace, TraceError, load_trace, merge_units, scale_trace, unit_of

POLICIES = ["uniform", "params", "profile-once", "optimal", "oracle"]


def balance_gap(trace: Trace, stages: int) -> float:
    """Median over the second half of the steps of the optimal min-max layout's slowest stage over
    the step's total cost / stages: what contiguous placement of these units cannot balance,
    whichever policy places them."""
    costs = trace.costs()
    gaps = [balance(Problem(costs=c.tolist(), stages=stages), "optimal").bottleneck / (c.sum() / stages)
            for c in costs[len(costs) // 2:] if c.sum() > 0]
    return float(np.median(gaps)) if gaps else float("nan")


def row(trace: Trace, stages: int, dp: int, microbatches: int) -> dict:
    """The replayed totals of one unit kind: the best static layout, dynmo, the oracle, and the balance gap."""
    opts = ReplayOptions(microbatches=microbatches, balance=replay_balance(when="auto"))
    res = {r.policy: r for r in replay(trace, stages, dp, POLICIES, opts)}
    best = res["optimal"].best_static
    return {"layers": trace.num_layers, "best_static": best, "best_static_s": res[best].total_s,
            "gap": balance_gap(trace, stages), "dynmo_s": res["optimal"].total_s,
            "migrations": res["optimal"].migrations, "oracle_s": res["oracle"].total_s}


def sublayer_trace(path: Path) -> Trace:
    """The trace at `path`; TraceError unless its units are attention and MLP halves."""
    trace = load_trace(path)
    if unit_of(trace.header.kinds, str(path)) != SUBLAYER:
        raise TraceError(f"{path} is not a sublayer trace (kinds E, a, m, ..., L); record one with "
                         "parallel.unit = \"sublayer\"")
    return trace


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("traces", nargs="+", type=Path, help="traces of runs with parallel.unit = \"sublayer\"")
    ap.add_argument("--blocks", type=int, default=48)
    ap.add_argument("--stages", type=int, default=24)
    ap.add_argument("--dp", type=int, default=30)
    ap.add_argument("--microbatches", type=int, default=96)
    args = ap.parse_args(argv)
    print(f"python benchmarks/replay_units.py {' '.join(map(str, args.traces))} --blocks {args.blocks} "
          f"--stages {args.stages} --dp {args.dp} --microbatches {args.microbatches}\n")
    print("| trace | units | layers | best static | best static s | balance gap | dynmo s | dynmo migrations "
          "| oracle s | sublayer / block (best static, dynmo, oracle) |")
    print("|---|---|---:|---|---:|---:|---:|---:|---:|---|")
    for path in args.traces:
        t0 = time.perf_counter()
        try:
            sub = scale_trace(sublayer_trace(path), args.blocks)
            rows = {"block": row(merge_units(sub), args.stages, args.dp, args.microbatches),
                    "sublayer": row(sub, args.stages, args.dp, args.microbatches)}
        except (TraceError, SimInputError, BalanceError) as e:
            print(f"replay_units: {e}", file=sys.stderr)
            return 2
        for units, r in rows.items():
            ref = rows["block"]
            vs = "reference" if units == "block" else ", ".join(
                f"{r[k] / ref[k]:.3f}" for k in ("best_static_s", "dynmo_s", "oracle_s"))
            print(f"| {path.stem} | {units} | {r['layers']} | {r['best_static']} | {r['best_static_s']:.4g} | "
                  f"{r['gap']:.3f} | {r['dynmo_s']:.4g} | {r['migrations']} | {r['oracle_s']:.4g} | {vs} |", flush=True)
        print(f"replay_units: {path.stem} in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
