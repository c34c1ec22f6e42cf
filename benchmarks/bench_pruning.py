"""Pruning criteria on the default model: what the one global cut does to the model's loss.

Produces the tables in docs/bench/pruning-criteria.md (linked from docs/shrinking-models.md, "The
criterion").

    python benchmarks/bench_pruning.py [--steps 100] [--eval-every 10] [--only dense,magnitude,...]

Trains `configs/pruning.toml` (the default GPT model, 2 pipeline ranks, pruning at steps 20,
30, 40, 50 to 52 / 79 / 89 / 90 %) through the real launcher (`python -m dynmo.cli train
--nproc 2`), once per variant, all to the same step count and on the same data, with the
validation loss every `--eval-every` steps (`train.eval_every`, the same validation batches
for every variant):

  dense                           prune.enabled = false: what the pruned models are compared with
  magnitude                       raw |w| (torch.nn.utils.prune.global_unstructured's criterion)
  magnitude+floorF                raw |w|, every tensor keeps >= F of its weights (prune.min_density;
                                  magnitude+floor0.02 is the default)
  normalized                      |w| / the tensor's RMS
  lamp                            LAMP scores
  structured-magnitude            prune.structured = true: MLP units by their L2 norm
  structured-magnitude+floor0.02  the same, every block keeps >= 2 % of its MLP units (the default)
  structured-normalized           unit norms over the RMS of their block's unit norms

Prints a markdown table per variant: final train loss (the last step's, and the mean of the
last 10 steps), final validation loss and its difference to dense, the final sparsity of the
blocks' Linear weights, the min and max block density (the spread is the imbalance the
balancer sees), and the density of each pruned tensor kind, min over the blocks (counted from
the final checkpoint's zeros, or its shapes for structured pruning). Every variant is one
global selection over all blocks on both ranks; they differ only in the score ranked.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from dynmo.config import load_config
from dynmo.model.layers import block_class

ROOT = Path(__file__).resolve().parents[1]

VARIANTS: dict[str, list[str]] = {
    "dense": ["--prune.enabled", "false"],
    "magnitude": ["--prune.scoring", "magnitude", "--prune.min_density", "0"],
    "magnitude+floor0.02": ["--prune.scoring", "magnitude", "--prune.min_density", "0.02"],
    "magnitude+floor0.05": ["--prune.scoring", "magnitude", "--prune.min_density", "0.05"],
    "magnitude+floor0.08": ["--prune.scoring", "magnitude", "--prune.min_density", "0.08"],
    "normalized": ["--prune.scoring", "normalized", "--prune.min_density", "0"],
    "lamp": ["--prune.scoring", "lamp", "--prune.min_density", "0"],
    "structured-magnitude": ["--prune.structured", "true", "--prune.scoring", "magnitude", "--prune.min_density", "0"],
    "structured-magnitude+floor0.02": ["--prune.structured", "true", "--prune.scoring", "magnitude",
                                       "--prune.min_density", "0.02"],
    "structured-normalized": ["--prune.structured", "true", "--prune.scoring", "normalized", "--prune.min_density", "0"],
}


def train(out: Path, config: str, steps: int, eval_every: int, eval_batches: int, extra: list[str]) -> tuple[list[dict], float]:
    cmd = [sys.executable, "-m", "dynmo.cli", "train", "--nproc", "2", "--config", config, "--out", str(out),
           "--steps", str(steps), "--train.eval_every", str(eval_every), "--train.eval_batches", str(eval_batches),
           "--checkpoint.final", "true", "--log.tensorboard", "false", "--log.progress", "false", *extra]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    t0 = time.perf_counter()
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    secs = time.perf_counter() - t0
    if p.returncode:
        raise RuntimeError(f"{shlex.join(cmd)} exited {p.returncode}:\n{p.stderr[-3000:]}")
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()], secs


def tensor_densities(out: Path, tmp: Path) -> dict[str, list[float]]:
    """Per pruned tensor kind, each block's live fraction, from the final checkpoint."""
    cfg = load_config(out / "config.toml")
    with torch.device("meta"):
        block = block_class(cfg.model)(cfg.model)
    full = {name: block.get_submodule(name).weight.numel() for name in block.prunable}
    dcp_to_torch_save(str(out / "checkpoint-final"), str(tmp / "final.pt"))
    w = torch.load(tmp / "final.pt")
    out_d: dict[str, list[float]] = {}
    for b in range(cfg.model.n_layers):
        for name, n in full.items():
            t = w[f"block{b}.{name}.weight"]
            live = t.numel() if cfg.prune.structured else int((t != 0).sum())
            out_d.setdefault(name, []).append(live / n)
    (tmp / "final.pt").unlink()
    return out_d


