"""Per-block forward + backward time of the three shrinking cases: pruning, freezing, early exit.

Produces the tables in docs/bench/shrinking.md ("Per-block cost, one thread").

    OMP_NUM_THREADS=1 python benchmarks/bench_shrinking.py [--d-model 256] [--tokens 512] [--repeats 7]

One process, one thread (like each pipeline rank), one transformer block of the default model
(d_model 256, MLP 4x) on a microbatch of `--tokens` tokens (default 4 x 128). Prints:
  pruning     block time vs density with masked-dense and CSR Linears, and what `kernel = auto`
              would pick (the faster one);
  freezing    trainable vs frozen block (frozen: no weight gradients, the input gradient is
              still computed because earlier layers train);
  early exit  block time vs fraction of active tokens (exited tokens only serve as keys/values).
Times are medians over --repeats runs after a warm-up. Tests never assert on these numbers.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from dynmo.config import EarlyExitConfig, ModelConfig
from dynmo.dynamics.earlyexit import install_gate
from dynmo.dynamics.freeze import freeze_layer
from dynmo.dynamics.prune import PRUNABLE
from dynmo.dynamics.topk import global_keep
from dynmo.model.layers import LayerSpec, build_layer
from dynmo.model.sparse import set_mask


def fwd_bwd(block, x, mask, repeats: int) -> float:
    times = []
    for r in range(repeats + 1):
        xi = x.clone().requires_grad_(True)
        t = time.perf_counter()
        out = block(xi, mask)[0]
        out.backward(torch.ones_like(out))
        if r:  # the first run warms up
            times.append(time.perf_counter() - t)
        for p in block.parameters():
            p.grad = None
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=512, help="tokens per microbatch (a multiple of seq-len)")
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    torch.set_num_threads(1)
    cfg = ModelConfig(d_model=args.d_model, n_heads=4, seq_len=args.seq_len, n_layers=8)
    B, T, D = args.tokens // args.seq_len, args.seq_len, args.d_model
    x = torch.randn(B, T, D) * 0.5
    full = torch.ones(B, T, dtype=torch.bool)

    def fresh():
        return build_layer(LayerSpec("t", 1), cfg, seed=0)

    base = fwd_bwd(fresh(), x, full, args.repeats)
    print(f"one block, d_model={D}, {B}x{T} tokens, fwd+bwd; dense block: {1e3 * base:.2f} ms\n")

    print("pruning (global magnitude mask over the block's Linears)")
    print(f"{'density':>8} {'masked dense ms':>16} {'csr ms':>8} {'csr/dense':>10} {'auto picks':>11}")
    for density in (1.0, 0.5, 0.3, 0.2, 0.1, 0.05, 0.02):
        row = {}
        for kernel in ("dense", "csr"):
            b = fresh()
            lins = [b.get_submodule(n) for n in PRUNABLE]
            scores = [l.weight.detach().abs() for l in lins]
            total = sum(s.numel() for s in scores)
            for name, m in zip(PRUNABLE, global_keep(scores, round(density * total))):
                set_mask(b, name, m, kernel)
            row[kernel] = fwd_bwd(b, x, full, args.repeats)
        pick = "csr" if row["csr"] < row["dense"] else "dense"
        print(f"{density:8.2f} {1e3 * row['dense']:16.2f} {1e3 * row['csr']:8.2f} {row['csr'] / row['dense']:10.2f} {pick:>11}")

    print("\nfreezing")
    b = fresh()
    t_train = fwd_bwd(b, x, full, args.repeats)
    freeze_layer(b)
    t_frozen = fwd_bwd(b, x, full, args.repeats)
    print(f"{'trainable ms':>13} {'frozen ms':>10} {'frozen/trainable':>17}")
    print(f"{1e3 * t_train:13.2f} {1e3 * t_frozen:10.2f} {t_frozen / t_train:17.2f}")

    print("\nearly exit (active tokens per sequence; exited tokens stay keys/values)")
    print(f"{'active':>7} {'ms':>8} {'vs all active':>14}")
    b = fresh()
    install_gate(b, EarlyExitConfig(), can_exit=False)
    for frac in (1.0, 0.75, 0.5, 0.25, 0.1):
        mask = torch.rand(B, T, generator=torch.Generator().manual_seed(0)) < frac if frac < 1 else full
        t = fwd_bwd(b, x, mask, args.repeats)
        print(f"{frac:7.2f} {1e3 * t:8.2f} {t / base:14.2f}")


if __name__ == "__main__":
    main()
