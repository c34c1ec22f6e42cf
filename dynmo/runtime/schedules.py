"""The `torch.distributed.pipelining` class of each trainable schedule (`dynmo.schedules`)."""

from __future__ import annotations

import torch.distributed.pipelining as pipelining

from dynmo.schedules import Schedule, get_schedule


def schedule_class(schedule: Schedule | str) -> type:
    s = get_schedule(schedule) if isinstance(schedule, str) else schedule
    return getattr(pipelining, f"Schedule{s.torch_name}")
