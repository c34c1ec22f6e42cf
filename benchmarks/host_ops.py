"""The host's work per microbatch, counted: aten operators one forward+backward dispatches.

    python benchmarks/host_ops.py [--configs default,mod,moe,llama,mixtral,llama-mod] [--batch 2]
        [--compile] [--by-op N] [--json FILE] [-- extra config overrides]

For each config the whole model is built from it (embedding -> blocks -> head) at the size the
counts are quoted at (d_model 64, 4 heads, 128 tokens; `dynmo.model.hostops.QUOTED`), and one
microbatch's forward, loss and backward runs under a `TorchDispatchMode` that counts every aten
operator that is not a view (`dynmo.model.hostops.count_step`). In eager mode each one is at
least one kernel launch on a GPU, so the count bounds how fast the host can feed the device at
any model size; it is exact and the same on every machine. It prints per config the count, the
ratio to the first config (gpt dense), and any operator that synchronises the host with the
device (`SYNC_OPS`; a training step should hold none).

--compile compiles every layer as the runtime does (`dynmo.runtime.compiled.compile_unit`, bf16
autocast: torch compiles the grouped expert matmul in bf16 only) and counts what a compiled step runs: the kernels Inductor generated, as the profiler records them
(`torch._inductor.config.cpp.enable_kernel_profile`), plus the aten operators its graphs still
call (matrix products, attention). On a GPU, `benchmarks/profile_step.py` counts the launches
themselves (`torch.profiler`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from dynmo.model.hostops import build_model, count_step, microbatch_step, quoted_config

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ["default", "mod", "moe", "llama", "mixtral", "llama-mod"]


def compiled_count(cfg, batch: int) -> int:
    """Kernels and aten operators one compiled microbatch step runs (see the module docstring)."""
    import torch._inductor.config as inductor_config
    from torch.profiler import ProfilerActivity, profile

    from dynmo.runtime.compiled import compile_unit

    inductor_config.cpp.enable_kernel_profile = True
    layers = build_model(cfg)
    for layer in layers:
        compile_unit(layer, torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.model.vocab_size, (batch, cfg.model.seq_len + 1), generator=gen)
    def new_step():  # what the trainer does before each step: a block's statistics start again
        for layer in layers:
            if hasattr(layer, "reset_stats"):
                layer.reset_stats()

    with torch.autocast("cpu", dtype=torch.bfloat16):  # torch compiles the grouped expert matmul in bf16 only
        # two steps of two microbatches compile every graph a step runs (a block's graph differs
        # between a step's first forward, whose statistics start, and the later ones, which add)
        for _ in range(2):
            new_step()
            for _ in range(2):
                microbatch_step(layers, tokens)
        new_step()
        microbatch_step(layers, tokens)
        with profile(activities=[ProfilerActivity.CPU]) as prof:  # a step's second microbatch, as count_step
            microbatch_step(layers, tokens)
    n = 0
    for evt in prof.events():
        if evt.cpu_parent is not None and evt.cpu_parent.name.startswith("aten::"):
            continue  # the operators an operator calls are part of it
        if evt.name.startswith("aten::") or "cpp_fused" in evt.name or "kernel" in evt.name:  # graph_N_cpp_fused_...
            n += 1
    return n


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default=",".join(CONFIGS), help="names under configs/, the first is the baseline")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--compile", action="store_true", help="also count a compiled step (slow: compiles every layer)")
    ap.add_argument("--by-op", type=int, default=0, help="print each config's N most dispatched operators")
    ap.add_argument("--json", default="", help="write the counts to this file")
    ap.add_argument("overrides", nargs="*", help="config overrides after --, e.g. -- --model.n_layers 4")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    rows, base, compiled_base = [], None, None
    header = f"{'config':<12} {'aten ops':>9} {'x first':>8}" + (f" {'compiled':>9} {'x first':>8}" if args.compile else "")
    print(header + "  sync operators")
    for name in args.configs.split(","):
        cfg = quoted_config(ROOT / "configs" / f"{name}.toml", args.overrides)
        c = count_step(cfg, args.batch)
        base = base or c.total
        row = {"config": name, "ops": c.total, "ratio": c.total / base, "syncs": dict(c.syncs)}
        line = f"{name:<12} {c.total:>9} {c.total / base:>8.2f}"
        if args.compile:
            n = compiled_count(cfg, args.batch)
            compiled_base = compiled_base or n
            row |= {"compiled": n, "compiled_ratio": n / compiled_base}
            line += f" {n:>9} {n / compiled_base:>8.2f}"
        print(line + "  " + (", ".join(f"{k} x{v}" for k, v in c.syncs.items()) or "none"), flush=True)
        if args.by_op:
            top = c.ops.most_common(args.by_op)
            print("    " + ", ".join(f"{op.removeprefix('aten::')} {n}" for op, n in top))
        rows.append(row)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
