"""`dynmo simulate --input stages.json`: stage times in, iteration time and bubbles out (JSON).

stages.json (see docs/simulator.md):
    {"schedule": "1F1B", "microbatches": 8,
     "fwd": [0.010, 0.012], "bwd": [0.020, 0.025],     # seconds, per stage (or per stage per mb)
     "wgrad": [...],                                   # optional, zero-bubble schedules
     "comm": 0.001,                                    # optional: number, per link, {"fwd","bwd"}
     "stages_per_rank": 2,                             # optional, multi-stage schedules
     "dp": 30, "grad_bytes": [...], "bandwidth": 1e10, "latency": 1e-5,   # optional
     "allreduce": [...], "allreduce_mode": "overlap",  # optional
     "p2p": "eager"}                                   # optional: or "rendezvous"
"""

from __future__ import annotations

import argparse
import json
import sys

from dynmo.jsonio import read_json

from dynmo.sim.engine import ALLREDUCE_MODES, P2P_MODES, SimInputError, simulate
from dynmo.sim.schedules import SCHEDULES, ScheduleError

KEYS = {
    "schedule", "microbatches", "fwd", "bwd", "wgrad", "comm", "stages_per_rank", "dp",
    "allreduce", "grad_bytes", "bandwidth", "latency", "allreduce_mode", "p2p",
}


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="dynmo simulate",
        description="Simulate one training iteration of a pipeline schedule from per-stage times "
        "and print JSON: iteration_time, bubble_ratio (split into bubble_inherent and "
        "bubble_imbalance), per-rank busy_s / idle_s.",
    )
    ap.add_argument("--input", required=True, help="stages.json path, or - for stdin")
    ap.add_argument("--schedule", help=f"override the file's schedule ({', '.join(SCHEDULES)})")
    ap.add_argument("--microbatches", type=int, help="override the file's microbatches")
    ap.add_argument("--dp", type=int, help="override the number of data-parallel replicas")
    ap.add_argument("--allreduce-mode", choices=ALLREDUCE_MODES, help="override allreduce_mode")
    ap.add_argument("--p2p", choices=P2P_MODES, help="override the transfer model (default eager)")
    ap.add_argument("--trace", action="store_true", help="include every op's start and end")
    ap.add_argument("--indent", type=int, default=2, help="JSON indent (0: one line)")
    return ap


def run(spec: dict, trace: bool = False) -> dict:
    """Simulate a stages.json document (already parsed); return the output document."""
    if not isinstance(spec, dict):
        raise SimInputError("the input must be a JSON object with at least fwd and bwd")
    unknown = set(spec) - KEYS
    if unknown:
        raise SimInputError(f"unknown keys {sorted(unknown)}; known keys: {sorted(KEYS)}")
    for key in ("fwd", "bwd"):
        if key not in spec:
            raise SimInputError(f"missing {key!r}: a list of per-stage times in seconds")
    res = simulate(
        spec["fwd"],
        spec["bwd"],
        spec.get("schedule", "1F1B"),
        spec.get("microbatches"),
        wgrad=spec.get("wgrad"),
        comm=spec.get("comm", 0.0),
        stages_per_rank=spec.get("stages_per_rank"),
        dp=spec.get("dp", 1),
        allreduce=spec.get("allreduce"),
        grad_bytes=spec.get("grad_bytes"),
        bandwidth=spec.get("bandwidth"),
        latency=spec.get("latency", 0.0),
        allreduce_mode=spec.get("allreduce_mode", "overlap"),
        p2p=spec.get("p2p", "eager"),
        keep_trace=trace,
    )
    return res.as_dict()


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        spec = read_json(args.input)
    except ValueError as e:
        print(f"dynmo simulate: {e}", file=sys.stderr)
        return 2
    if isinstance(spec, dict):
        for key, val in (("schedule", args.schedule), ("microbatches", args.microbatches),
                         ("dp", args.dp), ("allreduce_mode", args.allreduce_mode),
                         ("p2p", args.p2p)):
            if val is not None:
                spec[key] = val
    try:
        out = run(spec, trace=args.trace)
    except (SimInputError, ScheduleError) as e:
        print(f"dynmo simulate: {e}", file=sys.stderr)
        return 2
    print(json.dumps(out, indent=args.indent or None))
    return 0


if __name__ == "__main__":
    sys.exit(main())
