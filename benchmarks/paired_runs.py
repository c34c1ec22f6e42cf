"""Whole-model timings: `dynmo train --nproc 1` of a dynamic model and of its dense counterpart,
alternating run by run so that a drift of the machine's speed falls on both; tokens/s from each
run's summary.json (the mean over its steps), and the ratio pair by pair. Shared by the
benchmarks' `--model` tables."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def train_run(config: str, extra: list[str], steps: int, out: Path, env: dict | None = None) -> dict:
    """One `dynmo train --nproc 1` run (OMP_NUM_THREADS as set, else 1; `env` added): its mean
    tokens/s, per-step losses (and the first and last) and what it wrote to stderr. A failed run
    ends the benchmark with its command and the tail of its stderr."""
    cmd = [sys.executable, "-m", "dynmo.cli", "train", "--nproc", "1", "--config", config, "--steps", str(steps),
           "--out", str(out), "--log.tensorboard", "false", "--log.progress", "false", *extra]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), **(env or {}))
    p = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed (exit {p.returncode}):\n{p.stderr[-2000:]}")
    summary = json.loads((out / "summary.json").read_text())
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {"tokens_per_s": summary["mean_tokens_per_s"], "losses": losses, "first_loss": losses[0],
            "last_loss": losses[-1], "stderr": p.stderr}


def paired_table(model: tuple[str, str, list[str]], dense: tuple[str, str, list[str]], steps: int,
                 pairs: int) -> list[float]:
    """Print a markdown table of `pairs` alternating runs of `model` and `dense`, each
    (name, config, overrides), and their ratios; returns model / dense tokens/s per pair."""
    print(f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '1')}, {steps} steps, {pairs} alternating pairs")
    for name, config, extra in (model, dense):
        print(f"  {name}: dynmo train --nproc 1 --config {config} {' '.join(extra)}")
    print("| pair | model | tokens/s | loss first → last |")
    print("| --- | --- | --- | --- |")
    ratios = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(pairs):
            runs = []
            for name, config, extra in (model, dense):
                r = train_run(config, extra, steps, Path(tmp) / f"{name}-{i}")
                runs.append(r)
                print(f"| {i} | {name} | {r['tokens_per_s']:.0f} | {r['first_loss']:.3f} → {r['last_loss']:.3f} |",
                      flush=True)
            ratios.append(runs[0]["tokens_per_s"] / runs[1]["tokens_per_s"])
    print(f"\n{model[0]} / {dense[0]} tokens/s per pair: {', '.join(f'{r:.3f}' for r in ratios)}; "
          f"median {statistics.median(ratios):.3f}\n", flush=True)
    return ratios
