"""Counted work vs measured time of the dynamic blocks (MoE, Mixture of Depths, hash-sparse
attention), one block on one process and one thread, like one pipeline rank.

Produces the tables in docs/bench/dynamic-blocks.md ("Counted work vs measured time, one block on
one thread"; "MoE expert dispatch: grouped against padded and dense", from
`--cases moe --d-model 512 --seq-len 512 --batch 4`).

    python benchmarks/bench_dynamic_blocks.py [--repeats 7] [--d-model 256] [--seq-len 128] [--batch 4]
        [--cases moe,mod,hashattn] [--clock cpu|wall] [--device cpu|cuda] [--dtype fp32|bf16]
    python benchmarks/bench_dynamic_blocks.py --model [--steps 12] [--pairs 3]

Per case the routing / capacity / hashing is varied on purpose, and each row prints the block's
own counted work (from `block.last_stats`) next to its measured forward + backward time
(median of --repeats; CPU seconds of this process by default, so that other jobs on a shared
machine do not count). The last line of each case fits time = a + b * work and gives the
correlation, so "the layer's time follows its counted work" is a measured claim:

  moe       the router pushed from balanced towards one expert (skew 0..8): per skew the grouped
            dispatch (the default: rows sorted by expert, grouped matmuls) against a dense block
            whose MLP has the same active FLOPs (mlp_ratio x top_k) and the ratio, which should
            stay flat; the padded dispatch (every expert padded to the busiest) beside it, whose
            expert_rows and time grow with the skew (the fit is on its rows);
  mod       rows (batch x chosen tokens) vs block time, per capacity; the dense block for scale;
  hashattn  computed tiles / causal tiles vs attention time, per number of LSH buckets; dense
            causal attention (SDPA) for scale.

Model mode (`--model`): whole models, `dynmo train --nproc 1` at d_model 512, 8 heads, 256
tokens, 2 layers, global batch 8 in 2 microbatches, static layout, OMP_NUM_THREADS=1 (set it
to change): configs/moe.toml against its dense blocks of the same active FLOPs (`mlp_ratio`
8 = 4 x top-2), and configs/mixtral.toml (intermediate 1376) against configs/llama.toml of
twice its intermediate size, alternating run by run (`paired_runs.py`); tokens/s per run,
the ratio per pair and its median.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from dynmo.config import HashAttnConfig, MoDConfig, MoEConfig, ModelConfig
from dynmo.model.gpt import Block
from dynmo.model.layers import LayerSpec, build_layer
from dynmo.model.moe import MoEBlock
from dynmo.model.stats import as_numbers
from paired_runs import paired_table


def _cuda_now() -> float:
    torch.cuda.synchronize()  # a CUDA kernel's time is over when the device says so
    return time.perf_counter()


CLOCKS = {"cpu": time.process_time, "wall": time.perf_counter, "cuda": _cuda_now}
clock = CLOCKS["cpu"]
DEVICE = torch.device("cpu")
DTYPE = None  # autocast dtype (bf16 on a GPU), None = fp32


def on_device(module):
    return module.to(DEVICE)


def fwd_bwd_s(fns: list, params: list[list], repeats: int) -> list[float]:
    """Median seconds of one forward + backward of each `fns[i]()` (returns a tensor).

    The variants are timed round-robin, so a burst of load from other processes on this
    shared machine hits all of them alike instead of one variant's whole series.
    """
    times: list[list[float]] = [[] for _ in fns]
    for r in range(repeats + 1):  # one warm-up round
        for k, (fn, ps) in enumerate(zip(fns, params)):
            for p in ps:
                p.grad = None
            t = clock()
            with torch.autocast(DEVICE.type, dtype=DTYPE or torch.float32, enabled=DTYPE is not None):
                y = fn()
            y.float().square().mean().backward()
            if r:
                times[k].append(clock() - t)
    return [statistics.median(ts) for ts in times]


def fit(work: list[float], secs: list[float]) -> str:
    n = len(work)
    mw, ms = sum(work) / n, sum(secs) / n
    cov = sum((w - mw) * (s - ms) for w, s in zip(work, secs))
    vw = sum((w - mw) ** 2 for w in work)
    vs = sum((s - ms) ** 2 for s in secs)
    b = cov / vw if vw else 0.0
    r = cov / (vw * vs) ** 0.5 if vw and vs else float("nan")
    return f"fit: time = {1e3 * (ms - b * mw):.2f} ms + {1e6 * b:.3f} us x work, correlation r = {r:.3f}"


def model_cfg(args, **kw) -> ModelConfig:
    heads = max(4, args.d_model // 128)  # 4 up to d_model 512, then heads of 128
    return ModelConfig(**{"d_model": args.d_model, "n_heads": heads, "seq_len": args.seq_len, "n_layers": 8,
                          "mlp_ratio": 4, **kw})


def bench_moe(args) -> None:
    E, k = 8, 2
    cfg = model_cfg(args, block="moe", moe=MoEConfig(num_experts=E, top_k=k))  # one MoEConfig, shared
    B, T, D = args.batch, args.seq_len, args.d_model
    x = torch.randn(B, T, D, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    mask = torch.ones(B, T, dtype=torch.bool, device=DEVICE)
    skews = [0.0, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0]
    dense = on_device(build_layer(LayerSpec("t", 1), model_cfg(args, mlp_ratio=4 * k), seed=0))  # the same active FLOPs
    blocks: list[MoEBlock] = []
    stats: dict[str, list[dict]] = {"grouped": [], "padded": []}
    for skew in skews:
        block: MoEBlock = on_device(build_layer(LayerSpec("t", 1), cfg, seed=0))
        with torch.no_grad():  # push expert 0's router row along the tokens' shared direction
            h = block.ln2(x + block.attn(block.ln1(x))).reshape(-1, D).mean(0)
            block.moe.router.weight[0] += skew * h / h.norm()
        for dispatch in stats:
            cfg.moe.dispatch = dispatch
            block.reset_stats()
            block(x, mask)
            stats[dispatch].append(as_numbers([block.last_stats])[0])
        blocks.append(block)

    def run(b: MoEBlock, dispatch: str):
        def fn():
            cfg.moe.dispatch = dispatch
            return b(x, mask)[0]
        return fn

    fns = [lambda: dense(x, mask)[0]] + [run(b, d) for b in blocks for d in stats]
    params = [list(dense.parameters())] + [list(b.parameters()) for b in blocks for _ in stats]
    secs = fwd_bwd_s(fns, params, args.repeats)
    t_dense, grouped, padded = secs[0], secs[1::2], secs[2::2]
    print(f"\nMoE: {E} experts, top-{k}, dropless, d_model {D}, {B}x{T} tokens per microbatch "
          f"(balanced load {B * T * k // E} per expert); dense block with mlp_ratio {4 * k} "
          f"(the same active FLOPs) {1e3 * t_dense:.2f} ms")
    print(f"{'router skew':>12} {'imbalance':>10} {'max load':>9} {'useful_rows':>12} {'grouped rows':>13} "
          f"{'grouped ms':>11} {'vs dense':>9} {'padded rows':>12} {'padded ms':>10}")
    for skew, sg, sp, tg, tp in zip(skews, stats["grouped"], stats["padded"], grouped, padded):
        print(f"{skew:>12.2f} {sg['routing_imbalance']:>10.2f} {max(sg['tokens_per_expert']):>9} "
              f"{sg['useful_rows']:>12} {sg['expert_rows']:>13} {1e3 * tg:>11.2f} {tg / t_dense:>9.2f} "
              f"{sp['expert_rows']:>12} {1e3 * tp:>10.2f}")
    print(f"  grouped: slowest / fastest {max(grouped) / min(grouped):.2f}, worst vs dense "
          f"{max(grouped) / t_dense:.2f}")
    print(f"  padded {fit([s['expert_rows'] for s in stats['padded']], padded)}  (work = expert_rows)")


def bench_mod(args) -> None:
    B, T, D = args.batch, args.seq_len, args.d_model
    x = torch.randn(B, T, D, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    mask = torch.ones(B, T, dtype=torch.bool, device=DEVICE)
    caps = [0.0625, 0.125, 0.25, 0.5, 0.75, 1.0]
    blocks = [on_device(build_layer(LayerSpec("t", 1), model_cfg(args), seed=0)), *[
        on_device(build_layer(LayerSpec("t", 1), model_cfg(args, block="mod", mod=MoDConfig(capacity=c)), seed=0))
        for c in caps]]
    stats = []
    for b in blocks[1:]:
        b(x, mask)
        stats.append(dict(b.last_stats))
    secs = fwd_bwd_s([lambda b=b: b(x, mask)[0] for b in blocks], [list(b.parameters()) for b in blocks], args.repeats)
    t_dense, secs = secs[0], secs[1:]
    print(f"\nMixture of Depths: d_model {D}, {B}x{T} tokens per microbatch; dense block {1e3 * t_dense:.2f} ms")
    print(f"{'capacity':>9} {'rows':>6} {'attn_pairs':>11} {'fwd+bwd ms':>11} {'vs dense':>9}")
    for c, s, t in zip(caps, stats, secs):
        print(f"{c:>9.4f} {s['rows']:>6} {s['attn_pairs']:>11} {1e3 * t:>11.2f} {t / t_dense:>9.2f}")
    print(f"  {fit([s['rows'] for s in stats], secs)}  (work = rows)")


def bench_hashattn(args) -> None:
    B, T, D, chunk = args.batch, args.hash_seq_len, args.d_model, args.chunk
    x = torch.randn(B, T, D, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    buckets = [1, 2, 4, 8, 16]
    dense = on_device(Block(model_cfg(args, seq_len=T)).attn)
    attns = [on_device(build_layer(LayerSpec("t", 1), model_cfg(args, seq_len=T, block="hashattn",
                                                                hashattn=HashAttnConfig(n_buckets=nb, chunk=chunk)),
                                   seed=0).attn)
             for nb in buckets]
    infos = [a(x)[1] for a in attns]
    fns = [lambda: dense(x)] + [lambda a=a: a(x)[0] for a in attns]
    secs = fwd_bwd_s(fns, [list(dense.parameters())] + [list(a.parameters()) for a in attns], args.repeats)
    t_dense, secs = secs[0], secs[1:]
    n = T // chunk
    print(f"\nHash-sparse attention: d_model {D}, {max(4, D // 128)} heads, {B}x{T} tokens, tiles of {chunk} "
          f"({n * (n + 1) // 2} causal tiles per head and sequence); dense causal SDPA {1e3 * t_dense:.2f} ms")
    print(f"{'buckets':>8} {'computed':>9} {'of causal':>10} {'skipped':>8} {'attn fwd+bwd ms':>16} {'vs SDPA':>8}")
    for nb, info, t in zip(buckets, infos, secs):
        frac = info["blocks_computed"] / info["blocks_causal"]
        print(f"{nb:>8} {info['blocks_computed']:>9} {info['blocks_causal']:>10} {1 - frac:>8.3f} "
              f"{1e3 * t:>16.2f} {t / t_dense:>8.2f}")
    print(f"  {fit([i['blocks_computed'] for i in infos], secs)}  (work = computed tiles)")


MODEL_SIZE = ["--model.d_model", "512", "--model.n_heads", "8", "--model.seq_len", "256", "--model.n_layers", "2",
              "--train.global_batch", "8", "--train.microbatches", "2", "--balance.when", "never"]


def model_tables(args) -> None:
    """MoE and Mixtral whole models against the dense models of the same active FLOPs."""
    paired_table(("moe", "configs/moe.toml", MODEL_SIZE),
                 ("dense", "configs/moe.toml", [*MODEL_SIZE, "--model.block", "dense", "--model.mlp_ratio", "8"]),
                 args.steps, args.pairs)
    paired_table(("mixtral", "configs/mixtral.toml", [*MODEL_SIZE, "--model.intermediate_size", "1376"]),
                 ("llama", "configs/llama.toml",
                  [*MODEL_SIZE, "--model.n_kv_heads", "2", "--model.intermediate_size", "2752"]),
                 args.steps, args.pairs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--seq-len", type=int, default=128, help="MoE and MoD sequence length")
    ap.add_argument("--hash-seq-len", type=int, default=512, help="hash attention sequence length")
    ap.add_argument("--chunk", type=int, default=32, help="hash attention tile size")
    ap.add_argument("--batch", type=int, default=4, help="sequences per microbatch")
    ap.add_argument("--cases", default="moe,mod,hashattn")
    ap.add_argument("--clock", choices=sorted(CLOCKS), default="cpu",
                    help="cpu: this process's CPU seconds (default; other jobs do not count), wall: elapsed; "
                         "with --device cuda always elapsed after a device synchronize")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="bf16: autocast, as train.dtype bf16")
    ap.add_argument("--model", action="store_true",
                    help="whole models: MoE and Mixtral trained against dense models of the same active FLOPs")
    ap.add_argument("--steps", type=int, default=12, help="--model: training steps per run")
    ap.add_argument("--pairs", type=int, default=3, help="--model: alternating pairs")
    args = ap.parse_args()
    if args.model:
        model_tables(args)
        return
    global clock, DEVICE, DTYPE
    DEVICE = torch.device(args.device)
    DTYPE = torch.bfloat16 if args.dtype == "bf16" else None
    if args.device == "cuda":
        clock, where = CLOCKS["cuda"], torch.cuda.get_device_name()
    else:
        clock, where = CLOCKS[args.clock], "1 thread"
        torch.set_num_threads(1)  # one pipeline rank's share of this machine
    print(f"torch {torch.__version__}, {where}, {args.dtype}; time = median of {args.repeats} forward+backward "
          f"runs ({'cuda' if args.device == 'cuda' else args.clock} seconds)")
    for case in args.cases.split(","):
        {"moe": bench_moe, "mod": bench_mod, "hashattn": bench_hashattn}[case.strip()](args)


if __name__ == "__main__":
    main()
