"""The replay flags `dynmo simulate` checks the same way with and without `--ep`. Pure."""

from __future__ import annotations

import argparse

from dynmo.jsonio import integer, number
from dynmo.sim.trace import MAX_DP, MAX_LAYERS, MAX_MICROBATCHES, MAX_NOISE, MAX_STAGES


def check_shape(args: argparse.Namespace) -> None:
    """--microbatches, --dp, --stages, --scale-blocks and --noise within their limits (InputError)."""
    if args.microbatches is not None:
        integer("--microbatches", args.microbatches, 1, MAX_MICROBATCHES, limit="MAX_MICROBATCHES")
    if args.dp is not None:
        integer("--dp", args.dp, 1, MAX_DP, limit="MAX_DP")
    if args.stages is not None:
        integer("--stages", args.stages, 1, MAX_STAGES, limit="MAX_STAGES")
    if args.scale_blocks is not None:
        integer("--scale-blocks", args.scale_blocks, 1, MAX_LAYERS - 2, limit="MAX_LAYERS - 2")
    number("--noise", args.noise, 0, MAX_NOISE)
