"""Pure pipeline simulator (no torch): torch's schedules' op order and an event-driven engine.

    from dynmo.sim import simulate, predict_iteration_time
    simulate([0.01, 0.012], [0.02, 0.03], "1F1B", microbatches=8).bubble_ratio

See docs/simulator.md for the model, its assumptions and the JSON formats.
"""

from dynmo.sim.engine import (
    SimInputError,
    SimResult,
    StageTimes,
    bubble_ratio,
    lower_bound,
    predict_iteration_time,
    ring_allreduce_time,
    simulate,
    simulate_plan,
)
from dynmo.sim.schedules import SCHEDULES, Op, Plan, ScheduleError, build_plan
from dynmo.sim.stages import stage_times

__all__ = [
    "SCHEDULES", "Op", "Plan", "ScheduleError", "SimInputError", "SimResult", "StageTimes",
    "build_plan", "bubble_ratio", "lower_bound", "predict_iteration_time",
    "ring_allreduce_time", "simulate", "simulate_plan", "stage_times",
]
