"""One-device check of dynmo on a GPU: every model family and dynamic case, short bf16 runs, a report.

Produces the GPU reports in docs/gpu/ (summarized in docs/gpu.md and docs/bench/gpu-check-h100.md);
tests/test_gpu_check.py imports it.

    python benchmarks/gpu_check.py --out runs/gpu-check                        # one CUDA device
    python benchmarks/gpu_check.py --device cpu --tiny --out /tmp/gpu-check    # the same, tiny, on CPU
    python benchmarks/gpu_check.py --out DIR --cases gpt-moe,llama-dense       # some cases

For each case (CASES: one config of configs/ per model family x dynamic case; LONG_CASES: hash
attention at 8k and 16k tokens and the same model with dense attention, FlexAttention against
SDPA) it runs the real trainer twice, on one rank:
  1stage  pp = 1, schedule 1f1b: one stage holds every layer;
  2stage  pp = 1, schedule interleaved1f1b with 2 virtual stages: the one rank holds both
          stages, so the schedule's stage-to-stage hand-over, per-stage timing and a 2-stage
          layout (with balance.when = auto, a migration if the controller decides one) run on
          one device; NCCL between GPUs is not exercised.
Every run is bf16 (`--dtype`), with the per-layer profiler on (CUDA events on a GPU,
dynmo/runtime/stage.py) and a trace (`--log.trace`, what `dynmo simulate --trace` replays).
Each case's dynamism (a pruning step, frozen blocks, exiting tokens, the injected skew) is
moved to the first steps, so it happens within the short run; the report lists every
setting that differs from the case's config.

Written under --out:
  report.md, report.json   per run: per-layer forward and backward ms, peak memory measured
                           (torch.cuda.max_memory_allocated on a GPU) against the balancer's
                           estimate, tokens/s, model TFLOP/s and MFU (model FLOPs counted from
                           the config, over the device's dense bf16 peak from PEAK_BF16_TFLOPS;
                           omitted for a device not in it, unless --peak-tflops is given)
  traces/RUN.trace.jsonl   the run's trace; runs/RUN/ its run folder (metrics.jsonl,
                           summary.json, config.toml); logs/RUN.log its console output

How it runs: one worker process (this script with --worker) calls `dynmo.train.main` -- the
entry point torchrun starts on every rank -- once per run, as a single-process
torch.distributed job (RANK=0, WORLD_SIZE=1, a free MASTER_PORT per run; NCCL on CUDA, gloo
on CPU, as dynmo/runtime/dist.py picks). One process for all runs because starting Python,
torch and the trainer costs seconds, most of a tiny run. A failed run returns its status and
the worker goes on; if the worker itself dies (a crash), a new one takes the remaining runs
and the report names the run it died in.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import gc
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from dynmo.config import ConfigError, load_config
from dynmo.flops import forward_flops_per_token

ROOT = Path(__file__).resolve().parents[1]

# case -> config: every model family (gpt, llama, mixtral) with each dynamic case it has a config
# for. Left out: main.toml (mod.toml with the controller on) and noisy.toml (timing noise on the
# dense model: no change to the model to check).
CASES = {
    "gpt-dense": "default.toml",
    "gpt-moe": "moe.toml",
    "gpt-mod": "mod.toml",
    "gpt-hashattn": "hashattn.toml",
    "gpt-pruning": "pruning.toml",
    "gpt-freezing": "freezing.toml",
    "gpt-earlyexit": "earlyexit.toml",
    "gpt-skewed": "skewed.toml",
    "llama-dense": "llama.toml",
    "llama-mod": "llama-mod.toml",
    "llama-hashattn": "llama-hashattn.toml",
    "llama-pruning": "llama-pruning.toml",
    "llama-freezing": "llama-freezing.toml",
    "llama-earlyexit": "llama-earlyexit.toml",
    "mixtral-moe": "mixtral.toml",
}
# Long sequences: hash attention (FlexAttention on a GPU) against the same model with dense
# attention (SDPA), at the case's own length. case -> (config, seq_len, block).
LONG_CASES = {
    "gpt-hashattn-8k": ("hashattn-long.toml", 8192, "hashattn"),
    "gpt-dense-8k": ("hashattn-long.toml", 8192, "dense"),
    "gpt-hashattn-16k": ("hashattn-long.toml", 16384, "hashattn"),
    "gpt-dense-16k": ("hashattn-long.toml", 16384, "dense"),
    "llama-hashattn-8k": ("llama-hashattn-long.toml", 8192, "hashattn"),
}
CASES.update({case: config for case, (config, _, _) in LONG_CASES.items()})
NOT_CHECKED = ("main.toml", "noisy.toml")

# Stage arrangements on the one rank: name -> (stages, config overrides).
STAGINGS = {
    "1stage": (1, ["--parallel.schedule", "1f1b", "--parallel.virtual_stages", "1"]),
    "2stage": (2, ["--parallel.schedule", "interleaved1f1b", "--parallel.virtual_stages", "2"]),
}

# Dense (no sparsity) bf16 tensor-core peak in TFLOP/s, by a part of torch.cuda.get_device_name(),
# from NVIDIA's data sheets. The first match wins, so the more specific names come first.
PEAK_BF16_TFLOPS = (
    ("H200", 989.0),  # also GH200: the same GPU die as the H100 SXM
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.0),  # SXM5, "NVIDIA H100 80GB HBM3"
    ("A100", 312.0),  # SXM4 and PCIe alike
)


@dataclass(frozen=True)
class Size:
    d_model: int
    n_heads: int
    n_kv_heads: int  # llama and mixtral (grouped-query attention)
    intermediate_size: int  # llama and mixtral (SwiGLU width)
    seq_len: int
    n_layers: int  # transformer blocks
    vocab_size: int
    hash_chunk: int  # hash attention's tile (must divide seq_len)
    long_seq_len: int  # LONG_CASES' sequence length; 0 = each case's own
    global_batch: int
    microbatches: int
    steps: int
    warmup: int  # first steps left out of the means (allocator, kernel selection, one-off set-up)
    dyn_start: int  # the step the cases' dynamism starts ...
    dyn_every: int  # ... and the steps between its changes


# Default: big enough that a GPU computes rather than waits on kernel launches (a dense block
# is 50M parameters; the largest cases, the 8-expert MoEs, have ~1.15B: ~18 GB of fp32
# weights, gradients and AdamW state).
GPU = Size(d_model=2048, n_heads=16, n_kv_heads=4, intermediate_size=5504, seq_len=2048, n_layers=4,
           vocab_size=2048, hash_chunk=64, long_seq_len=0, global_batch=8, microbatches=4, steps=12, warmup=2,
           dyn_start=3, dyn_every=3)
# --tiny: every mechanism, milliseconds per step on a CPU.
TINY = Size(d_model=64, n_heads=2, n_kv_heads=1, intermediate_size=176, seq_len=32, n_layers=4,
            vocab_size=512, hash_chunk=8, long_seq_len=64, global_batch=4, microbatches=2, steps=4, warmup=1,
            dyn_start=1, dyn_every=1)


class ArgError(Exception):
    """Bad command-line input: one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse prints usage and the message; we want one line
        raise ArgError(message)


