"""Per-layer cost traces: what a real run measured, step by step, for the simulator to replay.

Pure (stdlib + numpy; no torch). Format (JSON Lines, documented in docs/simulator.md):

    line 1   header: {"format": "dynmo-trace", "version": 1, "layers": [...], "kinds": [...],
                      "params": [...], "layer_bytes": [...], "microbatches", "pp", "dp",
                      "virtual_stages", "schedule", "tokens_per_microbatch", "case",
                      "config", "source", ("boundary_bytes": [...])}
    line 2+  one step: {"step", "fwd": [...], "bwd": [...], ("wgrad": [...]), "layout",
                        "iteration_s", "step_s", "events": [...], ("stats": {...})}

`fwd`/`bwd` are seconds per microbatch per layer (as `layer_fwd_s`/`layer_bwd_s` in
metrics.jsonl; `bwd` is the full backward, weight gradient included).
`boundary_bytes` (optional) is one microbatch's bytes crossing each cut between layers: the
replay charges a cut its link time x its bytes over the smallest cut's.

    w = TraceWriter("run.trace.jsonl", TraceHeader.from_config(cfg.to_dict(), params, pp, dp))
    w.write_step(record)      # the run's StepRecord (dynmo.record), every step
    w.close()
    t = load_trace("run.trace.jsonl")           # or trace_from_metrics("runs/skewed")
    big = scale_trace(t, blocks=48)             # paper-sized: 48 blocks, same dynamics

A run with `parallel.unit = "sublayer"` traces each block as two units, its attention half (kind
"a") and its MLP half ("m"): kinds E, a, m, a, m, ..., L. `scale_trace` keeps that structure, and
`merge_units(t)` sums each block's halves into the trace of the same run placed by whole blocks.
"""

from dynmo.loop import BYTES_PER_PARAM
from dynmo.sim.trace.costs import Trace
from dynmo.sim.trace.format import FORMAT, VERSION, TraceHeader, TraceStep, case_name, config_summary
from dynmo.sim.trace.from_metrics import trace_from_metrics
from dynmo.sim.trace.kinds import BLOCK, SUBLAYER, UNITS, unit_of
from dynmo.sim.trace.limits import (
    MAX_COUNT, MAX_DP, MAX_LAYERS, MAX_MICROBATCHES, MAX_NOISE, MAX_STAGES, MAX_STEPS, MAX_TRACE_BYTES,
    MAX_TRACE_CELLS, MAX_TRACE_ITEMS, TraceError, check_size,
)
from dynmo.sim.trace.read import load_trace
from dynmo.sim.trace.scale import block_map, scale_trace
from dynmo.sim.trace.units import merge_units
from dynmo.sim.trace.writer import TraceWriter

__all__ = [
    "BLOCK", "BYTES_PER_PARAM", "FORMAT", "VERSION", "MAX_COUNT", "MAX_DP", "MAX_LAYERS", "MAX_MICROBATCHES",
    "MAX_NOISE", "MAX_STAGES", "MAX_STEPS", "MAX_TRACE_BYTES", "MAX_TRACE_CELLS", "MAX_TRACE_ITEMS", "SUBLAYER", "Trace",
    "TraceError", "TraceHeader", "TraceStep", "TraceWriter", "UNITS", "block_map", "case_name", "check_size",
    "config_summary", "load_trace", "merge_units", "scale_trace", "trace_from_metrics", "unit_of",
]
