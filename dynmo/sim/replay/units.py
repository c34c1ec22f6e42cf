"""Whole blocks against half blocks: one sublayer trace replayed with each kind of placement unit.

    from dynmo.sim.replay.units import load_sublayer_trace, replay_units
    rows = replay_units(load_sublayer_trace("docs/bench/traces/sublayer/dense-80.jsonl"),
                        blocks=48, stages=24, dp=30, microbatches=96)
    rows["block"]["gap"], rows["sublayer"]["gap"], rows["sublayer"]["vs_block"]["dynmo_s"]

The trace comes from a run with `parallel.unit = "sublayer"` (kinds E, a m per block, L: each
block's attention half and MLP half timed as two units). It is scaled to `blocks` blocks with no
added noise (`scale_trace`, which keeps the halves) and replayed twice on `stages` stages x `dp`
replicas with `microbatches` microbatches: with sublayer units, and with whole blocks
(`merge_units` of the same scaled trace, so both replays run the same per-step costs and differ
only in where a stage boundary may fall). Per unit kind, a row:

  best_static, best_static_s   the fastest static layout (uniform, params, profile-once), its total seconds;
  gap                          the balance gap: per step, the slowest stage of the optimal contiguous
                               layout (`dynmo.balance`, min-max) over the perfectly balanced stage load
                               (the step's total cost / stages), median over the run's second half: 1 is a
                               perfect split, the excess is what the size of the units leaves unbalanced;
  dynmo_s, migrations          total seconds of policy `optimal` with `balance.when = auto`, started from
                               uniform (migrations and decide time included), and its migrations;
  oracle_s                     total seconds of the oracle (each step's best layout, changed for free);
  dynmo_vs_best_static,        best_static_s over dynmo's / the oracle's total (> 1: faster than the best
  oracle_vs_best_static        static layout);
  vs_block                     (sublayer row only) its best_static_s, dynmo_s and oracle_s over the block
                               row's (< 1: the finer units are faster).

Every block layout is also a sublayer layout, so the sublayer row's balance gap is never the larger.
Pure; no torch.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from dynmo.balance import Problem, balance
from dynmo.sim.replay.options import ReplayOptions, replay_balance
from dynmo.sim.replay.run import replay
from dynmo.sim.trace import SUBLAYER, Trace, TraceError, load_trace, merge_units, scale_trace, unit_of

UNIT_POLICIES = ("uniform", "params", "profile-once", "optimal", "oracle")
UNIT_KINDS = ("block", "sublayer")  # the row order: the block row is the reference
VS_BLOCK = ("best_static_s", "dynmo_s", "oracle_s")


def balance_gap(trace: Trace, stages: int) -> float:
    """Median over the second half of the steps of the optimal min-max layout's slowest stage over
    the step's total cost / stages: what contiguous placement of these units cannot balance,
    whichever policy places them."""
    costs = trace.costs()
    gaps = [balance(Problem(costs=c.tolist(), stages=stages), "optimal").bottleneck / (c.sum() / stages)
            for c in costs[len(costs) // 2:] if c.sum() > 0]
    return float(np.median(gaps)) if gaps else float("nan")


def unit_row(trace: Trace, stages: int, dp: int, microbatches: int) -> dict:
    """The replayed totals of one unit kind: the best static layout, dynmo, the oracle, and the balance gap."""
    opts = ReplayOptions(microbatches=microbatches, balance=replay_balance(when="auto"))
    res = {r.policy: r for r in replay(trace, stages, dp, list(UNIT_POLICIES), opts)}
    best = res["optimal"].best_static
    best_s = res[best].total_s
    return {"layers": trace.num_layers, "best_static": best, "best_static_s": best_s,
            "gap": balance_gap(trace, stages), "dynmo_s": res["optimal"].total_s,
            "dynmo_vs_best_static": res["optimal"].speedup_vs_best_static,
            "migrations": res["optimal"].migrations, "oracle_s": res["oracle"].total_s,
            "oracle_vs_best_static": res["oracle"].speedup_vs_best_static}


def load_sublayer_trace(path: str | Path) -> Trace:
    """The trace at `path`; TraceError unless its units are attention and MLP halves."""
    trace = load_trace(path)
    if unit_of(trace.header.kinds, str(path)) != SUBLAYER:
        raise TraceError(f"{path} is not a sublayer trace (kinds E, a, m, ..., L); record one with "
                         "parallel.unit = \"sublayer\"")
    return trace


def replay_units(trace: Trace, blocks: int, stages: int, dp: int, microbatches: int) -> dict[str, dict]:
    """{"block": row, "sublayer": row} of a sublayer trace scaled to `blocks` blocks (module doc).
    TraceError for a trace of whole blocks; SimInputError / BalanceError for a shape the replay refuses."""
    if unit_of(trace.header.kinds) != SUBLAYER:
        raise TraceError("replay_units needs a sublayer trace (kinds E, a, m, ..., L)")
    sub = scale_trace(trace, blocks)
    rows = {"block": unit_row(merge_units(sub), stages, dp, microbatches),
            "sublayer": unit_row(sub, stages, dp, microbatches)}
    ref = rows["block"]
    rows["sublayer"]["vs_block"] = {k: rows["sublayer"][k] / ref[k] if ref[k] else None for k in VS_BLOCK}
    return rows
