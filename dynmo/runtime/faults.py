"""Fault injection for the failure tests: kill this process at a named point of a run.

    DYNMO_FAULT="kill:POINT:STEP:RANK"   e.g. kill:step:5:1, kill:migration:4:0, kill:checkpoint:6:0

POINT is `step` (before training step STEP), `migration` (inside a migration before step
STEP, after this rank shipped its first layer) or `checkpoint` (saving the checkpoint of step
STEP, after the shards and before the completion marker). The process sends itself SIGKILL:
no handler, no clean-up, as a machine failure would. Only the first attempt of a job is hit
(torchrun's TORCHELASTIC_RESTART_COUNT = 0), so an automatic restart runs clean. Unset, every
call is a dictionary lookup.
"""

from __future__ import annotations

import os
import signal

POINTS = ("step", "migration", "checkpoint")
_step = -1  # the training step the run is at (set by the trainer)


def at_step(step: int) -> None:
    global _step
    _step = step


def current_step() -> int:
    """The step the trainer last reported (-1 before the first): error messages name it."""
    return _step


def _parse(spec: str) -> tuple[str, int, int] | None:
    if not spec:
        return None
    try:
        kind, point, step, rank = spec.split(":")
        if kind != "kill" or point not in POINTS:
            raise ValueError
        return point, int(step), int(rank)
    except ValueError:
        raise ValueError(f"DYNMO_FAULT={spec!r}: use kill:POINT:STEP:RANK with POINT one of {', '.join(POINTS)}") from None


def point(name: str, step: int | None = None) -> None:
    """Die here if DYNMO_FAULT names this point, step (default: the current one) and rank
    (first attempt only)."""
    step = _step if step is None else step
    target = _parse(os.environ.get("DYNMO_FAULT", ""))
    if target is None or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return
    if target == (name, step, int(os.environ.get("RANK", "0"))):
        os.kill(os.getpid(), signal.SIGKILL)
