"""The real runs: every variant of a case (static layouts, dynmo, re-packing) and its dense model, trained with `dynmo train`."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from dynmo.bench.cases import DENSE, ROOT, STATIC_VARIANTS, BenchCase
from dynmo.bench.measures import (
    final_val, oracle_bound, overhead_s, per_worker, profile_once_of, throughput, worker_seconds,
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


def real_row(case: BenchCase, out: Path, steps: int | None, repeats: int = 1, dense: dict | None = None) -> dict:
    """Every variant of `case`, `repeats` times in alternation; medians and the paired range.
    `dense`: cache of dense-model runs by (config, steps), shared across cases."""
    n = steps or case.steps
    base = ["--steps", str(n), "--train.eval_every", str(n), *case.extra]
    runs: dict[str, list[list[dict]]] = {v: [] for v in _variants(case)}
    seconds: dict[str, float] = {}
    for rep in range(repeats):
        for variant in _variants(case):
            name = f"{case.name}-{variant}" + (f"-{rep}" if rep else "")
            args = list(base)
            if variant in ("uniform", "params"):
                args += ["--balance.when", "never", "--parallel.layout", variant]
            elif variant == "profile-once":
                lay = profile_once_of(runs["uniform"][rep])
                args += ["--balance.when", "never", "--parallel.layout", ",".join(map(str, lay))]
            else:
                args += ["--balance.when", case.when] + (["--balance.repack", "true"] if variant == "repack" else [])
            if variant == "uniform" and rep == 0:  # the trace the simulation scales
                args += ["--trace", str((out / "traces" / f"{case.name}-static.jsonl").resolve())]
            t = time.perf_counter()
            recs = train(out / "runs" / name, case.config, *args)
            seconds[variant] = seconds.get(variant, 0.0) + time.perf_counter() - t
            runs[variant].append(recs)
            print(f"  {case.name} {variant} ({rep + 1}/{repeats}): {len(recs)} steps in {time.perf_counter() - t:.0f} s, "
                  f"{throughput(recs):,.0f} tok/s", file=sys.stderr, flush=True)
    med = statistics.median
    tps = {v: [throughput(r) for r in rs] for v, rs in runs.items()}
    best = max(STATIC_VARIANTS, key=lambda v: med(tps[v]))
    paired = [d / max(tps[v][i] for v in STATIC_VARIANTS) for i, d in enumerate(tps["dynmo"])]
    d = runs["dynmo"][0]
    row = {
        "case": case.name,
        "when": case.when,
        "steps": len(d),
        "repeats": repeats,
        "seconds": {v: round(s) for v, s in seconds.items()},
        "tokens_per_s": {v: med(x) for v, x in tps.items()},
        "best_static": best,
        "speedup_vs_best_static": med(tps["dynmo"]) / med(tps[best]),
        "speedup_vs_best_static_min": min(paired),
        "speedup_vs_best_static_max": max(paired),
        "speedup_vs_uniform": med(tps["dynmo"]) / med(tps["uniform"]),
        "oracle_bound": med(oracle_bound(s) for s in runs["uniform"]),
        "profile_once_layout": profile_once_of(runs["uniform"][0]),
        "bubble": {v: med(statistics.fmean(r["bubble_ratio"] for r in x[1:]) for x in rs) for v, rs in runs.items()},
        "migrations": med(sum(e["type"] == "migration" for r in x for e in r["events"]) for x in runs["dynmo"]),
        "overhead_pct": med(100 * overhead_s(x) / sum(r["step_s"] for r in x) for x in runs["dynmo"]),
        "final_layout": d[-1]["layout"],
        "val_loss": {v: final_val(rs[0]) for v, rs in runs.items()},
        "worker_s": {v: med(worker_seconds(x) for x in rs) for v, rs in runs.items()},
        "tokens_per_worker_s": {v: med(per_worker(x) for x in rs) for v, rs in runs.items()},
        "workers_final": {v: rs[0][-1].get("workers", 2) for v, rs in runs.items()},
    }
    if case.dense is not None and dense is not None:
        dn = dense_run(case, out, n, dense)
        row["dense"] = dn
        row["technique_alone"] = med(tps["uniform"]) / dn["tokens_per_s"]
        row["technique_dynmo"] = med(tps["dynmo"]) / dn["tokens_per_s"]
    write_real_plots(case.name, runs, out / "plots" / case.name)
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