# ---- what each run is ----------------------------------------------------------------------


def case_overrides(case: str, size: Size) -> list[str]:
    """The settings a case runs with that differ from its config: the size, and its dynamism
    moved into the short run."""
    cfg = load_config(ROOT / "configs" / CASES[case])
    m = cfg.model
    s = size
    seq_len = s.seq_len
    if case in LONG_CASES:
        _, long_len, block = LONG_CASES[case]
        seq_len = s.long_seq_len or long_len
        m = dataclasses.replace(m, block=block)
    out = ["--model.d_model", s.d_model, "--model.n_heads", s.n_heads, "--model.seq_len", seq_len,
           "--model.n_layers", s.n_layers, "--model.vocab_size", s.vocab_size,
           "--train.global_batch", s.global_batch, "--train.microbatches", s.microbatches, "--train.steps", s.steps]
    if m.family != "gpt":
        out += ["--model.n_kv_heads", s.n_kv_heads, "--model.intermediate_size", s.intermediate_size]
    if case in LONG_CASES:
        out += ["--model.block", m.block]
    if m.block == "hashattn":
        out += ["--model.hashattn.chunk", s.hash_chunk]
    if m.block == "mod" and m.mod.capacities:
        # The same profile over fewer blocks: block i takes the capacity of the config's block
        # at the same relative depth (full first half, 12.5 % second half stays so).
        caps = m.mod.capacities
        out += ["--model.mod.capacities", ";".join(str(caps[i * len(caps) // s.n_layers]) for i in range(s.n_layers))]
    start, every = s.dyn_start, s.dyn_every
    if cfg.prune.enabled:  # two pruning steps, to the config's final sparsity
        out += ["--prune.start_step", start, "--prune.every", every, "--prune.times", 2]
    if cfg.freeze.enabled:  # every block counts as converged: one freezes per check
        out += ["--freeze.start_step", start, "--freeze.every", every, "--freeze.tolerance", 1e9,
                "--freeze.max_frozen", -1]
    if cfg.early_exit.enabled:  # untrained exit classifiers sit near 0.5: let tokens exit
        out += ["--early_exit.start_step", start, "--early_exit.threshold", 0.5]
    if cfg.skew.factor > 1:
        out += ["--skew.start_step", start]
    return [str(x) for x in out]


@dataclass
class Run:
    name: str  # CASE-STAGING
    case: str
    staging: str
    argv: list[str]  # dynmo.train's arguments
    log: str  # console output


def plan_runs(cases: list[str], size: Size, device: str, dtype: str, out: Path, compile_units: bool = False,
              cuda_graphs: bool = False) -> list[Run]:
    backend = "nccl" if device == "cuda" else "gloo"
    runs = []
    for case in cases:
        for staging, (_, stage_args) in STAGINGS.items():
            name = f"{case}-{staging}"
            argv = ["--config", str(ROOT / "configs" / CASES[case]), "--out", str(out / "runs" / name),
                    "--overwrite", "true", "--log.trace", str(out / "traces" / f"{name}.trace.jsonl"),
                    "--log.tensorboard", "false", "--log.progress", "false", "--train.eval_every", "0",
                    "--train.dtype", dtype, "--parallel.backend", backend, "--parallel.layout", "uniform",
                    *case_overrides(case, size), *stage_args]
            if compile_units or cuda_graphs:
                argv += ["--train.compile", "true"]
            if cuda_graphs:
                argv += ["--train.cuda_graphs", "true"]
            runs.append(Run(name, case, staging, argv, str(out / "logs" / f"{name}.log")))
    return runs


# ---- the worker: every run in one process ----------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def console_to(path: str):
    """Send this process's stdout and stderr (file descriptors 1 and 2, so torch's C++ output
    too) to a file for the duration."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    try:
        with open(path, "w") as f:
            os.dup2(f.fileno(), 1)
            os.dup2(f.fileno(), 2)
            try:
                yield
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os.dup2(saved[0], 1)
                os.dup2(saved[1], 2)
    finally:
        os.close(saved[0])
        os.close(saved[1])


def append_json(path: Path, obj: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(obj) + "\n")
        f.flush()
        os.fsync(f.fileno())  # the parent reads it after a crash


def worker(plan_file: str) -> int:
    plan = json.loads(Path(plan_file).read_text())
    results = Path(plan["results"])
    # A single-process torch.distributed job: what torchrun would set for one rank.
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
    import torch

    from dynmo import train

    cuda = plan["device"] == "cuda"
    device = torch.cuda.get_device_name(0) if cuda else "cpu"
    print(f"gpu_check: worker on {device}, torch {torch.__version__}", file=sys.stderr, flush=True)
    for k, run in enumerate(plan["runs"], 1):
        Path(run["log"]).parent.mkdir(parents=True, exist_ok=True)
        append_json(results, {"run": run["name"], "event": "start"})
        os.environ["MASTER_PORT"] = str(free_port())  # a fresh store per run: nothing left from the last
        t0 = time.perf_counter()
        with console_to(run["log"]):
            try:
                status = int(train.main(run["argv"]) or 0)
            except SystemExit as e:  # argparse inside the trainer
                status = e.code if isinstance(e.code, int) else 2
        seconds = time.perf_counter() - t0
        gc.collect()  # the finished run's model and optimizer, before the next one allocates
        end = {"run": run["name"], "event": "end", "status": status, "seconds": seconds, "device": device,
               "torch": torch.__version__}
        if cuda:
            torch.cuda.empty_cache()
            # What the run left allocated: 0 unless something outlives it, which would also sit
            # in the next runs' measured peaks (the report shows it).
            end["allocated_after_bytes"] = torch.cuda.memory_allocated()
        append_json(results, end)
        line = "ok" if status == 0 else f"FAILED (exit {status}): {last_error(run['log'])}"
        print(f"[{plan['offset'] + k}/{plan['total']}] {run['name']}: {line} ({seconds:.1f} s)", file=sys.stderr,
              flush=True)
    return 0


def last_error(log: str) -> str:
    """The failed run's one-line reason (dynmo's workers end with `dynmo: error: ...`)."""
    try:
        lines = [ln for ln in Path(log).read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return "no log"
    errors = [ln for ln in lines if ln.startswith("dynmo: error:")]
    return (errors or lines or ["no output"])[-1][:300]


def run_all(runs: list[Run], device: str, out: Path) -> dict[str, dict]:
    """Every run, through as many workers as it takes: name -> its result."""
    results = out / "results.jsonl"
    results.unlink(missing_ok=True)
    done: dict[str, dict] = {}
    while True:
        todo = [r for r in runs if r.name not in done]
        if not todo:
            return done
        plan = out / "plan.json"
        plan.write_text(json.dumps({"device": device, "results": str(results), "offset": len(runs) - len(todo),
                                    "total": len(runs), "runs": [asdict(r) for r in todo]}, indent=1))
        env = dict(os.environ)
        if device == "cpu":
            # One thread: the tiny model's ops are too small to share out, and on a shared machine
            # threads that spin waiting for each other made each tiny run 10-30x slower here.
            env.setdefault("OMP_NUM_THREADS", "1")
        p = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--worker", str(plan)], cwd=ROOT, env=env)
        started = set()
        for line in results.read_text().splitlines() if results.exists() else []:
            rec = json.loads(line)
            if rec["event"] == "end":
                done[rec["run"]] = rec
            else:
                started.add(rec["run"])
        dead = [r for r in todo if r.name in started and r.name not in done]
        if dead:  # the worker died inside this run; a new one takes the rest
            done[dead[0].name] = {"run": dead[0].name, "status": p.returncode, "crashed": True}
            print(f"[{len(done)}/{len(runs)}] {dead[0].name}: CRASHED (worker exit {p.returncode}); "
                  f"continuing in a new worker", file=sys.stderr, flush=True)
        elif not any(r.name in done for r in todo):
            raise RuntimeError(f"the worker exited ({p.returncode}) before its first run; its output is above")


# ---- the report --------------------------------------------------------------------------------


def peak_tflops(device: str) -> float | None:
    return next((tf for part, tf in PEAK_BF16_TFLOPS if part in device), None)


def mean(xs: list[float]) -> float | None:
    return statistics.fmean(xs) if xs else None


def summarize_run(run: Run, result: dict, size: Size, out: Path, peak: float | None) -> dict:
    """One row of the report from the run's metrics, summary, config and trace."""
    from dynmo.sim.trace import TraceError, load_trace

    folder = out / "runs" / run.name
    trace_file = out / "traces" / f"{run.name}.trace.jsonl"
    row = {"run": run.name, "case": run.case, "config": f"configs/{CASES[run.case]}", "staging": run.staging,
           "stages": STAGINGS[run.staging][0], "status": result.get("status"), "crashed": result.get("crashed", False),
           "seconds": result.get("seconds"), "device": result.get("device"), "torch": result.get("torch"),
           "allocated_after_bytes": result.get("allocated_after_bytes"),
           "overrides": case_overrides(run.case, size), "log": str(Path(run.log).relative_to(out))}
    if row["status"] != 0:
        row["error"] = last_error(run.log)
        return row
    recs = [json.loads(ln) for ln in (folder / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    measured = [r for r in recs if r["step"] >= size.warmup] or recs
    cfg = load_config(folder / "config.toml")
    try:
        trace = load_trace(trace_file)
        layers, trace_steps, trace_error = trace.header.layers, len(trace.steps), None
    except (OSError, TraceError) as e:
        layers, trace_steps, trace_error = [f"layer{i}" for i in range(len(recs[0]["layer_fwd_s"]))], 0, str(e)
    n = len(layers)
    peaks = [r["worker_peak_memory_bytes"][0] for r in measured if r.get("worker_peak_memory_bytes")]
    # every stage is on this one worker: its estimate is their sum
    estimate = max((sum(r["stage_memory_bytes"]) for r in measured if r.get("stage_memory_bytes")), default=None)
    tokens_per_s = mean([r["tokens_per_s"] for r in measured])
    flops = 3 * forward_flops_per_token(cfg.model)  # training: backward = 2 x forward
    achieved = tokens_per_s * flops / 1e12
    row.update(
        steps=len(recs), measured_steps=[measured[0]["step"], measured[-1]["step"]], layers=layers,
        layer_fwd_ms=[1e3 * statistics.fmean(r["layer_fwd_s"][i] for r in measured) for i in range(n)],
        layer_bwd_ms=[1e3 * statistics.fmean(r["layer_bwd_s"][i] for r in measured) for i in range(n)],
        tokens_per_s=tokens_per_s, step_s=mean([r["step_s"] for r in measured]),
        peak_memory_bytes=max(peaks) if peaks and max(peaks) > 0 else None, estimated_memory_bytes=estimate,
        train_flops_per_token=flops, model_tflops=achieved, mfu=achieved / peak if peak else None,
        first_loss=recs[0]["loss"], last_loss=recs[-1]["loss"],
        layouts=list(dict.fromkeys(r["layout_str"] for r in recs)),
        migrations=sum(e.get("type") == "migration" for r in recs for e in r.get("events", [])),
        dynamism_events=sum(e.get("type") == "dynamism" for r in recs for e in r.get("events", [])),
        trace=str(trace_file.relative_to(out)), trace_steps=trace_steps, trace_error=trace_error,
    )
    if row["peak_memory_bytes"] and estimate and row["device"] != "cpu":  # a CPU's figure is the process's RSS
        row["measured_over_estimate"] = row["peak_memory_bytes"] / estimate
    return row


def fmt(x, spec: str = ".1f", none: str = "—") -> str:
    return none if x is None else format(x, spec)


def cell(layout: str) -> str:
    """A layout (`E t t | t t L`) as code in a table cell: its stage bars escaped."""
    return "`" + layout.replace("|", "\\|") + "`"


def mb(x) -> str:
    return "—" if x is None else f"{x / 2**20:,.0f}"


def render(meta: dict, rows: list[dict]) -> str:
    cuda = meta["device_kind"] == "cuda"
    lines = [
        "# dynmo GPU check", "",
        f"- date: {meta['date']}",
        f"- device: {meta['device']}, torch {meta['torch']}, dtype {meta['dtype']}",
        f"- size: {meta['size_name']} ({', '.join(f'{k} {v}' for k, v in meta['size'].items())})",
        f"- peak dense bf16: {meta['peak_tflops']:.0f} TFLOP/s" if meta["peak_tflops"] else
        "- MFU omitted: "
        + ("the device's peak is not in PEAK_BF16_TFLOPS (--peak-tflops gives it)" if cuda else "a CPU"),
        f"- command: `{meta['command']}`",
        f"- runs: {sum(r['status'] == 0 for r in rows)} of {len(rows)} ok", "",
        f"Means over the steps from step {meta['size']['warmup']} on (the ones before pay one-off set-up). "
        "Peak memory measured: " + ("`torch.cuda.max_memory_allocated` (tensors), reset every step, the largest;"
                                     if cuda else "the worker process's peak resident set (libraries, data and "
                                     "what earlier runs in the same process left resident included: an upper "
                                     "bound on the tensors, not comparable with the estimate);")
        + " estimated: the balancer's `stage_memory_bytes` summed over the stages (all on one device).", ""]
    leaks = [r for r in rows if r.get("allocated_after_bytes")]
    if leaks:
        lines += ["Left allocated after the run (would also count in the later runs' peaks): "
                  + ", ".join(f"{r['run']} {mb(r['allocated_after_bytes'])} MiB" for r in leaks), ""]
    lines += [
        "| run | status | s | tokens/s | model TFLOP/s | MFU | peak MiB measured | MiB estimated | measured / est. "
        "| layouts | migrations | dynamism events | loss first → last |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---|",
    ]
    for r in rows:
        if r["status"] != 0:
            what = "crashed" if r["crashed"] else f"failed ({r['status']})"
            why = r.get("error", "").replace("|", "\\|")
            lines.append(f"| {r['run']} | {what}: {why} | {fmt(r['seconds'])} |" + " |" * 10)
            continue
        lines.append(
            f"| {r['run']} | ok | {fmt(r['seconds'])} | {fmt(r['tokens_per_s'], ',.0f')} "
            f"| {fmt(r['model_tflops'], '.3g')} | {fmt(r['mfu'], '.1%')} "
            f"| {mb(r['peak_memory_bytes'])} | {mb(r['estimated_memory_bytes'])} "
            f"| {fmt(r.get('measured_over_estimate'), '.2f')} | {' → '.join(cell(x) for x in r['layouts'])} "
            f"| {r['migrations']} | {r['dynamism_events']} | {r['first_loss']:.3f} → {r['last_loss']:.3f} |")
    lines += ["", "## Per-layer times", "",
              "Milliseconds of one microbatch (mean over the measured steps); backward includes any "
              "recomputation and a zero-bubble weight-gradient share.", ""]
    for r in rows:
        if r["status"] != 0:
            continue
        trace_note = f", trace `{r['trace']}` ({r['trace_steps']} steps)" if not r["trace_error"] else \
            f", trace unreadable: {r['trace_error']}"
        lines += [f"### {r['run']}", "",
                  f"`{r['config']}`, settings changed: `{' '.join(r['overrides'])}`{trace_note}", "",
                  "| layer | " + " | ".join(r["layers"]) + " |", "|---" * (len(r["layers"]) + 1) + "|",
                  "| forward | " + " | ".join(fmt(x, ".3f") for x in r["layer_fwd_ms"]) + " |",
                  "| backward | " + " | ".join(fmt(x, ".3f") for x in r["layer_bwd_ms"]) + " |", ""]
    lines += ["## How the figures are made", "",
              "- Model FLOPs per token: `dynmo.flops.forward_flops_per_token` (the "
              "model's nominal matmuls, causal attention, x 3 for training); model TFLOP/s = tokens/s x that; "
              "MFU = model TFLOP/s / the dense bf16 peak.",
              "- Per-layer times and memory come from the run's metrics.jsonl (docs/metrics.md).", ""]
    return "\n".join(lines)


# ---- command line ------------------------------------------------------------------------------


def parse(argv: list[str]) -> argparse.Namespace:
    ap = _Parser(prog="gpu_check.py", description=__doc__.splitlines()[0])
    ap.add_argument("--out", metavar="DIR", help="folder for the report, traces, run folders and logs (required)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                    help="cuda (NCCL, one GPU: the first visible; default) or cpu (gloo)")
    ap.add_argument("--tiny", action="store_true", help="a tiny model and 4 steps (a CPU finishes in seconds per run)")
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, from: {', '.join(CASES)} (default all)")
    ap.add_argument("--stagings", default=",".join(STAGINGS), help="comma-separated: 1stage, 2stage (default both)")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"], help="train.dtype (default bf16)")
    ap.add_argument("--compile", action="store_true", help="every run with --train.compile true (units compiled)")
    ap.add_argument("--cuda-graphs", action="store_true",
                    help="every run with --train.cuda_graphs true (compiled units replayed as CUDA graphs)")
    ap.add_argument("--steps", type=int, default=None, help="steps per run (default 12; --tiny 4)")
    ap.add_argument("--peak-tflops", type=float, default=None,
                    help="the device's dense peak TFLOP/s for the MFU, when it is not in the table")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return args
    if not args.out:
        raise ArgError("--out DIR is required")
    if Path(args.out).exists() and not Path(args.out).is_dir():
        raise ArgError(f"--out {args.out!r} is a file; give a folder")
    args.cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [c for c in args.cases if c not in CASES]
    if unknown or not args.cases:
        raise ArgError(f"unknown case(s) {', '.join(unknown) or '(none given)'}; choose from {', '.join(CASES)}")
    args.stagings = [s.strip() for s in args.stagings.split(",") if s.strip()]
    if not args.stagings or any(s not in STAGINGS for s in args.stagings):
        raise ArgError(f"--stagings {','.join(args.stagings)!r}: choose from {', '.join(STAGINGS)}")
    size = TINY if args.tiny else GPU
    if args.steps is not None:
        if args.steps <= size.warmup:
            raise ArgError(f"--steps must be > {size.warmup} (the first {size.warmup} are left out of the means)")
        size = Size(**{**asdict(size), "steps": args.steps})
    args.size = size
    if args.peak_tflops is not None and not args.peak_tflops > 0:
        raise ArgError("--peak-tflops must be > 0")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ArgError("--device cuda: no CUDA device is visible to torch here; "
                           "run on a GPU machine or pass --device cpu")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        args = parse(argv)
        if not args.worker:
            for case in args.cases:  # a config that does not load is bad input, before anything runs
                case_overrides(case, args.size)
    except (ArgError, ConfigError) as e:
        print(f"gpu_check: error: {e}", file=sys.stderr)
        return 2
    if args.worker:
        return worker(args.worker)
    out = Path(args.out)
    for sub in ("runs", "traces", "logs"):
        (out / sub).mkdir(parents=True, exist_ok=True)
    runs = [r for r in plan_runs(args.cases, args.size, args.device, args.dtype, out, args.compile, args.cuda_graphs)
            if r.staging in args.stagings]
    size_name = "tiny" if args.tiny else "default"
    print(f"gpu_check: {len(runs)} runs ({len(args.cases)} cases x {', '.join(args.stagings)}), {size_name} size, "
          f"{args.dtype} on {args.device}; logs in {out / 'logs'}", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    try:
        results = run_all(runs, args.device, out)
    except RuntimeError as e:
        print(f"gpu_check: error: {e}", file=sys.stderr)
        return 1
    device = next((r["device"] for r in results.values() if r.get("device")), args.device)
    peak = args.peak_tflops or (peak_tflops(device) if args.device == "cuda" else None)
    rows = [summarize_run(r, results[r.name], args.size, out, peak) for r in runs]
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "device_kind": args.device, "device": device,
        "torch": next((r["torch"] for r in results.values() if r.get("torch")), None),
        "dtype": args.dtype, "size_name": size_name, "size": asdict(args.size), "peak_tflops": peak,
        "command": " ".join(["python", "benchmarks/gpu_check.py", *argv]), "wall_s": time.perf_counter() - t0,
    }
    (out / "report.json").write_text(json.dumps({"meta": meta, "runs": rows}, indent=1) + "\n")
    (out / "report.md").write_text(render(meta, rows))
    ok = sum(r["status"] == 0 for r in rows)
    print(f"gpu_check: {ok} of {len(rows)} runs ok in {meta['wall_s']:.0f} s; report in {out / 'report.md'}",
          file=sys.stderr)
    return 0 if ok == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
