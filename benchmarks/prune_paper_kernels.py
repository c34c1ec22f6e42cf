"""The paper-scale pruning replay with kernel costs measured on masks of the paper's layer sizes.

Produces the tables in docs/bench/prune-paper-kernels.md (linked from docs/tensors.md, "At the
paper's width").

    dynmo train --nproc 2 --config configs/pruning.toml --steps 120 --balance.when never \
        --out runs/pruning-static --overwrite
    python benchmarks/prune_paper_kernels.py runs/pruning-static [--width 1600] [--tokens N] \
        [--device cuda] [--dtype bf16] [--json OUT.json]

`dynmo bench` replays a pruning run at the paper's scale (48 blocks, 24 stages x 30 dp) by
scaling its trace: each new block takes a traced block's costs. But the traced blocks are the
small model's, whose CSR kernel barely pays off at width 256; the paper's models are wider, and
how much a pruned block gets cheaper depends on the kernels at that width. This program:

1. reads, at every pruning step of the run, each block's recorded mask features per pruned
   Linear (`prune_rows_*` / `prune_cols_*` in metrics.jsonl);
2. generates masks with those features at the Linears' sizes in a model of width `--width`
   (default 1600, GPT-2 XL's, a 48-block GPT: the paper trains GPT models of 24 to 48 blocks and
   does not give their width) with `dynmo.tensor.masks`;
3. times, on this machine's CPU or its first GPU (`--device`), in fp32 or under bf16 autocast
   (`--dtype`), one forward + backward of a microbatch (`--tokens`; default the
   run's, 512 for configs/pruning.toml, as one sequence) through each Linear under
   each mask with the dense and the CSR kernel (`dynmo.model.sparse.time_kernels`, as
   `prune.kernel = auto` does in a run) and through a whole dense block of that width;
4. gives each block, in each pruning phase, the cost (the rest of the block + the faster
   kernel's Linears) relative to the dense block (`dynmo.sim.trace.relevel`), and replays the
   trace at the benchmark's shape before and after, printing both tables.

Only relative costs are taken from the wide model: the replay keeps the traced run's time scale,
as the benchmark's replay does, so the two tables differ only in how pruning changed each block.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import os
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from dynmo.bench.cases import CASES, SIM_POLICIES
from dynmo.config import load_config
from dynmo.model.gpt import Block
from dynmo.model.sparse import time_kernels
from dynmo.sim import load_trace, scale_trace
from dynmo.sim.replay import ReplayOptions, replay, replay_balance
from dynmo.sim.trace.relevel import relevel
from dynmo.tensor.masks import generate_mask, mask_error, mask_spec
from dynmo.tensor.matrix import MATRIX_STATS

SIDES = ("rows", "cols")


def pruning_features(run: Path) -> dict[int, dict[int, list[dict]]]:
    """Pruning step -> block (layer index) -> per pruned Linear, {"rows": stats, "cols": stats}."""
    out: dict[int, dict[int, list[dict]]] = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        if not line.strip():
            continue
        r = json.loads(line)
        if not any(e.get("type") == "dynamism" and e.get("case") == "prune" for e in r["events"]):
            continue
        if "prune_rows_max" not in r:
            raise SystemExit(f"{run}: step {r['step']} records no mask features (prune_rows_*); "
                             "run it again with this dynmo (unstructured pruning records them)")
        per_layer = {}
        for i, mx in enumerate(r["prune_rows_max"]):
            if mx is None:
                continue
            per_layer[i] = [{side: {k: r[f"prune_{side}_{k}"][i][j] for k in MATRIX_STATS} for side in SIDES}
                            for j in range(len(mx))]
        out[r["step"]] = per_layer
    if not out:
        raise SystemExit(f"{run}: no pruning step in metrics.jsonl")
    return out


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def block_seconds(block: torch.nn.Module, tokens: int, width: int, reps: int,
                  dtype: torch.dtype = torch.float32) -> float:
    dev = next(block.parameters(), torch.empty(0)).device
    x = torch.randn(1, tokens, width, device=dev)
    mask = torch.ones(1, tokens, dtype=torch.bool, device=dev)
    best = float("inf")
    for _ in range(reps):
        xi = x.clone().requires_grad_(True)
        _sync(dev)
        t = time.perf_counter()
        with torch.autocast(device_type=dev.type, dtype=dtype, enabled=dtype != torch.float32):
            y, _ = block(xi, mask)
        y.float().sum().backward()
        _sync(dev)
        best = min(best, time.perf_counter() - t)
    return best


class _FreeLinear(torch.nn.Module):
    """A Linear's shapes at almost no cost: what is left of a block's time without its products."""

    def __init__(self, out_features: int):
        super().__init__()
        self.out_features = out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean(-1, keepdim=True).expand(*x.shape[:-1], self.out_features)


def without_linears(block: torch.nn.Module, names: tuple[str, ...]) -> torch.nn.Module:
    bare = copy.deepcopy(block)
    for n in names:
        parent, _, child = n.rpartition(".")
        owner = bare.get_submodule(parent) if parent else bare
        setattr(owner, child, _FreeLinear(owner.get_submodule(child).out_features))
    return bare


def kernel_seconds(lin: torch.nn.Module, mask: torch.Tensor, tokens: int, reps: int,
                   dtype: torch.dtype = torch.float32) -> dict[str, float]:
    """`time_kernels` `reps` times, one timing of each kernel in turn, the fastest of each kept:
    a burst of another job's load then slows one timing of both kernels, not all of one."""
    best: dict[str, float] = {}
    for _ in range(reps):
        for k, v in time_kernels(lin, mask.to(lin.weight.device), tokens, reps=1, dtype=dtype).items():
            best[k] = min(best.get(k, float("inf")), v)
    return best


