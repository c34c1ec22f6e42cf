"""The pipeline schedules dynmo knows, in one table. Pure (no torch).

The config checks read it to validate `parallel.schedule`, the runtime to pick the class from
`torch.distributed.pipelining` and place stages on ranks, the simulator to name its op orders.
A schedule is named by its config name (`1f1b`), its torch name (`1F1B`, the class
`Schedule1F1B`) or an alias, in any case.
"""

from __future__ import annotations

from dataclasses import dataclass


class ScheduleError(ValueError):
    """A schedule that does not exist, or cannot run with the given ranks, stages and microbatches."""


@dataclass(frozen=True)
class Schedule:
    name: str  # parallel.schedule
    torch_name: str  # torch.distributed.pipelining.Schedule<torch_name>; the simulator's plan name
    multi_stage: bool  # several stages per rank (parallel.virtual_stages)
    placement: str  # stage -> rank: "loop" (stage s on rank s % pp) or "v" (down the ranks, then back up)
    split_backward: bool  # input and weight gradients in separate passes (zero bubble)
    trainable: bool = True  # `dynmo train` runs it (LoopedBFS: the simulator only)

    @property
    def default_stages_per_rank(self) -> int:
        return 2 if self.multi_stage else 1

    @property
    def fixed_stages_per_rank(self) -> int | None:
        """The only stages-per-rank count the schedule runs with, if it has one."""
        if not self.multi_stage:
            return 1
        return 2 if self.placement == "v" else None


SCHEDULES: tuple[Schedule, ...] = (
    Schedule("gpipe", "GPipe", False, "loop", False),
    Schedule("1f1b", "1F1B", False, "loop", False),
    Schedule("interleaved1f1b", "Interleaved1F1B", True, "loop", False),
    Schedule("loopedbfs", "LoopedBFS", True, "loop", False, trainable=False),
    Schedule("interleavedzb", "InterleavedZeroBubble", True, "loop", True),
    Schedule("zbv", "ZBVZeroBubble", True, "v", True),
)
TRAINABLE = tuple(s.name for s in SCHEDULES if s.trainable)
_ALIASES = {"zb": "interleavedzb", "interleaved": "interleaved1f1b"}


def _key(name: str) -> str:
    return name.lower().replace("-", "").replace("_", "")


_BY_KEY = {k: s for s in SCHEDULES for k in (_key(s.name), _key(s.torch_name))} | {
    a: next(s for s in SCHEDULES if s.name == n) for a, n in _ALIASES.items()
}


def get_schedule(name: str) -> Schedule:
    try:
        return _BY_KEY[_key(name)]
    except KeyError:
        raise ScheduleError(f"unknown schedule {name!r}; choose one of {', '.join(s.name for s in SCHEDULES)}") from None


def stage_to_rank(num_stages: int, pp: int, placement: str) -> list[int]:
    """Pipeline rank of every stage, as torch's multi-stage schedules place them."""
    if placement == "loop":
        return [s % pp for s in range(num_stages)]
    # V: 0..pp-1 go down the ranks, pp..2pp-1 come back up (ZBV's placement)
    out = []
    for s in range(num_stages):
        lap, pos = divmod(s, pp)
        out.append(pos if lap % 2 == 0 else pp - 1 - pos)
    return out


def in_flight(schedule: str, microbatches: int, num_stages: int, stage: int) -> int:
    """Microbatches whose activations stage `stage` holds at its peak (an estimate): GPipe
    keeps all of them; 1F1B-style schedules keep one per stage still ahead of it (stage s of S
    warms up with S - s forwards), at most the microbatch count."""
    if get_schedule(schedule).name == "gpipe":
        return microbatches
    return min(microbatches, num_stages - stage)


def held_microbatches(schedule: str, microbatches: int, num_stages: int) -> int:
    """The most microbatches any stage holds (`in_flight`): the balancer's one figure for every
    layer's activations, which a layer keeps wherever it goes."""
    return max(in_flight(schedule, microbatches, num_stages, j) for j in range(num_stages))
