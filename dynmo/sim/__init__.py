"""Pure pipeline simulator (no torch): torch's schedules' op order and an event-driven engine.

    from dynmo.sim import simulate, predict_iteration_time
    simulate([0.01, 0.012], [0.02, 0.03], "1F1B", microbatches=8).bubble_ratio

    from dynmo.sim import load_trace, scale_trace
    from dynmo.sim.replay import replay
    replay(scale_trace(load_trace("runs/skewed"), 48), stages=24, dp=30)   # -> [PolicyResult]
    # static (uniform, params, profile-once), dynamic and oracle policies; each result carries its
    # speedup over uniform and over the best static layout, worker-seconds and per-worker throughput;
    # replay_link_delays(...) runs the injected link-delay experiment

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
from dynmo.sim.trace import Trace, TraceError, TraceHeader, TraceStep, TraceWriter, load_trace, scale_trace, trace_from_metrics

__all__ = [
    "SCHEDULES", "Op", "Plan", "ScheduleError", "SimInputError", "SimResult", "StageTimes",
    "build_plan", "bubble_ratio", "lower_bound", "predict_iteration_time",
    "ring_allreduce_time", "simulate", "simulate_plan", "stage_times",
    "Trace", "TraceError", "TraceHeader", "TraceStep", "TraceWriter", "load_trace", "scale_trace", "trace_from_metrics",
]
