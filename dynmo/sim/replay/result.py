"""One policy's replayed run: per-step times, layouts and workers, and the totals read from them."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

CAPTURE_MIN_GAIN = 0.005  # an oracle gaining less over the best static layout leaves its capture blank


def capture(vs_best: float | None, oracle_vs_best: float | None) -> float | None:
    """The share of an oracle's gain over the best static layout that a policy captures, in
    throughput: (policy's - best static's) / (oracle's - best static's) steps/s, which is
    (speedup_vs_best_static - 1) / (the oracle's speedup_vs_best_static - 1). 1: all of it, 0:
    none (the best static layout's throughput), < 0: slower than the best static layout. None
    without both ratios, or where the oracle gains less than CAPTURE_MIN_GAIN (0.5 %): a share of
    almost nothing is noise."""
    if vs_best is None or oracle_vs_best is None or not oracle_vs_best - 1 >= CAPTURE_MIN_GAIN:
        return None
    return (vs_best - 1) / (oracle_vs_best - 1)


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
    migrations: int = 0  # layer moves and restarts
    restarts: int = 0  # of them, checkpoint restarts that took released workers back
    layers_moved: int = 0
    migration_s: float = 0.0
    decide_s: float = 0.0
    tokens_per_step: float | None = None
    speedup: float | None = None  # vs static uniform: its total time / this total time
    speedup_per_worker: float | None = None  # the same per worker-second (credits released workers)
    # vs the best static layout (the fastest of uniform, params, profile-once): its total time / this
    speedup_vs_best_static: float | None = None
    best_static: str | None = None  # which static policy that was
    # the same two over the last half of the steps only (steps // 2 onwards, what is charged before
    # them included): against static uniform's and the static layout best over those steps
    speedup_second_half: float | None = None
    speedup_vs_best_static_second_half: float | None = None
    best_static_second_half: str | None = None
    # dynamic policies: the share of the per-step oracle's / oracle-window's gain over the best
    # static layout this policy captures (`capture`); None for the others
    capture_oracle: float | None = None
    capture_oracle_window: float | None = None

    @property
    def steps(self) -> int:
        return len(self.iteration_s)

    @property
    def total_s(self) -> float:
        return float(sum(self.iteration_s) + self.migration_s + self.decide_s)

    @property
    def second_half_s(self) -> float:
        """Seconds of the last half of the steps (from steps // 2 on): their simulated iterations and
        what was charged before them (migrations, decisions)."""
        h = self.steps // 2
        return float(sum(self.iteration_s[h:]) + sum(self.overhead_s[h:]))

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
            "speedup_second_half": self.speedup_second_half,
            "speedup_vs_best_static_second_half": self.speedup_vs_best_static_second_half,
            "best_static_second_half": self.best_static_second_half,
            "capture_oracle": self.capture_oracle, "capture_oracle_window": self.capture_oracle_window,
            "worker_s": self.worker_s, "tokens_per_s_per_worker": self.tokens_per_s_per_worker,
            "steps_per_worker_s": self.steps_per_worker_s, "mean_bubble": self.mean_bubble,
            "workers_mean": self.workers_mean, "workers_final": self.workers_final,
            "migrations": self.migrations, "restarts": self.restarts, "layers_moved": self.layers_moved, "migration_s": self.migration_s,
            "decide_s": self.decide_s, "mean_bottleneck_s": float(np.mean(self.bottleneck_s)) if self.bottleneck_s else 0.0,
        }
        if per_step:
            d |= {"iteration_s": self.iteration_s, "bubble_ratio": self.bubble_ratio, "bottleneck_s": self.bottleneck_s,
                  "stage_loads": self.stage_loads, "layouts": self.layouts, "workers": self.workers,
                  "overhead_s": self.overhead_s, "microbatches": self.microbatches}
        return d