def _draw(spec_seed):
    spec, seed = spec_seed
    return generate_mask(spec, seed=seed)


def measure(run: Path, width: int, tokens: int, reps: int, seed: int, device: str = "cpu",
            dtype: torch.dtype = torch.float32, jobs: int = 1) -> dict:
    cfg = load_config(run / "config.toml")
    small = cfg.model
    tokens = tokens or cfg.train.global_batch // cfg.train.microbatches * small.seq_len
    if small.block != "dense" or small.family != "gpt":
        raise SystemExit(f"{run}: a gpt model of dense blocks was pruned here; this program times those")
    scale = width / small.d_model
    big = replace(small, d_model=width, n_heads=max(1, width // 64), seq_len=max(small.seq_len, tokens))
    torch.manual_seed(seed)
    block = Block(big).to(device)
    names = Block.prunable
    small_shapes = [tuple(Block(small).get_submodule(n).weight.shape) for n in names]
    # the rest of the block (norms, attention's own products, activations, residuals), timed on
    # the block with its Linears made free, per second of its Linears: a ratio, so that each
    # phase's level below rests on that block's own adjacent kernel timings. The block, the bare
    # block and the Linears are timed in turn, `reps` rounds, the fastest of each kept.
    bare, ones = without_linears(block, names), {n: torch.ones_like(block.get_submodule(n).weight, dtype=torch.bool)
                                                  for n in names}
    whole = rest_s = float("inf")
    linear_s = dict.fromkeys(names, float("inf"))
    for _ in range(reps):
        whole = min(whole, block_seconds(block, tokens, width, 1, dtype))
        rest_s = min(rest_s, block_seconds(bare, tokens, width, 1, dtype))
        for n in names:
            linear_s[n] = min(linear_s[n], time_kernels(block.get_submodule(n), ones[n], tokens, reps=1,
                                                        dtype=dtype)["dense"])
    ones = linear_s
    rest = rest_s / sum(ones.values())
    print(f"dense block of width {width}, {tokens} tokens: {1e3 * whole:.1f} ms fwd+bwd, its Linears "
          f"{1e3 * sum(ones.values()):.1f} ms, the rest {rest:.2f} x the Linears", file=sys.stderr)
    feats = pruning_features(run)
    # the masks are drawn first, in parallel (each is independent and seeded), then timed in turn
    todo = {(step, i, j): (mask_spec(f, rows, cols, scale), seed + 1000 * step + 10 * i)
            for step, per_layer in feats.items() for i, linears in per_layer.items()
            for j, ((rows, cols), f) in enumerate(zip(small_shapes, linears))}
    print(f"drawing {len(todo)} masks on {jobs} processes", file=sys.stderr)
    with ProcessPoolExecutor(jobs) as pool:
        masks = dict(zip(todo, pool.map(_draw, todo.values())))
    phases = {}
    worst: dict[str, float] = {}
    for step, per_layer in sorted(feats.items()):
        phase = {}
        for i, linears in sorted(per_layer.items()):
            dense = csr = 0.0
            for j, n in enumerate(names[:len(linears)]):
                spec, mask = todo[step, i, j][0], masks.pop((step, i, j))
                for k, v in mask_error(mask, spec).items():
                    worst[k] = max(worst.get(k, 0.0), v)
                t = kernel_seconds(block.get_submodule(n), torch.from_numpy(mask), tokens, reps, dtype)
                dense += t["dense"]
                csr += t["csr"]
            kernel = "csr" if csr < dense else "dense"
            # masked dense does the dense block's products: the block's cost relative to dense is
            # (rest + the faster kernel) / (rest + dense), both from this block's own timings
            phase[i] = {"dense_ms": 1e3 * dense, "csr_ms": 1e3 * csr, "kernel": kernel,
                        "level": (rest * dense + min(dense, csr)) / (rest * dense + dense)}
            print(f"step {step} block {i}: dense {1e3 * dense:.1f} ms, csr {1e3 * csr:.1f} ms -> {kernel}, "
                  f"level {phase[i]['level']:.3f}", file=sys.stderr)
        phases[step] = phase
    return {"width": width, "tokens": tokens, "reps": reps, "device": device, "dtype": str(dtype).split(".")[-1],
            "block_ms": 1e3 * whole,
            "linears_dense_ms": {n: 1e3 * v for n, v in ones.items()}, "rest_per_linears": rest,
            "worst_mask_error": worst, "phases": phases}


def replay_rows(trace, case) -> list:
    scaled = scale_trace(trace, case.blocks, noise=0.05)
    # the decisions' time as the benchmark's replay charges it would differ between runs: left out
    opts = ReplayOptions(microbatches=4 * case.stages, balance=replay_balance(when=case.when), charge_decide=False)
    return replay(scaled, stages=case.stages, dp=case.dp, policies=SIM_POLICIES, options=opts)


def table(title: str, results) -> str:
    lines = [f"{title}", f"{'policy':<22} {'vs uniform':>10} {'vs best static':>14} {'bubble':>7} "
             f"{'workers':>7} {'migrations':>10}"]
    for r in results:
        d = r.as_dict(per_step=False)
        lines.append(f"{r.policy:<22} {d['speedup']:>10.3f} {d['speedup_vs_best_static']:>14.3f} "
                     f"{d['mean_bubble']:>7.3f} {d['workers_mean']:>7.0f} {d['migrations']:>10}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", type=Path, help="a pruning run's folder (metrics.jsonl, config.toml)")
    ap.add_argument("--width", type=int, default=1600, help="the paper-sized model's width (default 1600)")
    ap.add_argument("--tokens", type=int, default=0,
                    help="tokens per microbatch timed (default: the run's own, as its pruning steps timed them)")
    ap.add_argument("--reps", type=int, default=3, help="timings per kernel, the fastest kept (default 3)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", type=Path, help="write the measured kernel times and levels here")
    ap.add_argument("--device", default="cpu",
                    help="where the kernels are timed: cpu (default) or cuda (the first visible GPU)")
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                    help="fp32 (default) or bf16 autocast, as train.dtype (CSR products stay fp32)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                    help="processes drawing the masks (default: one per core)")
    a = ap.parse_args(argv)
    if not (a.run / "metrics.jsonl").is_file() or not (a.run / "config.toml").is_file():
        print(f"{a.run}: not a run folder (no metrics.jsonl and config.toml)", file=sys.stderr)
        return 2
    if a.json is not None and a.json.exists():
        print(f"{a.json} exists; remove it or name another", file=sys.stderr)
        return 2
    if a.device not in ("cpu", "cuda") or (a.device == "cuda" and not torch.cuda.is_available()):
        print(f"--device {a.device}: use cpu, or cuda on a machine whose PyTorch sees a GPU", file=sys.stderr)
        return 2
    torch.set_num_threads(max(1, torch.get_num_threads()))
    got = measure(a.run, a.width, a.tokens, a.reps, a.seed, a.device,
                  torch.bfloat16 if a.dtype == "bf16" else torch.float32, max(1, a.jobs))
    trace = load_trace(a.run)
    levels = {step: {i: p["level"] for i, p in phase.items()} for step, phase in got["phases"].items()}
    case = next(c for c in CASES if c.name == "pruning")
    shape = f"{case.blocks} blocks, {case.stages} stages x {case.dp} dp, {4 * case.stages} microbatches"
    print(table(f"\nbefore: costs scaled from the traced model ({shape})", replay_rows(trace, case)))
    print(table(f"\nafter: each pruning phase's block costs from width-{a.width} kernels ({shape})",
                replay_rows(relevel(trace, levels), case)))
    print("\nmasks against the features asked for, worst relative error over all masks: "
          + ", ".join(f"{k} {v:.2%}" for k, v in got["worst_mask_error"].items()))
    if a.json is not None:
        a.json.write_text(json.dumps(got, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