def summarize(recs: list[dict], dens: dict[str, list[float]]) -> dict:
    last = recs[-1]
    vals = [r for r in recs if r.get("val_loss") is not None]
    blocks = [d for d in last.get("prune_density", [])[1:-1]] or [1.0]
    cuts = [e for r in recs for e in r["events"] if e["type"] == "dynamism"]
    return {
        "step": last["step"],
        "loss": last["loss"],
        "loss10": statistics.mean(r["loss"] for r in recs[-10:]),
        "val": vals[-1]["val_loss"],
        "val_step": vals[-1]["step"],
        "val_curve": [(r["step"], r["val_loss"]) for r in vals],
        "sparsity": 1.0 - statistics.mean(blocks),
        "dmin": min(blocks),
        "dmax": max(blocks),
        "tensor_min": {k: min(v) for k, v in dens.items()},
        "cuts": [e.get("sparsity") for e in cuts],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/pruning.toml")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--eval-batches", type=int, default=4)
    ap.add_argument("--only", default="", help="comma-separated variants (default: all): " + ",".join(VARIANTS))
    ap.add_argument("--json", type=Path, help="also write the summaries here")
    args = ap.parse_args()
    names = [n for n in args.only.split(",") if n] or list(VARIANTS)
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        ap.error(f"unknown variants {unknown}; known: {list(VARIANTS)}")
    started = datetime.datetime.now()
    t_all = time.perf_counter()
    res: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            out = Path(tmp) / name
            recs, secs = train(out, args.config, args.steps, args.eval_every, args.eval_batches, VARIANTS[name])
            res[name] = summarize(recs, tensor_densities(out, Path(tmp)))
            res[name]["seconds"] = secs
            print(f"{name}: {secs:.0f} s, val {res[name]['val']:.3f}", file=sys.stderr, flush=True)
    total = time.perf_counter() - t_all
    kinds = list(next(iter(res.values()))["tensor_min"])
    dense = res.get("dense", {}).get("val")
    print(f"`python benchmarks/bench_pruning.py --steps {args.steps} --eval-every {args.eval_every} "
          f"--eval-batches {args.eval_batches}{' --only ' + args.only if args.only else ''}` "
          f"({args.config}, 2 ranks), {started:%Y-%m-%d}, {total / 60:.0f} min in all\n")
    val_step = next(iter(res.values()))["val_step"]
    head = (["variant", "train loss (last / mean last 10)", f"val loss (step {val_step})", "val vs dense",
             "worst val vs dense (step)", "sparsity", "block density min–max (spread)"] + [f"{k} density (min over blocks)" for k in kinds] + ["run s"])
    print("| " + " | ".join(head) + " |")
    print("|" + " --- |" * len(head))
    for name, r in res.items():
        diff = worst = ""
        if dense is not None and name != "dense":
            diff = f"{r['val'] - dense:+.3f}"
            gaps = [(v - dv, s) for (s, v), (_, dv) in zip(r["val_curve"], res["dense"]["val_curve"])]
            worst = "{:+.3f} ({})".format(*max(gaps))
        spread = r["dmax"] - r["dmin"]
        row = [name, f"{r['loss']:.3f} / {r['loss10']:.3f}", f"{r['val']:.3f}", diff, worst, f"{100 * r['sparsity']:.1f} %",
               f"{r['dmin']:.3f}–{r['dmax']:.3f} ({spread:.3f}{', differ' if spread > 0 else ', equal'})"]
        row += [f"{r['tensor_min'][k]:.4f}" for k in kinds] + [f"{r['seconds']:.0f}"]
        print("| " + " | ".join(row) + " |")
    print("\nValidation loss by step:\n")
    steps = [s for s, _ in next(iter(res.values()))["val_curve"]]
    print("| variant | " + " | ".join(str(s) for s in steps) + " |")
    print("|" + " --- |" * (len(steps) + 1))
    for name, r in res.items():
        print(f"| {name} | " + " | ".join(f"{v:.3f}" for _, v in r["val_curve"]) + " |")
    if args.json:
        args.json.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
