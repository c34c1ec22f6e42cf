"""One training step as the run measured it: `StepRecord`. Pure (stdlib only).

The runtime builds one per step (every rank's figures merged), and three readers take it:
the DynMo loop (`dynmo.loop`: what to balance), the metrics log (`metrics.jsonl`, one
`to_json()` per line, fields in docs/metrics.md) and the trace writer (`dynmo.sim.trace`).
Per-stage lists are indexed by stage of `layout`, per-layer lists by global layer index,
per-worker lists by pipeline position. Times are seconds, memory bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any


@dataclass
class StepRecord:
    step: int
    loss: float = 0.0  # mean microbatch loss over all replicas
    tokens_per_s: float = 0.0
    step_s: float = 0.0  # wall time of the whole step, slowest rank
    iteration_s: float = 0.0  # wall time inside the schedule (forward + backward), slowest rank
    layout: list[int] = field(default_factory=list)  # boundaries of the layout the step ran on
    layout_str: str = ""  # the same, printed: E t t | t t L
    stage_compute_s: list[float] = field(default_factory=list)  # per stage, replicas averaged
    stage_idle_s: list[float] = field(default_factory=list)
    worker_compute_s: list[float] = field(default_factory=list)  # per pipeline position
    worker_idle_s: list[float] = field(default_factory=list)
    bubble_ratio: float = 0.0
    workers: int = 0  # active ranks
    microbatches: int = 0  # per replica
    imbalance: float = 0.0  # of stage_compute_s
    layer_fwd_s: list[float] = field(default_factory=list)  # per microbatch, mean over the step's microbatches
    layer_bwd_s: list[float] = field(default_factory=list)
    layer_cost_s: list[float] = field(default_factory=list)  # forward + backward of the median microbatch
    layer_act_bytes: list[float] = field(default_factory=list)  # activations kept for backward, per microbatch
    layer_state_bytes: list[float] = field(default_factory=list)  # weights + grads + optimizer state
    layer_params: list[int] = field(default_factory=list)  # parameters per layer as the model stands
    stage_memory_bytes: list[float] = field(default_factory=list)  # state + activations in flight
    profile_s: float = 0.0  # host seconds in the profiler's bookkeeping, slowest rank
    grad_norm: float = 0.0
    lr: float = 0.0
    events: list[dict] = field(default_factory=list)  # migrations, dynamism, decisions
    stats: dict[str, list] = field(default_factory=dict)  # per-layer case statistics, e.g. prune_density
    val_loss: float | None = None
    worker_peak_memory_bytes: list[float] | None = None  # measured per pipeline rank (dynmo.runtime.memory)
    layer_wgrad_s: list[float] | None = None  # weight-gradient part of layer_bwd_s, where measured

    @property
    def dynamism(self) -> bool:
        """The model's work changed at this step (a pruning step, a block frozen, ...)."""
        return any(e.get("type") == "dynamism" for e in self.events)

    @property
    def migrations(self) -> list[dict]:
        return [e for e in self.events if e.get("type") == "migration"]

    def to_json(self) -> dict[str, Any]:
        """One line of metrics.jsonl: the case statistics as top-level keys, then the fields;
        optional fields only when measured."""
        out: dict[str, Any] = dict(self.stats)
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name == "stats" or (v is None and f.name in _OPTIONAL):
                continue
            out[f.name] = v
        return out

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "StepRecord":
        """A metrics.jsonl line; keys that are not fields are case statistics."""
        known = {k: v for k, v in d.items() if k in FIELDS and k != "stats"}
        return cls(**known, stats={k: v for k, v in d.items() if k not in FIELDS})


FIELDS = frozenset(f.name for f in fields(StepRecord))
_OPTIONAL = frozenset({"val_loss", "worker_peak_memory_bytes", "layer_wgrad_s"})
