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

import importlib

# Names resolve on first use (PEP 562), so importing the engine (`dynmo.sim.engine`, which the
# controller scores layouts with, one layer below the rest of this package) does not import the
# traces and the replay, which themselves import the controller.
_WHERE = {
    **dict.fromkeys(("SimInputError", "SimResult", "StageTimes", "bubble_ratio", "lower_bound", "predict_iteration_time",
                     "ring_allgather_time", "ring_allreduce_time", "simulate", "simulate_plan"),
                    "dynmo.sim.engine"),
    **dict.fromkeys(("SCHEDULES", "Op", "Plan", "ScheduleError", "build_plan"), "dynmo.sim.schedules"),
    "stage_times": "dynmo.sim.stages",
    **dict.fromkeys(("Trace", "TraceError", "TraceHeader", "TraceStep", "TraceWriter", "load_trace", "merge_units",
                     "scale_trace", "trace_from_metrics"), "dynmo.sim.trace"),
}
__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'dynmo.sim' has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE[name]), name)
    globals()[name] = value
    return value
