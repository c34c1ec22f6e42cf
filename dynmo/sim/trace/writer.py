"""Writing a trace: one JSON line per step, flushed, so a crashed run still leaves a readable trace."""

from __future__ import annotations

import json
from pathlib import Path

from dynmo.record import StepRecord
from dynmo.sim.trace.format import TraceHeader, TraceStep, check_step


class TraceWriter:
    """Append one line per step to a trace file; the runtime calls it on the logging rank."""

    def __init__(self, path: str | Path, header: TraceHeader | dict):
        self.header = header if isinstance(header, TraceHeader) else TraceHeader.from_dict(header)
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "w")
        self._f.write(json.dumps(self.header.as_dict()) + "\n")
        self._f.flush()

    def write_step(self, record: StepRecord) -> None:
        """One step as the run recorded it."""
        self.write_trace_step(TraceStep.from_record(record))

    def write_trace_step(self, step: TraceStep) -> None:
        check_step(step, self.header.num_layers, f"step {step.step}")
        self._f.write(json.dumps(step.as_dict()) + "\n")
        self._f.flush()  # a crashed run still leaves a readable trace

    def close(self) -> None:
        if not self._f.closed:
            self._f.close()

    def __enter__(self) -> "TraceWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
