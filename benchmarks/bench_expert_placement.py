"""Experts placed by measured load against the static placement, in paired real runs.

Produces the paired runs in docs/bench/expert-placement.md (linked from docs/dynamic-models.md,
"Expert parallelism").

    python benchmarks/bench_expert_placement.py [--pairs 6] [--steps 40] [--skip 10] [--expert-slots S] [--out DIR]

A MoE model (configs/moe.toml) on 2 ranks as 2 data-parallel replicas whose experts are spread
over both (`--parallel.ep 2`: 4 experts a rank), with the load-balancing loss switched off
(`--model.moe.aux_loss_coef 0`) so that routing skews as it trains. Each pair runs the static
placement (experts 0-3 on rank 0, 4-7 on rank 1) and `balance.experts = auto` (rank 0 re-places
each MoE layer's experts when the measured routing says the busiest rank gets lighter beyond the
routing's own variation and the saving repays the move), one after the other, the order
alternating between pairs so that a drift of the machine's speed falls on both. Per run: tokens/s
over the steps from `--skip` on (`dynmo.bench.measures.throughput`); per pair: auto / static;
then the median ratio with its distribution-free 95 % interval (`median_interval`, as `dynmo
bench`'s paired rows) and what it says. Also: how many re-placements each auto run made, and
whether its losses equal the static run's (dp / ep = 1: moving experts keeps training bitwise).
With `--expert-slots S` the auto run has S slots more a rank (`parallel.expert_slots`: copies of
hot experts, which share their expert's tokens) against the static placement without: what a user
gains by turning both on; its losses then equal the static run's to rounding (the largest
difference is printed), not bitwise.
Needs torch; 2 ranks on this machine's 2 cores give honest timings.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from dynmo.bench.measures import median_interval, throughput, verdict

ROOT = Path(__file__).resolve().parents[1]
BASE = ["--config", "configs/moe.toml", "--parallel.dp", "2", "--parallel.ep", "2",
        "--model.moe.aux_loss_coef", "0", "--balance.when", "never", "--log.tensorboard", "false",
        "--log.progress", "false", "--train.eval_every", "0"]


def run(out: Path, steps: int, experts: str, slots: int = 0) -> list[dict]:
    cmd = [sys.executable, "-m", "dynmo.cli", "train", "--nproc", "2", *BASE, "--train.steps", str(steps),
           "--balance.experts", experts, "--parallel.expert_slots", str(slots), "--out", str(out), "--overwrite"]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if p.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stderr[-2000:]}")
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=6, help="paired runs (6: the fewest whose interval covers 95 %%)")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--skip", type=int, default=10, help="steps left out of the throughput (set-up, first evidence)")
    ap.add_argument("--expert-slots", type=int, default=0, help="extra slots a rank in the auto run (copies; 0-4)")
    ap.add_argument("--out", type=Path, default=Path("runs/bench-experts"))
    a = ap.parse_args(argv)
    if a.pairs < 1 or not 1 <= a.skip < a.steps or not 0 <= a.expert_slots <= 4:
        print("need --pairs >= 1, 1 <= --skip < --steps and 0 <= --expert-slots <= 4", file=sys.stderr)
        return 2
    slots = f" --expert-slots {a.expert_slots}" if a.expert_slots else ""
    print(f"python benchmarks/bench_expert_placement.py --pairs {a.pairs} --steps {a.steps} --skip {a.skip}{slots}\n")
    print("| pair | static tokens/s | auto tokens/s | auto / static | re-placements | losses: largest difference |")
    print("|---:|---:|---:|---:|---:|---|")
    ratios = []
    for i in range(a.pairs):
        order = ("never", "auto") if i % 2 == 0 else ("auto", "never")
        recs = {e: run(a.out / f"pair{i}-{e}", a.steps, e, a.expert_slots if e == "auto" else 0) for e in order}
        static, auto = (throughput(recs[e][a.skip:]) for e in ("never", "auto"))
        moves = sum(1 for r in recs["auto"] for e in r["events"] if e.get("type") == "replacement")
        diff = max(abs(x["loss"] - y["loss"]) for x, y in zip(recs["auto"], recs["never"]))
        ratios.append(auto / static)
        print(f"| {i} | {static:,.0f} | {auto:,.0f} | {auto / static:.3f} | {moves} | "
              f"{'0 (bitwise)' if diff == 0 else f'{diff:.1e}'} |", flush=True)
    med, lo, hi, cov = median_interval(ratios)
    print(f"\nmedian auto / static {med:.3f}, {cov:.0%} interval [{lo:.3f}, {hi:.3f}]: {verdict(lo, hi)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
