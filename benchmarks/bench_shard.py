"""Sharded against unsharded state, in real paired runs on this machine.

Produces the table in docs/bench/sharding.md (linked from docs/numerics.md, "Sharded data
parallelism").

    python benchmarks/bench_shard.py [--config configs/default.toml] [--pairs 6] [--steps 40]
                                     [--out runs/bench-shard] [-- extra dynmo train overrides]

Runs `dynmo train` on 2 ranks as 2 data-parallel replicas of one pipeline stage
(`parallel.dp = 2`; on 2 cores more ranks would not give honest timings), in rounds of one run
each with `parallel.shard = "none"`, `"optimizer"` and `"full"` (the order rotates every
round). Per setting it
prints what one worker holds (weights, gradients and AdamW state of its layers, measured
after the step's optimizer update, while the gradients still exist), the measured peak memory
of the step (CPU: the process's peak resident set size, an upper bound on the tensors; see
`dynmo.runtime.memory`), and the median tokens/s (all steps but the first); then per sharded
setting the median of the rounds' tokens/s ratios over "none" with a distribution-free
interval and the verdict. The settings train the same model: the losses are checked equal,
bitwise for "optimizer", to 1e-5 for "full" (FSDP sums the gradients in another order).

The C allocator's dynamic mmap threshold lets a freed large block raise the threshold, after
which later large tensors come from the heap and stay resident when freed, so the default
peak RSS moves with the order of allocations as much as with the tensors. One more pair of
short runs measures the peak with a fixed threshold (`MALLOC_MMAP_THRESHOLD_=65536`: large
tensors mapped and unmapped as allocated and freed, closer to what the tensors need); their
speed is not reported (mapping every tensor is slower).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

from dynmo.bench.measures import median_interval, throughput, verdict
from dynmo.bench.run import train

SHARDS = ("none", "optimizer", "full")


def state_mb(recs: list[dict]) -> float:
    """Bytes one worker holds at the last step (one stage: every layer), in MB."""
    return sum(recs[-1]["layer_state_bytes"]) / 1e6


def peak_mb(recs: list[dict]) -> float | None:
    """The median over the steps of the busiest worker's measured peak, in MB."""
    peaks = [max(r["worker_peak_memory_bytes"]) for r in recs[1:] if r.get("worker_peak_memory_bytes")]
    return statistics.median(peaks) / 1e6 if peaks else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/default.toml")
    ap.add_argument("--pairs", type=int, default=6, help="rounds (one run of each setting)")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--out", default="runs/bench-shard")
    ap.add_argument("extra", nargs="*", help="overrides passed to dynmo train (after --)")
    args = ap.parse_args(argv)
    print(f"python benchmarks/bench_shard.py --config {args.config} --pairs {args.pairs} --steps {args.steps}"
          + (" -- " + " ".join(args.extra) if args.extra else "") + "\n", flush=True)
    common = ["--steps", str(args.steps), "--parallel.dp", "2", "--train.eval_every", "0", *args.extra]
    runs: dict[str, list[list[dict]]] = {s: [] for s in SHARDS}
    ratios: dict[str, list[float]] = {s: [] for s in SHARDS[1:]}
    for k in range(args.pairs):
        for shard in SHARDS[k % 3:] + SHARDS[:k % 3]:
            recs = train(Path(args.out) / f"{shard}-{k}", args.config, *common, "--parallel.shard", shard)
            runs[shard].append(recs)
            print(f"  round {k} {shard}: {throughput(recs):,.0f} tok/s, state {state_mb(recs):.1f} MB",
                  file=sys.stderr, flush=True)
        none = [r["loss"] for r in runs["none"][-1]]
        for shard in SHARDS[1:]:
            got = [r["loss"] for r in runs[shard][-1]]
            if got != none if shard == "optimizer" else max(abs(a - b) for a, b in zip(got, none)) > 1e-5:
                print(f"bench_shard: round {k}: {shard}'s losses differ from none's; sharding must not change "
                      "the training", file=sys.stderr)
                return 1
            ratios[shard].append(throughput(runs[shard][-1]) / throughput(runs["none"][-1]))
    fixed: dict[str, float | None] = {}
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
    try:
        for shard in SHARDS:
            recs = train(Path(args.out) / f"{shard}-mmap", args.config, *common[2:], "--steps", "10",
                         "--parallel.shard", shard)
            fixed[shard] = peak_mb(recs)
    finally:
        del os.environ["MALLOC_MMAP_THRESHOLD_"]

    def mb(x: float | None) -> str:
        return "not measured" if x is None else f"{x:,.0f}"

    print("| parallel.shard | state per worker (MB) | peak RSS per worker (MB, median) | peak RSS, fixed mmap threshold (MB) "
          "| tok/s (median of runs) |")
    print("|---|---:|---:|---:|---:|")
    for shard in SHARDS:
        peaks = [p for p in (peak_mb(r) for r in runs[shard]) if p is not None]
        tps = statistics.median(throughput(r) for r in runs[shard])
        print(f"| {shard} | {state_mb(runs[shard][-1]):,.1f} | {mb(statistics.median(peaks) if peaks else None)} "
              f"| {mb(fixed[shard])} | {tps:,.0f} |")
    print()
    for shard in SHARDS[1:]:
        med, low, high, cover = median_interval(ratios[shard])
        print(f"{shard} / none, {len(ratios[shard])} rounds: median {med:.3f}, interval [{low:.3f}, {high:.3f}] "
              f"({cover:.0%} coverage): {verdict(low, high)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
