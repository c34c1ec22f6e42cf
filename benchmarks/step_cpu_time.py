"""CPU time of one whole-model microbatch (forward, loss, backward), per config, on one thread.

    python benchmarks/step_cpu_time.py [--configs mod,moe,...] [--batch 4] [--repeats 5]
        [-- extra config overrides, default --model.d_model 512 --model.n_heads 8]

The model is built from the config as `dynmo.model.hostops.build_model` builds it and timed with
`time.process_time` (CPU seconds of this process: with one thread less sensitive to other jobs
than wall time), two untimed microbatches first, then the median of --repeats. To compare two
checkouts, run it once with each on PYTHONPATH, alternating, and divide run by run: the fewer
operators of the lean blocks must not cost compute.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from dynmo.config import load_config
from dynmo.model.hostops import build_model, microbatch_step

ROOT = Path(__file__).resolve().parent.parent


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default="default,mod,moe,llama,mixtral,llama-mod")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("overrides", nargs="*", help="config overrides after --")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    overrides = args.overrides or ["--model.d_model", "512", "--model.n_heads", "8"]
    for name in args.configs.split(","):
        cfg = load_config(ROOT / "configs" / f"{name}.toml", overrides)
        layers = build_model(cfg)
        gen = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, cfg.model.vocab_size, (args.batch, cfg.model.seq_len + 1), generator=gen)
        for _ in range(2):
            microbatch_step(layers, tokens)
        times = []
        for _ in range(args.repeats):
            t = time.process_time()
            microbatch_step(layers, tokens)
            times.append(time.process_time() - t)
        ms = statistics.median(times) * 1e3
        print(f"{name:<12} {ms:9.1f} ms  {args.batch * cfg.model.seq_len / ms * 1e3:9.0f} tokens/s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
