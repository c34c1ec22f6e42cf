"""The paper-scale rows: each case's uniform trace scaled up and replayed under every policy, beside its dense
model; and every sublayer trace replayed with whole blocks against half blocks."""

from __future__ import annotations

import sys
import time
from dataclasses import replace
from pathlib import Path

from dynmo.balance import BalanceError
from dynmo.bench.cases import (
    SIM_POLICIES, UNITS_BLOCKS, UNITS_DP, UNITS_MICROBATCHES, UNITS_STAGES, BenchCase,
)
from dynmo.bench.run import _dense_prefix, dense_name
from dynmo.sim import SimInputError, TraceError, load_trace, scale_trace
from dynmo.sim.plots import write_plots
from dynmo.sim.replay import ReplayOptions, capture, load_sublayer_trace, replay, replay_balance, replay_units
from dynmo.sim.replay.expert_policies import replay_experts
from dynmo.sim.replay.experts import ExpertOptions, moe_layers
from dynmo.sim.trace.format import traced_model

EXPERT_SLOTS = 1  # the expert-parallel rows with copies: one extra slot a rank


def sim_rows(case: BenchCase, out: Path) -> list[dict]:
    trace = scale_trace(load_trace(out / "traces" / f"{case.name}-static.jsonl"), case.blocks, noise=0.05)
    # 4 microbatches per stage (as benchmarks/bench_sim.py), as large runs use to keep the
    # fill/drain bubble small; the real run's trigger (a trace's dynamism events drive `dynamism`)
    opts = ReplayOptions(microbatches=4 * case.stages, balance=replay_balance(when=case.when), initial="uniform")
    results = replay(trace, stages=case.stages, dp=case.dp, policies=SIM_POLICIES, options=opts)
    write_plots(results, out / "plots" / case.name, title=f"{case.name}: {case.blocks} blocks, {case.stages} stages x {case.dp} dp")
    # dynmo started from the best static layout a profile gives, rather than from uniform: what
    # run-time balancing adds to a careful static choice
    # and from the FLOP model's layout, where a training run starts when its config names no layout
    bounds = {r.policy: r.speedup_vs_best_static for r in results}
    for start in ("profile-once", "flops"):
        (warm,) = replay(trace, stages=case.stages, dp=case.dp, policies=["optimal"],
                         options=replace(opts, initial=start))
        warm.policy = f"optimal from {start}"
        # its share of the oracles' gains, from this replay's oracles (the same trace, shape and static layouts)
        warm.capture_oracle = capture(warm.speedup_vs_best_static, bounds.get("oracle"))
        warm.capture_oracle_window = capture(warm.speedup_vs_best_static, bounds.get("oracle-window"))
        results.append(warm)
    # the model without the technique, scaled and replayed alike on static uniform
    dense = None
    found = _dense_trace(out, case)
    if found is not None:
        dtrace = scale_trace(load_trace(found), case.blocks, noise=0.05)
        (dense,) = replay(dtrace, stages=case.stages, dp=case.dp, policies=["uniform"], options=opts)
    rows = []
    for r in results:
        row = {"case": case.name, "shape": f"{case.blocks + 2} layers, {case.stages}x{case.dp}", **r.as_dict(per_step=False)}
        if dense is not None:
            ours, theirs = (r.tokens_per_s, dense.tokens_per_s) if r.tokens_per_s and dense.tokens_per_s else \
                (r.steps_per_s, dense.steps_per_s)
            row["vs_dense"] = ours / theirs if theirs else None
            row["dense_trace"] = found.name
        rows.append(row)
    return rows


