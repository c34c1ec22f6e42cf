"""Real 2-rank runs: fp32 / bf16 x activation checkpointing off / on, on the default config.

Produces the table in docs/bench/numerics.md (linked from docs/numerics.md).

    python benchmarks/bench_numerics.py [--steps 20] [--repeats 1] [--config configs/default.toml]

Each repeat trains the model four times through the real launcher (`dynmo train --nproc 2`,
static layout), in turn so that machine noise hits all variants alike. It prints per variant:
  tokens/s          median over the steps after the first (one-off set-up)
  peak MB/worker    measured peak memory per pipeline rank over the run (worker_peak_memory_bytes:
                    on CPU the process's peak resident set, libraries and data included)
  est. MB/stage     the estimate the balancer uses (stage_memory_bytes: state + activations kept
                    x microbatches in flight), median over steps
  act MB/block      activations a block keeps per microbatch (layer_act_bytes), mean over blocks
  bwd/fwd           a block's measured backward over forward time (mean over blocks): with
                    checkpointing the backward contains the recomputed forward, so it rises by ~1
  loss              the final loss, and the largest per-step difference to the fp32 run
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from dynmo.bench.run import train

VARIANTS = [
    ("fp32", "none"),
    ("fp32", "all"),
    ("bf16", "none"),
    ("bf16", "all"),
]


def summarize(runs: list[list[dict]]) -> dict:
    rows = [r for recs in runs for r in recs[1:]]
    blocks = range(1, len(rows[0]["layer_fwd_s"]) - 1)
    peaks = [max(r["worker_peak_memory_bytes"][w] for recs in runs for r in recs)
             for w in range(len(rows[0].get("worker_peak_memory_bytes") or []))]
    return {
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in rows),
        "peak_mb": [p / 2**20 for p in peaks],
        "est_mb": [statistics.median(r["stage_memory_bytes"][j] for r in rows) / 2**20
                   for j in range(len(rows[0]["stage_memory_bytes"]))],
        "act_mb": statistics.fmean(statistics.median(r["layer_act_bytes"][i] for r in rows) for i in blocks) / 2**20,
        "bwd_fwd": statistics.fmean(statistics.median(r["layer_bwd_s"][i] / r["layer_fwd_s"][i] for r in rows)
                                    for i in blocks),
        "losses": [r["loss"] for r in runs[0]],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--config", default="configs/default.toml")
    args = ap.parse_args(argv)
    runs: dict[tuple[str, str], list[list[dict]]] = {v: [] for v in VARIANTS}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeats):
            for dtype, ckpt in VARIANTS:
                out = Path(tmp) / f"{dtype}-{ckpt}-{rep}"
                print(f"repeat {rep + 1}/{args.repeats}: {dtype}, checkpointing {ckpt} ...", file=sys.stderr, flush=True)
                runs[(dtype, ckpt)].append(train(
                    out, args.config, "--steps", str(args.steps), "--train.eval_every", "0",
                    "--train.dtype", dtype, "--train.activation_checkpointing", ckpt))
    rows = {v: summarize(r) for v, r in runs.items()}
    ref = rows[("fp32", "none")]["losses"]
    print(f"python benchmarks/bench_numerics.py --steps {args.steps} --repeats {args.repeats} --config {args.config}\n")
    print("| dtype | checkpointing | tokens/s | peak MB/worker (measured) | est. MB/stage | act MB/block | bwd/fwd | "
          "final loss | max abs loss diff to fp32 |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for (dtype, ckpt), s in rows.items():
        diff = max(abs(a - b) for a, b in zip(s["losses"], ref))
        print(f"| {dtype} | {ckpt} | {s['tokens_per_s']:.0f} | {' / '.join(f'{p:.0f}' for p in s['peak_mb'])} | "
              f"{' / '.join(f'{p:.1f}' for p in s['est_mb'])} | {s['act_mb']:.2f} | {s['bwd_fwd']:.2f} | "
              f"{s['losses'][-1]:.4f} | {diff:.4f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
