"""`dynmo train`: validate, prepare the data once, then launch torchrun on `dynmo.train`.

    dynmo train --nproc 2 --config configs/default.toml --steps 50 --out runs/default \
        [--section.field VALUE ...]

`--steps`, `--out` and `--trace` are shorthands for `--train.steps`, `--out` and `--log.trace`. Everything after the
known flags is passed on as config overrides. On a cluster, call torchrun yourself:
`torchrun --nnodes ... --nproc-per-node 8 -m dynmo.train --config FILE ...`.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from dynmo import checks
from dynmo.config import ConfigError, load_config


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(
        prog="dynmo train",
        description="Train a pipeline-parallel model; extra --section.field VALUE flags override the config.",
    )
    ap.add_argument("--nproc", type=int, default=2, help="processes (ranks) on this machine (default 2)")
    ap.add_argument("--config", default=None, help="TOML config file, e.g. configs/default.toml")
    ap.add_argument("--steps", type=int, default=None, help="training steps (= --train.steps)")
    ap.add_argument("--out", default=None, help="run folder for metrics, checkpoints, TensorBoard")
    ap.add_argument("--trace", default=None, help="write a per-layer cost trace (JSON Lines, docs/simulator.md) here (= --log.trace)")
    args, overrides = ap.parse_known_args(argv)
    if args.steps is not None:
        overrides += ["--train.steps", str(args.steps)]
    if args.out is not None:
        overrides += ["--out", args.out]
    if args.trace is not None:
        overrides += ["--log.trace", str(Path(args.trace).resolve())]
    if args.nproc < 1:
        print("dynmo train: error: --nproc must be >= 1", file=sys.stderr)
        return 2
    try:
        cfg = load_config(args.config, overrides)
        checks.validate(cfg, args.nproc)
    except ConfigError as e:
        print(f"dynmo train: error: {e}", file=sys.stderr)
        return 2
    # Tokenize once here, so the ranks find the cache ready.
    from dynmo.data import DataError, prepare

    try:
        prepare(cfg.data.paths, cfg.model.vocab_size, cfg.data.cache_dir, cfg.model.hf_path)
    except DataError as e:
        print(f"dynmo train: error: {e}", file=sys.stderr)
        return 2
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
           "-m", "dynmo.train"]
    if args.config:
        cmd += ["--config", args.config]
    cmd += overrides
    env = dict(os.environ)
    # One thread per rank unless told otherwise: ranks share the cores.
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // args.nproc)))
    return subprocess.call(cmd, env=env)
