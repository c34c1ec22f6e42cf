"""What the data path costs a training step: drawing one step's windows, as the trainer does.

    python benchmarks/data_step_cost.py [--config configs/main.toml] [--steps 300]

Loads the config's data as every rank does (`dynmo.data.prepare` of `data.paths` into the cache,
then `TokenData.load`) and times `TokenData.batch(step, global_batch)` over --steps steps: the
median and 90th percentile in milliseconds. The same script runs against an older checkout
on PYTHONPATH (the calls are the same since the in-memory path), so the two data paths compare
directly; beside a step's time (the run's own `step_s`) it bounds how much the data path can
slow a step.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from dynmo.config import load_config
from dynmo.data import TokenData, prepare


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/main.toml")
    ap.add_argument("--steps", type=int, default=300)
    args = ap.parse_args(argv)
    cfg = load_config(args.config, [])
    d = cfg.data
    folder = prepare(d.paths, cfg.model.vocab_size, d.cache_dir, cfg.model.hf_path)
    data = TokenData.load(Path(folder), cfg.model.seq_len, d.val_fraction, cfg.train.seed)
    times = []
    for step in range(args.steps):
        t = time.perf_counter()
        data.batch(step, cfg.train.global_batch)
        times.append(time.perf_counter() - t)
    times.sort()
    print(f"{args.config}: one step's windows ({cfg.train.global_batch} x {cfg.model.seq_len + 1} tokens): "
          f"median {statistics.median(times) * 1e3:.3f} ms, p90 {times[int(0.9 * len(times))] * 1e3:.3f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
