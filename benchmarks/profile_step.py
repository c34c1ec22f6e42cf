"""Where a training step's time goes, the model alone: is the device computing or waiting on the host?

    python benchmarks/profile_step.py [--cases gpt-dense,gpt-mod,gpt-moe] [--tiny] [--dtype bf16|fp32]
        [--steps 3] [--warmup 2] [--no-marks] [--compile] [--top 12]

For each case (gpu_check.py's names and sizes: d_model 2048, 2048 tokens by default, --tiny for a
CPU), the whole model runs in this process as one stage (`StageModule`, the module every
pipeline rank runs, with dynmo's per-layer marks and memory hooks unless --no-marks): a
microbatch's forward, loss and backward, then AdamW, --warmup steps untimed, then --steps under
torch.profiler. Per case it prints, per step:

  wall       milliseconds, from the step's start to the device's end (synchronized);
  device     milliseconds the device spent in kernels (CUDA only), and busy = device / wall:
             near 1 the step computes; far below 1 the device waits on the host (launches,
             synchronisations, Python);
  syncs      the host waiting for the device (`cudaStreamSynchronize`, `cudaDeviceSynchronize`:
             every read of a device value ends in one; CUDA only);
  reads      scalar reads and nonzero (`aten::_local_scalar_dense`, `aten::nonzero`) of any
             tensor: on a CPU tensor no sync (CPU's fused AdamW reads each step count, the CPU
             grouped matmul its offsets);
  launches   kernel launches (`cudaLaunchKernel` and friends; CUDA only);
  ops        aten operators called (nested ones counted too: a proxy for host work);
  tok/s      the microbatch's tokens over the wall time (forward, backward and the optimizer);

then its --top operators by self device time (CPU: self CPU time). Run it with and without
--no-marks to see what dynmo's own per-layer profiler costs a case. Written for the question a
GPU left open: Mixture of Depths' MFU is 0.3x the dense model's on an H200 though its blocks
hold no host read.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from dynmo.config import load_config
from dynmo.model.gpt import loss_fn
from dynmo.model.layers import build_layer, layer_specs
from dynmo.runtime import optim
from dynmo.runtime.compiled import compile_unit
from dynmo.runtime.stage import StageModule
from gpu_check import CASES, GPU, ROOT, TINY, case_overrides

SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize")
READS = ("aten::_local_scalar_dense", "aten::nonzero")
LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cudaLaunchCooperativeKernel")


def _self_device_us(evt) -> float:
    for name in ("self_device_time_total", "self_cuda_time_total"):  # the name since torch 2.4, and before
        if hasattr(evt, name):
            return float(getattr(evt, name))
    return 0.0


def build(case: str, tiny: bool, dtype: str, marks: bool, compiled: bool, device: torch.device):
    """The case's whole model as one stage on `device`, its optimizer and a microbatch of tokens."""
    overrides = case_overrides(case, TINY if tiny else GPU) + ["--train.dtype", dtype]
    cfg = load_config(ROOT / "configs" / CASES[case], overrides)
    specs = layer_specs(cfg.model)
    layers = [build_layer(s, cfg.model, cfg.train.seed).to(device) for s in specs]
    compute = torch.bfloat16 if dtype == "bf16" else torch.float32
    if compiled:
        for layer in layers:
            compile_unit(layer, compute)
    module = StageModule([s.name for s in specs], layers, list(range(len(specs))), profile=marks, device=device,
                         dtype=compute)
    opt = optim.build_optimizer(dict(zip([s.name for s in specs], layers)), cfg.train, device)
    mb = cfg.train.global_batch // cfg.train.microbatches
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.model.vocab_size, (mb, cfg.model.seq_len + 1), generator=gen).to(device)
    return module, opt, tokens