def expert_rows(case: BenchCase, out: Path) -> tuple[list[dict], list[str]]:
    """A MoE case's trace, scaled as `sim_rows` scales it, replayed with expert parallelism over
    each stage's dp replicas (E = dp: one expert a rank with 8 experts and dp 8) and one decision
    for the layer layout and the placements (`replay_experts(layouts="dynmo")`): static
    placement on the best static layout, dynmo's placements and layouts, the oracle; a row
    without copies and one with EXPERT_SLOTS extra slots a rank (`parallel.expert_slots`: dynmo
    and the oracle may copy hot experts into them; static never does). No row for a model
    without experts; a line saying why for a MoE model whose trace cannot be replayed so (a
    trace from before routing was recorded)."""
    trace = scale_trace(load_trace(out / "traces" / f"{case.name}-static.jsonl"), case.blocks, noise=0.05)
    model = traced_model(trace.header)
    try:
        moe_layers(trace)
    except SimInputError as e:
        moe = model is not None and model.has_experts
        return [], ([f"{case.name}: no expert-parallel replay: {str(e).splitlines()[0]}"] if moe else [])
    ep = case.dp
    rows = []
    for slots in (0, EXPERT_SLOTS):
        opts = ExpertOptions(microbatches=4 * case.stages, extra_slots=slots, copies=ep * slots)
        got = replay_experts(trace, case.stages, case.dp, ep, opts, layouts="dynmo")
        r = got.results
        rows.append({"case": case.name, "shape": f"{case.blocks + 2} layers, {case.stages}x{case.dp}", "ep": ep,
                     "experts": got.shape["experts"], "extra_slots": slots, "best_static": got.layout_name,
                     "static_s": r["static"].total_s, "dynmo": r["dynmo"].speedup, "capture": r["dynmo"].capture,
                     "oracle": r["oracle"].speedup, "dynmo_vs_start": r["start"].total_s / r["dynmo"].total_s,
                     "replacements": r["dynmo"].migrations, "layer_migrations": r["dynmo"].layer_migrations,
                     "busiest_over_mean": {p: r[p].as_dict()["mean_busiest_over_mean"]
                                           for p in ("static", "dynmo", "oracle")}})
    return rows, []


def _dense_trace(out: Path, case: BenchCase) -> Path | None:
    """A static trace of the case's dense model (`dense-<steps>.jsonl`, written by the real
    runs, or converted from a dense run's metrics.jsonl in OUT/runs): the one of the case's
    step count, else any; None for a case without a dense model."""
    if case.dense is None:
        return None
    for run in sorted((out / "runs").glob("dense-*")):
        path = out / "traces" / f"{run.name}.jsonl"
        if not path.is_file() and (run / "metrics.jsonl").is_file():
            load_trace(run).write(path)
    exact = out / "traces" / f"{dense_name(case, case.steps)}.jsonl"
    if exact.is_file():
        return exact
    # another step count of the same dense model
    found = sorted((out / "traces").glob(f"{_dense_prefix(case)}[0-9]*.jsonl"))
    return found[0] if found else None


def units_rows(folder: Path) -> tuple[list[dict], list[str]]:
    """Every sublayer trace in `folder` (`*.jsonl`, by name) replayed by `replay_units` at the
    benchmark's shape (`UNITS_*`): two rows per trace, whole blocks then half blocks; and a line
    for each trace that could not be replayed, saying why."""
    rows, missing = [], []
    shape = f"{UNITS_BLOCKS} blocks, {UNITS_STAGES}x{UNITS_DP}, {UNITS_MICROBATCHES} microbatches"
    for path in sorted(folder.glob("*.jsonl")):
        t0 = time.perf_counter()
        try:
            got = replay_units(load_sublayer_trace(path), UNITS_BLOCKS, UNITS_STAGES, UNITS_DP, UNITS_MICROBATCHES)
        except (TraceError, SimInputError, BalanceError) as e:
            missing.append(f"units: {path.name}: {str(e).splitlines()[0]}")
            continue
        rows += [{"trace": path.stem, "units": kind, "shape": shape, **r} for kind, r in got.items()]
        print(f"  {path.stem}: whole and half blocks in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    return rows, missing
