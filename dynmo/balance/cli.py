"""`dynmo balance --input problem.json [--balancer NAME] [--repack] [--tolerance X]`

Reads a problem (keys: costs, stages; optional memory, capacity, speeds, transfer, transfer_back,
current, cut_factor)
and prints one JSON object: balancer, boundaries, stage_loads, bottleneck, imbalance, moves,
released, seconds (and workers, stage_memory, contiguous). Bad input (including a problem
beyond the limits below, or an infeasible one): one line `dynmo balance: error: ...` on
stderr, exit code 2. With --repack, --balancer picks the re-packing method: optimal
(default) or firstfit.
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from typing import Any

import numpy as np

from dynmo.jsonio import (
    ArgumentParser, InputError, NonFiniteError, dumps, fail, integer, number, parse_args, read_json,
)

from . import BALANCERS, REPACKERS, BalanceError, Problem, balance, repack
from .static import check_deepspeed_size

PROG = "dynmo balance"

# Limits on what one call may ask for (docs/balancers.md, "Limits"). The worst problem they
# allow (one layer as costly as all others, which widens optimal's fewest-moves step to
# ~layers x stages entries) takes ~30 s and ~0.5 GB; every other balancer is faster.
MAX_LAYERS = 100_000
MAX_STAGES = 4_096
MAX_LAYER_STAGES = 50_000_000  # layers x stages
# with cut_factor optimal's dynamic programs read up to layers^2 x stages cells (cuts.py): ~30 s
MAX_CUT_CELLS = 1_000_000_000


EXAMPLES = """\
examples:
  echo '{"costs": [1, 4, 4, 4, 1, 1, 1, 2], "stages": 3}' | dynmo balance --input -
  dynmo balance --input problem.json --balancer deepspeed
  dynmo balance --input problem.json --repack --tolerance 0.1
"""


def _parser() -> ArgumentParser:
    ap = ArgumentParser(prog=PROG, description=textwrap.fill(" ".join(__doc__.split("\n\n")[1].split()), 78),
                        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--input", required=True, help="problem JSON file ('-' for stdin)")
    ap.add_argument("--balancer", default="optimal",
                    help=f"one of {', '.join(BALANCERS)}; with --repack: {', '.join(REPACKERS)}")
    ap.add_argument("--repack", action="store_true", help="pack onto fewer workers, report released ones")
    ap.add_argument("--tolerance", type=float, default=0.05,
                    help="re-packing: allowed bottleneck growth over all workers (default 0.05)")
    ap.add_argument("--target", type=int, default=None, help="firstfit re-packing: workers to keep")
    return ap


def check_size(data: Any, balancer: str) -> None:
    """Refuse a problem beyond the limits before any work (InputError naming the limit)."""
    if not isinstance(data, dict):
        raise InputError("problem JSON must be an object with keys costs, stages, ...")
    costs = data.get("costs")
    n = len(costs) if isinstance(costs, list) else None
    if n is not None and n > MAX_LAYERS:
        raise InputError(f"costs has {n} layers, over the limit MAX_LAYERS = {MAX_LAYERS}; "
                         "merge layers into fewer, larger ones")
    if "stages" not in data:
        return
    p = integer("stages", data["stages"], 1, MAX_STAGES, limit="MAX_STAGES")
    if n is not None and n * p > MAX_LAYER_STAGES:
        raise InputError(f"{n} layers x {p} stages = {n * p} is over the limit MAX_LAYER_STAGES = "
                         f"{MAX_LAYER_STAGES}; use fewer stages or merge layers")
    if n is not None and data.get("cut_factor") is not None and n * n * p > MAX_CUT_CELLS:
        raise InputError(f"{n} layers^2 x {p} stages = {n * n * p} with cut_factor is over the limit "
                         f"MAX_CUT_CELLS = {MAX_CUT_CELLS}; use fewer stages or merge layers")
    if n is not None and balancer == "deepspeed":
        check_deepspeed_size(n, p)


def _check_args(args) -> None:
    if args.repack:
        if args.balancer not in REPACKERS:
            raise InputError(f"--repack takes --balancer {' or '.join(REPACKERS)}, got {args.balancer!r}")
    elif args.balancer not in BALANCERS:
        raise InputError(f"unknown balancer {args.balancer!r}; choose one of {', '.join(BALANCERS)}")
    number("--tolerance", args.tolerance)
    if args.target is not None:
        if not (args.repack and args.balancer == "firstfit"):
            raise InputError("--target is for --repack --balancer firstfit only")
        integer("--target", args.target, 1)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(_parser(), argv)
    if isinstance(args, int):
        return args
    try:
        _check_args(args)
        data = read_json(args.input)
        check_size(data, args.balancer)
        problem = Problem.from_dict(data)
        with np.errstate(all="ignore"):
            if args.repack:
                result = repack(problem, tolerance=args.tolerance, method=args.balancer, target=args.target)
            else:
                result = balance(problem, args.balancer)
        text = dumps(result.as_dict())
    except NonFiniteError:
        return fail(PROG, "the costs overflow: a stage load or the imbalance is not a finite number; "
                          "rescale the costs (e.g. to milliseconds) and speeds")
    except (InputError, BalanceError) as e:
        return fail(PROG, e)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
