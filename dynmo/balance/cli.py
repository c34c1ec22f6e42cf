"""`dynmo balance --input problem.json [--balancer NAME] [--repack] [--tolerance X]`

Reads a problem (keys: costs, stages; optional memory, capacity, speeds, transfer, current)
and prints one JSON object: balancer, boundaries, stage_loads, bottleneck, imbalance, moves,
released, seconds (and workers, stage_memory, contiguous). Errors: one line, exit code 1.
With --repack, --balancer picks the re-packing method: optimal (default) or firstfit.
"""

from __future__ import annotations

import argparse
import json
import sys

from dynmo.jsonio import read_json

from . import BALANCERS, REPACKERS, BalanceError, Problem, balance, repack


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="dynmo balance", description=__doc__.split("\n\n")[1])
    ap.add_argument("--input", required=True, help="problem JSON file ('-' for stdin)")
    ap.add_argument("--balancer", default="optimal",
                    help=f"one of {', '.join(BALANCERS)}; with --repack: {', '.join(REPACKERS)}")
    ap.add_argument("--repack", action="store_true", help="pack onto fewer workers, report released ones")
    ap.add_argument("--tolerance", type=float, default=0.05,
                    help="re-packing: allowed bottleneck growth over all workers (default 0.05)")
    ap.add_argument("--target", type=int, default=None, help="firstfit re-packing: workers to keep")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        data = read_json(args.input)
    except ValueError as e:
        print(f"dynmo balance: {e}", file=sys.stderr)
        return 1
    try:
        problem = Problem.from_dict(data)
        if args.repack:
            if args.balancer not in REPACKERS:
                raise BalanceError(f"--repack takes --balancer {' or '.join(REPACKERS)}, got {args.balancer!r}")
            result = repack(problem, tolerance=args.tolerance, method=args.balancer, target=args.target)
        else:
            result = balance(problem, args.balancer)
    except (BalanceError, TypeError) as e:
        msg = str(e).replace("\n", " ")
        print(f"dynmo balance: {msg}", file=sys.stderr)
        return 1
    print(json.dumps(result.as_dict()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
