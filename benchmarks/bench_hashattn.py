"""Hash-sparse attention kernels against causal SDPA: where the time goes.

Produces the tables in docs/bench/hashattn-kernels.md.

    python benchmarks/bench_hashattn.py [--seqs 2048,4096,8192,16384] [--buckets 1,2,4,8,16]
        [--paths staircase,tiles] [--repeats 3] [--flex]
    python benchmarks/bench_hashattn.py --device cuda --dtype bf16 [--paths flex,tiles]   # one GPU
    python benchmarks/bench_hashattn.py --model [--steps 12] [--pairs 2]

Kernel mode: one thread, B 1, 4 heads of 128 (`--heads`, `--head-dim`), random queries, keys,
values and LSH directions. For each sequence length and bucket count, the forward + backward
time of `hash_sparse_attention(kernel=path)` for each path, each timed right after causal
`F.scaled_dot_product_attention(is_causal=True)` on the same tensors, so a burst of load from
other processes hits both alike; a row gives the median over --repeats of those paired ratios.
Beside them the ideals, from the same hashes:

  tiles   computed tiles / causal tiles at --chunk (`blocks_computed / blocks_causal`), the
          work of a block-sparse flash kernel with that tile;
  pairs   allowed (query, key) pairs / causal pairs, the exact work;
  x/ideal each path's ratio over the tile ideal (1.0 = as fast as the tiles it needs).

Times are process CPU seconds (the one thread's work, which another process's load does not
lengthen the way it does wall time); `--clock wall` times wall seconds instead. `--flex` adds
a table of the forward alone, FlexAttention compiled for the CPU against the staircase and
SDPA (FlexAttention has no CPU backward).

Model mode: `dynmo train --nproc 1` of configs/hashattn-long.toml against the same model with
`--model.block dense`, --pairs times each, alternating, OMP_NUM_THREADS=1; prints each run's
mean tokens/s (steps 1 on, from summary.json), the first and last loss, and the ratio.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from dynmo.model.hashattn import hash_sparse_attention, lsh_buckets
from paired_runs import paired_table



def _cuda_now() -> float:
    torch.cuda.synchronize()  # a CUDA kernel's time is over when the device says so
    return time.perf_counter()


def clock(kind: str):
    return {"cpu": time.process_time, "wall": time.perf_counter, "cuda": _cuda_now}[kind]


def rand(gen, *shape, args, grad: bool = False) -> torch.Tensor:
    """Random values drawn on the CPU (the same on every device), then on --device in --dtype."""
    dt = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    t = torch.randn(*shape, generator=gen).to(args.device, dt)
    return t.requires_grad_() if grad else t


def fwd_bwd(fn, q, k, v, now) -> float:
    for t in (q, k, v):
        t.grad = None
    t0 = now()
    y = fn(q, k, v)
    y.backward(torch.ones_like(y))
    return now() - t0


def fwd(fn, q, k, v, now) -> float:
    with torch.no_grad():
        t0 = now()
        fn(q, k, v)
        return now() - t0


def pair_fraction(q, k, planes) -> float:
    """Allowed (query, key) pairs / causal pairs, from the hashes, without a T x T tensor."""
    T = q.shape[2]
    pos = torch.arange(T, device=q.device)
    with torch.no_grad():
        bq, bk = lsh_buckets(q, planes), lsh_buckets(k, planes)
        keys = torch.sort(bk * T + pos, dim=-1).values
        first = torch.searchsorted(keys, bq * T, right=False)
        upto = torch.searchsorted(keys, bq * T + pos, right=True)
    return float((upto - first).sum()) / (q.shape[0] * q.shape[1] * T * (T + 1) / 2)


def kernel_table(args) -> None:
    now = clock(args.clock)
    H, hd, chunk = args.heads, args.head_dim, args.chunk
    paths = args.paths.split(",")
    where = torch.cuda.get_device_name() if args.device == "cuda" else f"{torch.get_num_threads()} thread(s)"
    print(f"torch {torch.__version__}, {where}, {args.dtype}, B 1, {H} heads of {hd}, "
          f"tile {chunk}, {args.clock} seconds, median of {args.repeats} paired repeats")
    head = "| T | buckets | SDPA s | " + " | ".join(f"{p} s | {p} x" for p in paths)
    head += " | tile ideal | pair ideal | " + " | ".join(f"{p} x/ideal" for p in paths) + " |"
    print(head)
    print("|" + " --- |" * (5 + 3 * len(paths)))
    for T in (int(s) for s in args.seqs.split(",")):
        for nb in (int(b) for b in args.buckets.split(",")):
            gen = torch.Generator().manual_seed(T * 100 + nb)
            sdpa_s, times, ratios = [], {p: [] for p in paths}, {p: [] for p in paths}
            tile_ideal = pair_ideal = 0.0
            for rep in range(args.repeats + 1):  # one warm-up round
                q, k, v = (rand(gen, 1, H, T, hd, args=args, grad=True) for _ in range(3))
                planes = rand(gen, H, hd, nb, args=args)
                for p in paths:
                    s = fwd_bwd(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), q, k, v, now)
                    t = fwd_bwd(lambda q, k, v: hash_sparse_attention(q, k, v, planes, chunk, p)[0], q, k, v, now)
                    if rep:
                        sdpa_s.append(s)
                        times[p].append(t)
                        ratios[p].append(t / s)
                if rep:
                    _, info = hash_sparse_attention(q.detach(), k.detach(), v.detach(), planes, chunk, paths[0])
                    tile_ideal += float(info["blocks_computed"]) / info["blocks_causal"] / args.repeats
                    pair_ideal += pair_fraction(q, k, planes) / args.repeats
            row = [f"{T}", f"{nb}", f"{statistics.median(sdpa_s):.3f}"]
            for p in paths:
                row += [f"{statistics.median(times[p]):.3f}", f"{statistics.median(ratios[p]):.3f}"]
            row += [f"{tile_ideal:.3f}", f"{pair_ideal:.3f}"]
            row += [f"{statistics.median(ratios[p]) / tile_ideal:.2f}" for p in paths]
            print("| " + " | ".join(row) + " |", flush=True)


def flex_table(args) -> None:
    """Forward alone: FlexAttention compiled for the CPU, the staircase and causal SDPA."""
    now = clock(args.clock)
    H, hd, chunk = args.heads, args.head_dim, args.chunk
    print(f"\nforward only, {args.clock} seconds, median of {args.repeats}; the first flex call of each "
          f"length compiles (not timed)")
    print("| T | buckets | SDPA fwd s | staircase fwd x | flex fwd x |")
    print("| --- | --- | --- | --- | --- |")
    for T in (int(s) for s in args.seqs.split(",")):
        for nb in (int(b) for b in args.buckets.split(",")):
            if nb == 1:
                continue  # every kernel but tiles runs SDPA itself
            gen = torch.Generator().manual_seed(T * 100 + nb)
            r_st, r_fx, sd = [], [], []
            for rep in range(args.repeats + 1):
                q, k, v = (rand(gen, 1, H, T, hd, args=args) for _ in range(3))
                planes = rand(gen, H, hd, nb, args=args)
                s = fwd(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), q, k, v, now)
                a = fwd(lambda q, k, v: hash_sparse_attention(q, k, v, planes, chunk, "staircase")[0], q, k, v, now)
                b = fwd(lambda q, k, v: hash_sparse_attention(q, k, v, planes, chunk, "flex")[0], q, k, v, now)
                if rep:
                    sd.append(s)
                    r_st.append(a / s)
                    r_fx.append(b / s)
            print(f"| {T} | {nb} | {statistics.median(sd):.3f} | {statistics.median(r_st):.3f} | "
                  f"{statistics.median(r_fx):.3f} |", flush=True)


def model_table(args) -> None:
    config = "configs/hashattn-long.toml"
    paired_table(("hashattn", config, []), ("dense", config, ["--model.block", "dense"]), args.steps, args.pairs)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", default="2048,4096,8192,16384", help="sequence lengths, comma-separated")
    ap.add_argument("--buckets", default="1,2,4,8,16", help="LSH bucket counts, comma-separated")
    ap.add_argument("--paths", default=None,
                    help="kernels to time: staircase, tiles, flex (default staircase,tiles on CPU, flex,tiles on CUDA)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--chunk", type=int, default=128, help="the tile of the tile ideal and of the tiles kernel")
    ap.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    ap.add_argument("--flex", action="store_true", help="also the forward-only table with compiled FlexAttention")
    ap.add_argument("--model", action="store_true", help="time dynmo train of the long config against dense instead")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: time with a device synchronize")
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="of q, k and v (bf16 on a GPU)")
    ap.add_argument("--steps", type=int, default=12, help="--model: training steps per run")
    ap.add_argument("--pairs", type=int, default=2, help="--model: alternating (hashattn, dense) pairs")
    args = ap.parse_args(argv)
    if args.model:
        model_table(args)
        return 0
    if args.device == "cuda":
        args.clock = "cuda"
        args.paths = args.paths or "flex,tiles"
    else:
        args.paths = args.paths or "staircase,tiles"
        torch.set_num_threads(1)
    kernel_table(args)
    if args.flex:
        flex_table(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
