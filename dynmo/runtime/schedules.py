"""Which torch.distributed.pipelining schedule runs, and which rank holds which stage."""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.pipelining import (
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)


@dataclass(frozen=True)
class ScheduleKind:
    name: str
    cls: type
    multi: bool  # takes a list of stages (virtual stages per rank)
    style: str  # stage -> rank placement: "loop" (s % pp) or "v"
    split_backward: bool  # runs input and weight gradients separately (zero bubble)


SCHEDULES: dict[str, ScheduleKind] = {
    k.name: k
    for k in (
        ScheduleKind("gpipe", ScheduleGPipe, False, "loop", False),
        ScheduleKind("1f1b", Schedule1F1B, False, "loop", False),
        ScheduleKind("interleaved1f1b", ScheduleInterleaved1F1B, True, "loop", False),
        ScheduleKind("interleavedzb", ScheduleInterleavedZeroBubble, True, "loop", True),
        ScheduleKind("zbv", ScheduleZBVZeroBubble, True, "v", True),
    )
}


def schedule_kind(name: str) -> ScheduleKind:
    try:
        return SCHEDULES[name.lower()]
    except KeyError:
        raise ValueError(f"unknown schedule {name!r}; choose one of {', '.join(SCHEDULES)}") from None


def stage_to_rank(num_stages: int, pp: int, style: str) -> list[int]:
    """Pipeline rank of every stage, as torch's multi-stage schedules place them."""
    if style == "loop":
        return [s % pp for s in range(num_stages)]
    # V: 0..pp-1 go down the ranks, pp..2pp-1 come back up (ZBV's placement)
    out = []
    for s in range(num_stages):
        lap, pos = divmod(s, pp)
        out.append(pos if lap % 2 == 0 else pp - 1 - pos)
    return out
