"""One policy's replayed run: per-step times, layouts and workers, and the totals read from them."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class PolicyResult:
    policy: str
    iteration_s: list[float] = field(default_factory=list)  # simulated schedule time per step
    bubble_ratio: list[float] = field(default_factory=list)
    bottleneck_s: list[float] = field(default_factory=list)  # max stage load (s per microbatch)
    stage_loads: list[list[float]] = field(default_factory=list)  # per step, per stage
    layouts: list[list[int]] = field(default_factory=list)  # boundaries per step
    workers: list[int] = field(default_factory=list)  # pipeline ranks x dp per step
    overhead_s: list[float] = field(default_factory=list)  # migration + decide before each step
    microbatches: list[int] = field(default_factory=list)  # per step (changes only by re-tuning)
    migrations: int = 0
    layers_moved: int = 0
    migration_s: float = 0.0
    decide_s: float = 0.0
    tokens_per_step: float | None = None
    speedup: float | None = None  # vs static uniform: its total time / this total time
    speedup_per_worker: float | None = None  # the same per worker-second (credits released workers)
    # vs the best static layout (the fastest of uniform, params, profile-once): its total time / this
    speedup_vs_best_static: float | None = None
    best_static: str | None = None  # which static policy that was

    @property
    def steps(self) -> int:
        return len(self.iteration_s)

    @property
    def total_s(self) -> float:
        return float(sum(self.iteration_s) + self.migration_s + self.decide_s)

    @property
    def worker_s(self) -> float:
        """Worker-seconds used: every step's time x the workers that step ran on."""
        return float(sum((t + o) * w for t, o, w in zip(self.iteration_s, self.overhead_s, self.workers)))

    @property
    def steps_per_s(self) -> float:
        return self.steps / self.total_s if self.total_s > 0 else 0.0

    @property
    def steps_per_worker_s(self) -> float:
        """Steps per worker-second: throughput per worker, over the run."""
        return self.steps / self.worker_s if self.worker_s > 0 else 0.0

    @property
    def tokens_per_s_per_worker(self) -> float | None:
        """Tokens per worker-second (tokens/s per worker, over the run); None without token counts."""
        return None if self.tokens_per_step is None else self.tokens_per_step * self.steps_per_worker_s

    @property
    def tokens_per_s(self) -> float | None:
        return None if self.tokens_per_step is None else self.tokens_per_step * self.steps_per_s

    @property
    def mean_bubble(self) -> float:
        return float(np.mean(self.bubble_ratio)) if self.bubble_ratio else 0.0

    @property
    def workers_mean(self) -> float:
        return float(np.mean(self.workers)) if self.workers else 0.0

    @property
    def workers_final(self) -> int:
        return self.workers[-1] if self.workers else 0

    def as_dict(self, per_step: bool = True) -> dict:
        d = {
            "policy": self.policy, "steps": self.steps, "total_s": self.total_s, "steps_per_s": self.steps_per_s,
            "tokens_per_s": self.tokens_per_s, "speedup": self.speedup, "speedup_per_worker": self.speedup_per_worker,
            "speedup_vs_best_static": self.speedup_vs_best_static, "best_static": self.best_static,
            "worker_s": self.worker_s, "tokens_per_s_per_worker": self.tokens_per_s_per_worker,
            "steps_per_worker_s": self.steps_per_worker_s, "mean_bubble": self.mean_bubble,
            "workers_mean": self.workers_mean, "workers_final": self.workers_final,
            "migrations": self.migrations, "layers_moved": self.layers_moved, "migration_s": self.migration_s,
            "decide_s": self.decide_s, "mean_bottleneck_s": float(np.mean(self.bottleneck_s)) if self.bottleneck_s else 0.0,
        }
        if per_step:
            d |= {"iteration_s": self.iteration_s, "bubble_ratio": self.bubble_ratio, "bottleneck_s": self.bottleneck_s,
                  "stage_loads": self.stage_loads, "layouts": self.layouts, "workers": self.workers,
                  "overhead_s": self.overhead_s, "microbatches": self.microbatches}
        return d
