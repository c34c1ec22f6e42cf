"""`--train.compile true` against eager, whole models through the launcher: no graph break, the
same losses.

    python benchmarks/compile_check.py [--backend inductor|aot_eager|eager] [--steps 6]
        [--cases gpt-dense,gpt-moe,...]

For each case, `dynmo train --nproc 1` of its config twice, eager and with `--train.compile
true --train.compile_backend BACKEND`, with `TORCH_LOGS=graph_breaks` (torch logs every graph
break it takes); prints per case the graph breaks logged, the largest relative difference of
the per-step losses and whether it is within --rtol. MoE cases train in bf16 (torch compiles its
grouped expert matmul in bf16 only); bf16 losses are compared at the bf16 tolerance. Exit 1 if
any case breaks a graph or misses its tolerance. Where CUDA is present the runs use it (as
`dynmo train` does): there it is the check to run after a change to any block.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from paired_runs import train_run

CASES = {
    "gpt-dense": ("configs/default.toml", []),
    "gpt-moe": ("configs/moe.toml", ["--train.dtype", "bf16"]),
    "gpt-mod": ("configs/mod.toml", []),
    "gpt-hashattn": ("configs/hashattn.toml", []),
    "gpt-earlyexit": ("configs/earlyexit.toml", ["--early_exit.start_step", "1", "--early_exit.threshold", "0.5"]),
    "llama": ("configs/llama.toml", []),
    "mixtral": ("configs/mixtral.toml", ["--train.dtype", "bf16"]),
}


def run(config: str, extra: list[str], steps: int, out: Path) -> tuple[list[float], int]:
    """(per-step losses, graph breaks logged) of one run."""
    r = train_run(config, ["--balance.when", "never", *extra], steps, out, env={"TORCH_LOGS": "graph_breaks"})
    return r["losses"], r["stderr"].count("Graph break")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", choices=("inductor", "aot_eager", "eager"), default="inductor")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    ap.add_argument("--rtol", type=float, default=1e-4, help="fp32 losses (bf16: 2e-2)")
    args = ap.parse_args(argv)
    unknown = [c for c in args.cases.split(",") if c not in CASES]
    if unknown:
        print(f"compile_check: unknown case(s) {', '.join(unknown)}; choose from {', '.join(CASES)}", file=sys.stderr)
        return 2
    print(f"backend {args.backend}, {args.steps} steps, dynmo train --nproc 1 --balance.when never")
    print("| case | graph breaks | largest relative loss difference | tolerance | ok |")
    print("| --- | --- | --- | --- | --- |")
    bad = 0
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.cases.split(","):
            config, extra = CASES[name]
            ref, _ = run(config, extra, args.steps, Path(tmp) / f"{name}-eager")
            got, breaks = run(config, [*extra, "--train.compile", "true", "--train.compile_backend", args.backend],
                              args.steps, Path(tmp) / f"{name}-compiled")
            diff = max(abs(a - b) / max(abs(a), 1e-12) for a, b in zip(ref, got))
            tol = 2e-2 if "bf16" in extra else args.rtol
            ok = breaks == 0 and diff <= tol and len(ref) == len(got)
            bad += not ok
            print(f"| {name} | {breaks} | {diff:.2e} | {tol:g} | {'yes' if ok else 'NO'} |", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
