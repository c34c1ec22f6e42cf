"""The pure step-time engine (numpy, no torch): one training iteration of a pipeline schedule
from per-stage op times.

It sits below both of its users: the controller scores layouts with it
(`dynmo.controller.steptime`, through the batched form) and the simulator (`dynmo.sim`: traces,
replay, the CLI) runs it. `dynmo.sim` re-exports these names.

    schedules   each rank's compute op order of torch's schedules (Plan, build_plan)
    inputs      per-stage op times and their checks (StageTimes), ring all-reduce/all-gather times
    events      event-driven execution, bubble split, DP all-reduce (simulate, predict_iteration_time)
    batched     the same iteration times for many sets of stage times in one pass (Wavefronts)
    stages      per-layer times + Layout -> per-stage times (stage_times)

See docs/simulator.md for the model and its assumptions.
"""

from dynmo.engine.batched import Wavefronts
from dynmo.engine.events import (
    ALLREDUCE_MODES,
    P2P_MODES,
    SimResult,
    bubble_ratio,
    execute,
    lower_bound,
    predict_iteration_time,
    simulate,
    simulate_plan,
)
from dynmo.engine.inputs import SimInputError, StageTimes, ring_allgather_time, ring_allreduce_time
from dynmo.engine.schedules import (
    SCHEDULES,
    Op,
    Plan,
    ScheduleError,
    build_plan,
    canonical_name,
    default_stages_per_rank,
)
from dynmo.engine.stages import stage_times

__all__ = [
    "ALLREDUCE_MODES", "P2P_MODES", "SCHEDULES", "Op", "Plan", "ScheduleError", "SimInputError", "SimResult",
    "StageTimes", "Wavefronts", "bubble_ratio", "build_plan", "canonical_name", "default_stages_per_rank", "execute",
    "lower_bound", "predict_iteration_time", "ring_allgather_time", "ring_allreduce_time", "simulate",
    "simulate_plan", "stage_times",
]
