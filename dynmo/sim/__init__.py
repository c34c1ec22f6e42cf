"""Pure pipeline simulator (no torch): torch's schedules' op order and an event-driven engine.

    from dynmo.sim import simulate, predict_iteration_time
    simulate([0.01, 0.012], [0.02, 0.03], "1F1B", microbatches=8).bubble_ratio

    from dynmo.sim import load_trace, scale_trace
    from dynmo.sim.replay import replay
    replay(scale_trace(load_trace("runs/skewed"), 48), stages=24, dp=30)   # -> [PolicyResult]
    # static (uniform, params, profile-once), dynamic and oracle policies; each result carries its
    # speedup over uniform and over the best static layout, worker-seconds and per-worker throughput;
    # replay_link_delays(...) runs the injected link-delay experiment

The engine itself is `dynmo.engine`, one layer below the controller that scores layouts with it;
its names are re-exported here. See docs/simulator.md for the model, its assumptions and the
JSON formats.
"""

from dynmo.engine import (
    SCHEDULES,
    Op,
    Plan,
    ScheduleError,
    SimInputError,
    SimResult,
    StageTimes,
    bubble_ratio,
    build_plan,
    lower_bound,
    predict_iteration_time,
    ring_allgather_time,
    ring_allreduce_time,
    simulate,
    simulate_plan,
    stage_times,
)
from dynmo.sim.trace import (
    Trace,
    TraceError,
    TraceHeader,
    TraceStep,
    TraceWriter,
    load_trace,
    merge_units,
    scale_trace,
    trace_from_metrics,
)

__all__ = [
    "Op", "Plan", "SCHEDULES", "ScheduleError", "SimInputError", "SimResult", "StageTimes", "Trace", "TraceError",
    "TraceHeader", "TraceStep", "TraceWriter", "bubble_ratio", "build_plan", "load_trace", "lower_bound",
    "merge_units", "predict_iteration_time", "ring_allgather_time", "ring_allreduce_time", "scale_trace",
    "simulate", "simulate_plan", "stage_times", "trace_from_metrics",
]
