"""`Decision`: what the `Controller` decided, and what it predicted for it (judged once measured). Pure."""

from __future__ import annotations

from dataclasses import dataclass

from dynmo.layout import Layout


@dataclass
class Decision:
    layout: Layout
    predicted_bottleneck: float  # seconds per microbatch on the slowest stage, new layout
    current_bottleneck: float  # same, current layout, under the same forecast
    predicted_gain_s: float  # over the horizon
    predicted_cost_s: float  # migration
    released: int = 0  # pipeline positions released by a re-pack (per replica)
    predicted_step_s: float = 0.0  # step time of the new layout (`step_time`), under the forecast
    current_step_s: float = 0.0  # the same, current layout
    reason: str = ""  # "rebalance", "fallback" (to a layout fixed before step 0), "repack", "grow" or "revert" (a migration that lost, undone)
    best_step_s: float = 0.0  # a re-pack: the step time of the best layout on every worker the run started with
