"""Expert placement under expert parallelism, replayed: static against dynmo against the oracle.

Produces the tables in docs/bench/simulator-expert-placement.md (linked from docs/simulator.md,
"Expert placement"); tests/test_sim_experts.py imports it.

    python benchmarks/replay_experts.py [TRACE.jsonl ...] [--ep 2,4,8] [--blocks 32 --stages 16 --dp 8
        --microbatches 64] [--layouts fixed|dynmo] [--extra-slots S --copies C] [--a2a-bandwidth B]
        [--seed N] [--json]

Each trace (default: the committed `moe` and `mixtral` traces, docs/bench/traces/) is scaled to
--blocks blocks and replayed by `dynmo.sim.replay.expert_policies.replay_experts` at every EP
degree in --ep (`dynmo.sim.replay.experts` says what is modelled, `expert_policies` each policy):
with `--layouts fixed` (the default) the layer layout held fixed and each MoE layer's experts
placed by

  static     index order, N / E per rank;
  dynmo      the trainer's `balance.experts = "auto"` on the replayed steps, with its defaults
             (a look every 5 steps, evidence over 10, 1 % margin, repaid over 50 steps), scored
             by the simulated step time of the layout;
  oracle     each step's best placement for its own loads, moves free (copies with --copies);

with `--layouts dynmo`, one decision for both: static on the best static layer layout in
hindsight, dynmo deciding the layer layout too (`balance.when = "auto"`, from the FLOP model's
layout) and the oracle each step's best layout and placements; one more column, dynmo's
speedup over its start left static (static placement on the FLOP model's layout).

Columns: total seconds of static; each policy's speedup over static (total time, moves
included); `capture`, the share of the oracle's gain over static that dynmo gets,
(speedup - 1) / (oracle's speedup - 1), blank where the oracle gains under 0.5 %; dynmo's expert
re-placements and layer migrations; the mean over steps and MoE layers of the busiest EP rank's
load over the mean rank's, under static, dynmo and the oracle (1 = perfectly even). `--json`
prints every figure and the per-step series instead.

Bad input (a trace without `moe_tokens_per_expert`, an EP degree that does not divide the
expert count or dp) ends in one line on stderr and exit code 2. Pure; no torch.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from dynmo.balance import BalanceError
from dynmo.engine import SimInputError
from dynmo.sim.replay.expert_policies import LAYOUTS, replay_experts
from dynmo.sim.replay.expert_render import split_line, table_lines
from dynmo.sim.replay.experts import ExpertOptions
from dynmo.sim.trace import TraceError, load_trace, scale_trace

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_TRACES = [ROOT / "docs/bench/traces/moe-static.jsonl", ROOT / "docs/bench/traces/mixtral-static.jsonl"]


def _eps(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--ep takes integers separated by commas, got {text!r}") from None
    if not out or any(e < 1 for e in out):
        raise argparse.ArgumentTypeError(f"--ep takes integers >= 1, got {text!r}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="replay_experts.py", description=__doc__.splitlines()[0])
    ap.add_argument("traces", nargs="*", type=Path, help="MoE traces (default: the committed moe and mixtral ones)")
    ap.add_argument("--ep", type=_eps, default=[8], help="EP degrees, e.g. 2,4,8 (default 8)")
    ap.add_argument("--blocks", type=int, default=32)
    ap.add_argument("--stages", type=int, default=16)
    ap.add_argument("--dp", type=int, default=8)
    ap.add_argument("--microbatches", type=int, default=64)
    ap.add_argument("--extra-slots", type=int, default=0)
    ap.add_argument("--copies", type=int, default=0)
    ap.add_argument("--a2a-bandwidth", type=float, default=ExpertOptions.a2a_bandwidth)
    ap.add_argument("--split", choices=("fit", "flops"), default="fit")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layouts", choices=LAYOUTS, default="fixed",
                    help="fixed: the layer layout held; dynmo: decided with the placements")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    traces = args.traces or DEFAULT_TRACES
    opts = ExpertOptions(microbatches=args.microbatches, extra_slots=args.extra_slots, copies=args.copies,
                         a2a_bandwidth=args.a2a_bandwidth, split=args.split, seed=args.seed)
    rows = []
    try:
        opts.check()
        if args.blocks < 1:
            raise SimInputError(f"--blocks must be >= 1, got {args.blocks}")
        loaded = [(p, scale_trace(load_trace(p), args.blocks)) for p in traces]
        for path, trace in loaded:
            for ep in args.ep:
                t0 = time.perf_counter()
                out = replay_experts(trace, args.stages, args.dp, ep, opts, layouts=args.layouts)
                rows.append((path, ep, out))
                print(f"replay_experts: {path.stem} ep {ep} in {time.perf_counter() - t0:.0f} s", file=sys.stderr,
                      flush=True)
    except (SimInputError, TraceError, BalanceError, ValueError, OSError) as e:
        print(f"replay_experts: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        json.dump([{"trace": str(p), "ep": ep, **out.as_dict()} for p, ep, out in rows], sys.stdout, allow_nan=False)
        print()
        return 0
    cmd = " ".join(["python benchmarks/replay_experts.py", *(str(p) for p in args.traces),
                    "--ep", ",".join(map(str, args.ep)), "--blocks", str(args.blocks), "--stages", str(args.stages),
                    "--dp", str(args.dp), "--microbatches", str(args.microbatches),
                    *(["--extra-slots", str(args.extra_slots), "--copies", str(args.copies)] if args.copies or args.extra_slots else []),
                    *([] if args.a2a_bandwidth == ExpertOptions.a2a_bandwidth else ["--a2a-bandwidth", str(args.a2a_bandwidth)]),
                    *([] if args.layouts == "fixed" else ["--layouts", args.layouts]),
                    *([] if args.seed == 0 else ["--seed", str(args.seed)])])
    print(cmd + "\n")
    for line in table_lines([(p.stem, ep, out) for p, ep, out in rows]):
        print(line)
    if rows:
        print()
        for path, ep, out in rows:
            if ep == rows[0][1]:
                print(split_line(path.stem, out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
