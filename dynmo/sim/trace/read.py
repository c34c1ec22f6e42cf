"""Reading a trace file (or a run folder, converted on the fly), every value checked."""

from __future__ import annotations

from pathlib import Path

from dynmo.sim.trace.costs import Trace
from dynmo.sim.trace.files import jsonl
from dynmo.sim.trace.format import TraceHeader, TraceStep, check_step
from dynmo.sim.trace.from_metrics import trace_from_metrics
from dynmo.sim.trace.limits import TraceError, check_size
from dynmo.sim.trace.values import show


def load_trace(path: str | Path) -> Trace:
    """Read a trace file; a run folder (with metrics.jsonl) is converted on the fly.

    Every value is checked (TraceError naming the line and field), and the file must stay within
    MAX_TRACE_BYTES, MAX_TRACE_ITEMS, MAX_STEPS, MAX_LAYERS and MAX_TRACE_CELLS (`limits`)."""
    p = Path(path)
    if p.is_dir():
        return trace_from_metrics(p)
    header: TraceHeader | None = None
    steps: list[TraceStep] = []
    fields = set(TraceStep.__dataclass_fields__)
    for lineno, doc in jsonl(p):
        where = f"{p} line {lineno}"
        if header is None:
            header = TraceHeader.from_dict(doc, where)
            continue
        if not isinstance(doc, dict):
            raise TraceError(f"{where}: a step must be a JSON object, got {show(doc)}")
        missing = {"step", "fwd", "bwd"} - set(doc)
        if missing:
            raise TraceError(f"{where}: the step lacks {sorted(missing)}")
        kw = {k: v for k, v in doc.items() if k in fields and not (k in ("events", "stats") and v is None)}
        steps.append(check_step(TraceStep(**kw), header.num_layers, where))
        check_size(len(steps), header.num_layers, where)
    if header is None:
        raise TraceError(f"{p} is empty")
    if not steps:
        raise TraceError(f"{p} has a header but no steps")
    return Trace(header, steps)
