"""A trace whose units cost, in each phase of the run, what they were measured to cost elsewhere.

A small model's trace says how its blocks' costs changed over the run, but not how a paper-sized
model's would: a pruned Linear of width 256 gains little from a sparse kernel that a Linear of
width 1600 gains much from. `relevel` takes, per phase (the steps from one dynamism step to the
next) and per unit, the cost that unit should have relative to its cost before the first phase
(measured on the large model's kernels, say), and rescales the trace's costs of those steps to
it, keeping the step-to-step variation the run measured inside each phase.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from dynmo.jsonio import is_int
from dynmo.sim.trace.costs import Trace
from dynmo.sim.trace.limits import TraceError
from dynmo.sim.trace.values import finite, show


def relevel(trace: Trace, levels: dict[int, dict[int, float]]) -> Trace:
    """`levels`: phase start step -> {unit index: its cost relative to before the first phase}.

    Phase p runs from its start step to the next start (or the end). Before the first start lies
    the reference: unit u's mean cost (fwd + bwd) over those steps. In phase p, unit u's fwd, bwd,
    wgrad and cost at every step are multiplied by one factor, so that the unit's mean over the
    phase is `levels[p][u]` x its reference mean. Units a phase does not name keep their costs."""
    if not levels:
        return trace
    steps = [s.step for s in trace.steps]
    starts = sorted(levels)
    units = len(trace.header.layers)
    for p in starts:
        if not is_int(p) or p not in steps:
            raise TraceError(f"phase start {show(p)} is not a step of the trace")
        for u, v in levels[p].items():
            if not is_int(u) or not 0 <= u < units:
                raise TraceError(f"unit {show(u)} of phase {p}: the trace has units 0..{units - 1}")
            if not finite(v) or v <= 0:
                raise TraceError(f"level of unit {u} in phase {p} must be a finite number > 0, got {show(v)}")
    total = np.array([np.add(s.fwd, s.bwd) for s in trace.steps])  # (steps, units)
    step_idx = np.asarray(steps)
    ref = step_idx < starts[0]
    if not ref.any():
        raise TraceError(f"the trace has no step before the first phase (step {starts[0]}) to measure levels from")
    ref_mean = total[ref].mean(axis=0)
    factor = np.ones_like(total)
    bounds = starts + [step_idx.max() + 1]
    for p, end in zip(starts, bounds[1:]):
        rows = (step_idx >= p) & (step_idx < end)
        had = total[rows].mean(axis=0)
        for u, v in levels[p].items():
            if ref_mean[u] > 0 and had[u] > 0:
                factor[rows, u] = v * ref_mean[u] / had[u]
    out = []
    for s, f in zip(trace.steps, factor):
        def scaled(a):
            return None if a is None else (np.asarray(a, dtype=float) * f).tolist()
        out.append(replace(s, fwd=scaled(s.fwd), bwd=scaled(s.bwd), wgrad=scaled(s.wgrad), cost=scaled(s.cost)))
    config = dict(trace.header.config)
    config["relevelled"] = {str(p): {str(u): v for u, v in levels[p].items()} for p in starts}
    return Trace(replace(trace.header, config=config), out)