def step(module, opt, tokens, sync) -> float:
    t0 = time.perf_counter()
    x, y = tokens[:, :-1], tokens[:, 1:]
    loss = loss_fn(module(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    sync()
    return time.perf_counter() - t0


def profile_case(case: str, args, device: torch.device) -> dict:
    module, opt, tokens = build(case, args.tiny, args.dtype, not args.no_marks, args.compile, device)
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for _ in range(args.warmup):
        step(module, opt, tokens, sync)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        walls = [step(module, opt, tokens, sync) for _ in range(args.steps)]
    table = prof.key_averages()
    count = {e.key: e.count for e in table}
    n = args.steps
    device_ms = sum(_self_device_us(e) for e in table) / 1e3 / n if cuda else None
    wall_ms = 1e3 * statistics.median(walls)
    top = sorted(table, key=(_self_device_us if cuda else (lambda e: e.self_cpu_time_total)), reverse=True)
    return {
        "case": case, "wall_ms": wall_ms, "device_ms": device_ms,
        "busy": device_ms / wall_ms if device_ms is not None else None,
        "syncs": sum(count.get(k, 0) for k in SYNCS) / n if cuda else None,
        "reads": sum(count.get(k, 0) for k in READS) / n,
        "launches": sum(count.get(k, 0) for k in LAUNCHES) / n if cuda else None,
        "ops": sum(e.count for e in table if e.key.startswith("aten::")) / n,
        "tokens_per_s": tokens[:, :-1].numel() / (wall_ms / 1e3),
        "top": [(e.key, (_self_device_us(e) if cuda else e.self_cpu_time_total) / 1e3 / n, e.count / n)
                for e in top[:args.top]],
    }


def _fmt(v, spec: str) -> str:
    return "n/a" if v is None else format(v, spec)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="gpt-dense,gpt-mod,gpt-moe", help=f"comma-separated, of {', '.join(CASES)}")
    ap.add_argument("--tiny", action="store_true", help="gpu_check's tiny size (a CPU)")
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default=None, help="default bf16 on CUDA, fp32 on CPU")
    ap.add_argument("--steps", type=int, default=3, help="profiled steps")
    ap.add_argument("--warmup", type=int, default=2, help="steps before, not profiled")
    ap.add_argument("--no-marks", action="store_true", help="the stage without dynmo's per-layer marks and hooks")
    ap.add_argument("--compile", action="store_true", help="every layer compiled (train.compile)")
    ap.add_argument("--top", type=int, default=12, help="operators listed per case")
    args = ap.parse_args(argv)
    unknown = [c for c in args.cases.split(",") if c not in CASES]
    if unknown:
        print(f"profile_step: unknown case(s) {', '.join(unknown)}; choose from {', '.join(CASES)}", file=sys.stderr)
        return 2
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    args.dtype = args.dtype or ("bf16" if device.type == "cuda" else "fp32")
    where = torch.cuda.get_device_name() if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"torch {torch.__version__}, {where}, {args.dtype}, {'tiny' if args.tiny else 'gpu_check'} size, "
          f"marks {'off' if args.no_marks else 'on'}, {'compiled' if args.compile else 'eager'}; "
          f"per step, median of {args.steps} profiled after {args.warmup}\n")
    rows = [profile_case(c, args, device) for c in args.cases.split(",")]
    print("| case | wall ms | device ms | busy | syncs | reads | launches | aten ops | tok/s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['case']} | {r['wall_ms']:.1f} | {_fmt(r['device_ms'], '.1f')} | {_fmt(r['busy'], '.2f')} | "
              f"{_fmt(r['syncs'], '.0f')} | {r['reads']:.0f} | {_fmt(r['launches'], '.0f')} | {r['ops']:.0f} | "
              f"{r['tokens_per_s']:.0f} |")
    for r in rows if args.top > 0 else []:
        print(f"\n{r['case']}: top operators by self {'device' if device.type == 'cuda' else 'CPU'} time, per step")
        print("| operator | ms | calls |")
        print("| --- | --- | --- |")
        for name, ms, calls in r["top"]:
            print(f"| {name} | {ms:.2f} | {calls:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
