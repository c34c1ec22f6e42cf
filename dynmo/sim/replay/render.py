"""Replay results as text: the policy table and a trace's summary."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from dynmo.layout import imbalance
from dynmo.sim.replay.options import STATIC
from dynmo.sim.replay.result import PolicyResult
from dynmo.sim.trace import Trace


def summary_table(results: Sequence[PolicyResult]) -> str:
    """The replay table: throughput, speedups (over static uniform and over the best static
    layout, over the whole run and over its second half), the dynamic policies' share of each
    oracle's gain, bubble, workers and worker-seconds, per-worker throughput, migrations."""
    tok = any(r.tokens_per_s is not None for r in results)
    per_worker = "tok/s/wkr" if tok else "steps/wkr-s"
    head = (f"{'policy':<28} {'steps/s':>8} " + (f"{'tokens/s':>10} " if tok else "") +
            f"{'speedup':>7} {'vs best':>7} {'2nd uni':>7} {'2nd best':>8} {'cap orc':>7} {'cap ow':>7} "
            f"{'/worker':>7} {'bubble':>6} {'bottleneck':>10} {'workers':>11} "
            f"{'worker-s':>10} {per_worker:>11} {'migr':>5} {'moved':>5} {'migr s':>7} {'decide s':>8}")
    lines = [head, "-" * len(head)]
    for r in results:
        bn = float(np.mean(r.bottleneck_s)) if r.bottleneck_s else 0.0
        workers = f"{r.workers_mean:.1f}/{r.workers_final}"
        pw = f"{(r.tokens_per_s_per_worker or 0):>11.2f}" if tok else f"{r.steps_per_worker_s:>11.3g}"
        lines.append(
            f"{r.policy:<28} {r.steps_per_s:>8.3f} " + (f"{(r.tokens_per_s or 0):>10.0f} " if tok else "") +
            f"{(r.speedup or 0):>7.3f} {(r.speedup_vs_best_static or 0):>7.3f} "
            f"{(r.speedup_second_half or 0):>7.3f} {(r.speedup_vs_best_static_second_half or 0):>8.3f} "
            f"{_blank(r.capture_oracle):>7} {_blank(r.capture_oracle_window):>7} "
            f"{(r.speedup_per_worker or 0):>7.3f} "
            f"{r.mean_bubble:>6.3f} {bn * 1e3:>8.2f}ms {workers:>11} {r.worker_s:>10.1f} {pw} "
            f"{r.migrations:>5} {r.layers_moved:>5} {r.migration_s:>7.3f} {r.decide_s:>8.4f}"
        )
    best = next((r.best_static for r in results if r.best_static), None)
    if best:
        lines.append(f"vs best: total time of the best static layout ({best}, of {', '.join(STATIC)}) / this policy's; "
                     f"worker-s: worker-seconds over the run; {per_worker}: "
                     + ("tokens" if tok else "steps") + " per worker-second")
        half = next((r.best_static_second_half for r in results if r.best_static_second_half), best)
        n = results[0].steps if results else 0
        lines.append(f"2nd uni, 2nd best: the same over the last half of the steps ({n // 2}..{n - 1}), against static "
                     f"uniform and the static layout best there ({half}); cap orc, cap ow: the share of the per-step "
                     "oracle's / oracle-window's gain over the best static layout a dynamic policy captures, in "
                     "throughput: (vs best - 1) / (the oracle's vs best - 1); blank where that oracle gains < 0.5 % or "
                     "was not replayed")
    return "\n".join(lines)


def _blank(x: float | None) -> str:
    return "" if x is None else f"{x:.3f}"


def short_layout(boundaries: Sequence[int]) -> str:
    """Stage sizes of a layout, e.g. 3+4+3 (boundaries are long at paper scale)."""
    return "+".join(str(b - a) for a, b in zip(boundaries, boundaries[1:]))


def trace_summary(trace: Trace) -> dict:
    """Shape and dynamics of a trace, for the CLI header and JSON."""
    c = trace.costs()
    h = trace.header
    return {
        "case": h.case, "source": h.source, "layers": trace.num_layers, "steps": len(trace.steps),
        "traced_pp": h.pp, "traced_dp": h.dp, "schedule": h.schedule, "microbatches": h.microbatches,
        "dynamism_steps": trace.dynamism_steps(),
        "total_cost_first_last_s": [float(c[0].sum()), float(c[-1].sum())],
        "layer_imbalance_last": imbalance(c[-1].tolist()),
    }


def link_delay_table(rows: Sequence[dict]) -> str:
    """Markdown table of `replay_link_delays` rows: per delay and policy, the mean step time
    with link-aware and with compute-only balancing, and the ratio compute-only / link-aware
    of their total times (> 1: seeing the links paid)."""
    by = {(r["factor"], r["policy"], r["links"]): r for r in rows}
    keys = list(dict.fromkeys((r["factor"], r["policy"]) for r in rows))
    out = ["| delay (x base) | delay s | policy | s/step link-aware | s/step compute-only | compute-only / link-aware "
           "| migrations (aware, free) | final layout link-aware | final layout compute-only |",
           "|---:|---:|---|---:|---:|---:|---:|---|---|"]
    for f, p in keys:
        a, b = by.get((f, p, "measure")), by.get((f, p, "free"))
        if a is None or b is None:
            continue
        ratio = b["total_s"] / a["total_s"] if a["total_s"] > 0 else float("nan")
        same = a["layout_final"] == b["layout_final"]
        out.append(f"| {f:g} | {a['delay_s']:.4g} | {p} | {a['mean_iteration_s']:.4f} | {b['mean_iteration_s']:.4f} | "
                   f"{ratio:.3f} | {a['migrations']}, {b['migrations']} | {short_layout(a['layout_final'])} | "
                   f"{'same' if same else short_layout(b['layout_final'])} |")
    return "\n".join(out)
