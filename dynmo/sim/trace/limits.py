"""What a trace (or a run folder's metrics.jsonl) and the simulator may ask for, and the error
for a trace that is over a limit or cannot be read.

docs/bench/simulator-limits.md gives the memory of the worst allowed inputs. Readers
use these as `limits.MAX_...` at call time, so a test can lower one with monkeypatch.
"""

from __future__ import annotations

MAX_TRACE_BYTES = 64 * 2**20  # file size
# strings, lists and objects in the file (counted from the text before parsing, as `"` / 2 plus
# `[` and `{`): each costs ~60-100 bytes once parsed, so these bound the parsed size
MAX_TRACE_ITEMS = 4_000_000
MAX_STEPS = 100_000
MAX_LAYERS = 100_000
MAX_TRACE_CELLS = 4_000_000  # steps x layers, also after scaling
MAX_STAGES = 4_096  # pipeline stages (pp x virtual stages)
MAX_MICROBATCHES = 100_000  # per step
MAX_DP = 1_000_000  # data-parallel replicas
MAX_NOISE = 5.0  # scale_trace's lognormal sigma (exp(5) spreads the costs 150x already)
MAX_COUNT = 2**53  # parameters, bytes, tokens: exact in a float64


class TraceError(ValueError):
    """A trace file or run folder that cannot be read; the message says what is wrong."""


def check_size(steps: int, layers: int, where: str = "trace") -> None:
    """TraceError when a trace of this shape is over MAX_STEPS, MAX_LAYERS or MAX_TRACE_CELLS."""
    if steps > MAX_STEPS:
        raise TraceError(f"{where}: more than MAX_STEPS = {MAX_STEPS} steps; replay a slice of the run")
    if layers > MAX_LAYERS:
        raise TraceError(f"{where}: {layers} layers is over the limit MAX_LAYERS = {MAX_LAYERS}")
    if steps * layers > MAX_TRACE_CELLS:
        raise TraceError(f"{where}: {steps} steps x {layers} layers is over the limit MAX_TRACE_CELLS = "
                         f"{MAX_TRACE_CELLS}; replay fewer steps or fewer layers")
