"""A loaded trace: the header and its steps, read as per-layer cost arrays for the simulator."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dynmo.sim.trace.format import TraceHeader, TraceStep
from dynmo.sim.trace.writer import TraceWriter


@dataclass
class Trace:
    header: TraceHeader
    steps: list[TraceStep]

    @property
    def num_layers(self) -> int:
        return self.header.num_layers

    def _per_mb(self, name: str) -> np.ndarray:
        a = np.asarray([getattr(s, name) for s in self.steps], dtype=float).reshape(len(self.steps), self.num_layers)
        # a step run with m_k microbatches (re-tuned) has microbatches of m / m_k times the size
        scale = [(s.microbatches or self.header.microbatches) / self.header.microbatches for s in self.steps]
        return a * np.asarray(scale)[:, None]

    def fwd(self) -> np.ndarray:
        """Seconds per microbatch of the header's size (`microbatches` per step), shape (steps, layers).

        Steps the run took with another microbatch count are rescaled to the header's
        microbatch size, assuming time proportional to the microbatch size."""
        return self._per_mb("fwd")

    def bwd(self) -> np.ndarray:
        return self._per_mb("bwd")

    def wgrad(self) -> np.ndarray | None:
        """Like fwd(), or None unless every step measured the weight-gradient part."""
        return self._per_mb("wgrad") if all(s.wgrad is not None for s in self.steps) else None

    def controller_costs(self) -> np.ndarray:
        """What the runtime's controller observed per step: `cost` (the median microbatch's
        forward + backward) where recorded, else the mean (`fwd + bwd`)."""
        if all(s.cost is not None for s in self.steps):
            return self._per_mb("cost")
        return self.costs()

    def costs(self) -> np.ndarray:
        """c_i(k): forward + backward seconds per microbatch of layer i at step k."""
        return self.fwd() + self.bwd()

    def dynamism_steps(self) -> list[int]:
        return [k for k, s in enumerate(self.steps) if s.dynamism]

    def write(self, path: str | Path) -> None:
        with TraceWriter(path, self.header) as w:
            for s in self.steps:
                w.write_trace_step(s)
