"""The paper's network experiment: one trace replayed under growing link delays, link-aware against compute-only."""

from __future__ import annotations

from dataclasses import replace
from typing import Sequence

import numpy as np

from dynmo.engine import SimInputError
from dynmo.sim.replay.options import LINK_DELAY_FACTORS, ReplayOptions
from dynmo.sim.replay.run import replay
from dynmo.sim.trace import Trace


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
    The delay is a wait before each send (as the runtime injects it), so it is the same at
    every cut; `options.comm`, the transfer itself, grows with the bytes of the cut on the link
    when the trace records them (`boundary_bytes`, `Runner.simulate`).

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
