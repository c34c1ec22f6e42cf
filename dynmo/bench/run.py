"""The real runs: every variant of a case (static layouts, dynmo, re-packing) once, alternating pairs of the
best static layout and dynmo, and the case's dense model, each trained with `dynmo train`."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from dynmo.bench.cases import DENSE, PAIRS, ROOT, STATIC_VARIANTS, BenchCase
from dynmo.bench.measures import (
    final_val, median_interval, oracle_bound, overhead_s, per_worker, profile_once_of, throughput, verdict,
    worker_seconds,
)
from dynmo.bench.plots import write_real_plots


def train(out: Path, config: str, *extra: str, nproc: int = 2) -> list[dict]:
    """Run `dynmo train` in a subprocess; return its metrics records."""
    cmd = [sys.executable, "-m", "dynmo.cli", "train", "--nproc", str(nproc), "--config", config,
           "--out", str(out), "--overwrite", "--log.tensorboard", "false", "--log.progress", "false", *extra]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if p.returncode:
        raise RuntimeError(f"{' '.join(cmd)} exited {p.returncode}:\n{p.stderr[-2000:]}")
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _variants(case: BenchCase) -> list[str]:
    return [*STATIC_VARIANTS, "dynmo"] + (["repack"] if case.repack else [])


def _args(case: BenchCase, variant: str, static_layout: str | None = None) -> list[str]:
    """The overrides that make a run of `case` the variant: a static layout (`uniform`, `params`,
    or explicit boundaries for profile-once), dynmo, or dynmo with re-packing."""
    if variant in STATIC_VARIANTS:
        return ["--balance.when", "never", "--parallel.layout", static_layout or variant]
    return ["--balance.when", case.when] + (["--balance.repack", "true"] if variant == "repack" else [])


def real_row(case: BenchCase, out: Path, steps: int | None, pairs: int = PAIRS, dense: dict | None = None) -> dict:
    """Every variant of `case` once (the selection runs: they pick the best static layout and fill
    the per-variant table), then `pairs` alternating pairs of the best static layout and dynmo,
    run apart from the selection runs so that picking the best does not bias the comparison.
    The headline is the median of the pairs' ratios with a distribution-free 95% interval.
    `dense`: cache of dense-model runs by name, shared across cases."""
    n = steps or case.steps
    base = ["--steps", str(n), "--train.eval_every", str(n), *case.extra]
    runs: dict[str, list[dict]] = {}
    seconds: dict[str, float] = {}
    layouts: dict[str, str] = {}

    def run(name: str, variant: str, *extra: str) -> list[dict]:
        t = time.perf_counter()
        recs = train(out / "runs" / name, case.config, *base, *_args(case, variant, layouts.get(variant)), *extra)
        seconds[variant] = seconds.get(variant, 0.0) + time.perf_counter() - t
        print(f"  {name}: {len(recs)} steps in {time.perf_counter() - t:.0f} s, {throughput(recs):,.0f} tok/s",
              file=sys.stderr, flush=True)
        return recs

    for variant in _variants(case):
        if variant == "profile-once":
            layouts[variant] = ",".join(map(str, profile_once_of(runs["uniform"])))
        # the uniform run's trace is the one the simulation scales
        trace = ["--trace", str((out / "traces" / f"{case.name}-static.jsonl").resolve())] if variant == "uniform" else []
        runs[variant] = run(f"{case.name}-{variant}", variant, *trace)
    tps = {v: throughput(r) for v, r in runs.items()}
    best = max(STATIC_VARIANTS, key=lambda v: tps[v])
    ratios = []
    for i in range(pairs):  # alternate the order, so slow drift of the machine hits both alike
        order = (best, "dynmo") if i % 2 == 0 else ("dynmo", best)
        got = {v: throughput(run(f"{case.name}-pair{i}-{'static' if v == best else v}", v)) for v in order}
        ratios.append(got["dynmo"] / got[best])
    d = runs["dynmo"]
    row = {
        "case": case.name,
        "when": case.when,
        "steps": len(d),
        "pairs": pairs,
        "seconds": {v: round(s) for v, s in seconds.items()},
        "tokens_per_s": tps,
        "best_static": best,
        "speedup_vs_uniform": tps["dynmo"] / tps["uniform"],
        "oracle_bound": oracle_bound(runs["uniform"]),
        "profile_once_layout": profile_once_of(runs["uniform"]),
        "bubble": {v: statistics.fmean(r["bubble_ratio"] for r in x[1:]) for v, x in runs.items()},
        "migrations": sum(e["type"] == "migration" for r in d for e in r["events"]),
        "overhead_pct": 100 * overhead_s(d) / sum(r["step_s"] for r in d),
        "final_layout": d[-1]["layout"],
        "val_loss": {v: final_val(x) for v, x in runs.items()},
        "worker_s": {v: worker_seconds(x) for v, x in runs.items()},
        "tokens_per_worker_s": {v: per_worker(x) for v, x in runs.items()},
        "workers_final": {v: x[-1].get("workers", 2) for v, x in runs.items()},
    }
    if ratios:
        med, low, high, coverage = median_interval(ratios)
        row |= {"paired_ratios": ratios, "speedup_vs_best_static": med, "interval": [low, high],
                "interval_coverage": coverage, "verdict": verdict(low, high)}
    else:  # no pairs: the selection runs' ratio, which the choice of the best biases down
        row |= {"speedup_vs_best_static": tps["dynmo"] / tps[best], "verdict": "unpaired"}
    if case.dense is not None and dense is not None:
        dn = dense_run(case, out, n, dense)
        row["dense"] = dn
        row["technique_alone"] = tps["uniform"] / dn["tokens_per_s"]
        row["technique_dynmo"] = tps["dynmo"] / dn["tokens_per_s"]
    write_real_plots(case.name, {v: [x] for v, x in runs.items()}, out / "plots" / case.name)
    return row


def dense_name(case: BenchCase, steps: int) -> str:
    """The run (and trace) name of a case's dense model: `dense-<steps>` for the default config,
    shared by the cases that use it, else `dense-<case>-<steps>`."""
    return f"{_dense_prefix(case)}{steps}"


def _dense_prefix(case: BenchCase) -> str:
    return "dense-" if case.dense == DENSE and not case.dense_extra else f"dense-{case.name}-"


def dense_run(case: BenchCase, out: Path, steps: int, cache: dict) -> dict:
    """Train the case's dense model for `steps` (once per invocation and name), traced."""
    name = dense_name(case, steps)
    if name not in cache:
        t = time.perf_counter()
        recs = train(out / "runs" / name, case.dense, *case.dense_extra, "--steps", str(steps),
                     "--train.eval_every", str(steps), "--balance.when", "never",
                     "--trace", str((out / "traces" / f"{name}.jsonl").resolve()))
        cache[name] = {"name": name, "tokens_per_s": throughput(recs), "val_loss": final_val(recs),
                       "seconds": round(time.perf_counter() - t)}
        print(f"  {name} ({case.dense} {' '.join(case.dense_extra)}): {cache[name]['tokens_per_s']:,.0f} tok/s",
              file=sys.stderr, flush=True)
    return cache[name]
