"""The `torch.distributed.pipelining` class of each trainable schedule (`dynmo.schedules`), and
a forward-only pass over the stages of a schedule that trains (validation)."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch.distributed.pipelining as pipelining
import torch.distributed.pipelining.schedules as torch_schedules

from dynmo.schedules import Schedule, get_schedule

# the actions of a backward pass in a runtime schedule's plan (`_PipelineScheduleRuntime`); names
# a torch release lacks are skipped
_BACKWARD = tuple(a for a in (getattr(torch_schedules, n, None) for n in (
    "FULL_BACKWARD", "BACKWARD_INPUT", "BACKWARD_WEIGHT", "SEND_B", "RECV_B", "REDUCE_GRAD")) if a is not None)


def schedule_class(schedule: Schedule | str) -> type:
    s = get_schedule(schedule) if isinstance(schedule, str) else schedule
    return getattr(pipelining, f"Schedule{s.torch_name}")


@contextmanager
def forward_only(schedule) -> Iterator[None]:
    """Within the block, a schedule that runs a plan of actions (the zero-bubble ones) runs its
    plan without the backward's actions, as its `eval` needs: torch's runtime runs every action of
    the plan in `eval` too, and where two consecutive stages share a rank (zbv's V) it hands the
    backward's local gradient over and fails ("can't steal_bwd_input if this stage doesn't have
    backward"). The forward actions keep their order, so the sends and receives between ranks
    still pair up. Other schedules are left as they are."""
    plan = getattr(schedule, "pipeline_order_with_comms", None)
    if not isinstance(plan, dict) or not _BACKWARD:
        yield
        return
    schedule.pipeline_order_with_comms = {
        rank: [a for a in actions if a is not None and a.computation_type not in _BACKWARD]
        for rank, actions in plan.items()}
    try:
        yield
    finally:
        schedule.pipeline_order_with_comms = plan
