"""Injection for the tests: kill this process at a named point of a run, or record given per-layer costs.

    DYNMO_FAULT="kill:POINT:STEP:RANK"   e.g. kill:step:5:1, kill:migration:4:0, kill:checkpoint:6:0

POINT is `step` (before training step STEP), `migration` (inside a migration before step
STEP, after this rank shipped its first layer) or `checkpoint` (saving the checkpoint of step
STEP, after the shards and before the completion marker). The process sends itself SIGKILL:
no handler, no clean-up, as a machine failure would. Only the first attempt of a job is hit
(torchrun's TORCHELASTIC_RESTART_COUNT = 0), so an automatic restart runs clean. Unset, every
call is a dictionary lookup.

    DYNMO_COSTS="STEP:MS,MS,...[;STEP:MS,...]"   e.g. 0:1,4,4,4,4,3;3:1,14,4,4,4,3

A test that asserts what the controller decides must not depend on how fast or busy the
machine running it is. From step STEP on (until the next segment) every rank records these
per-layer costs, in milliseconds per microbatch, in place of the measured ones: the
controller's `layer_cost_s`, and a third of each as the layer's forward and two thirds as its
backward (a measured weight-gradient part is scaled with the backward). The metrics, the trace
and the DynMo loop all see them, so a replay of the trace decides on them too. Step times
stay measured, and so does everything steps before the first segment record. The model and
its compute are untouched. With `[noise]` on, the recorded costs carry the noise's own seeded
draws (`dynmo.dynamics.noise.recorded_costs`), so a test of the controller under noise
decides the same on any machine while the run still does the noise's real work.
"""

from __future__ import annotations

import os
import signal
from dataclasses import replace
from functools import lru_cache
from typing import Callable

from dynmo.record import StepRecord

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


@lru_cache(maxsize=4)
def _cost_segments(spec: str) -> tuple[tuple[int, tuple[float, ...]], ...]:
    try:
        segments = []
        for part in spec.split(";"):
            step, costs = part.split(":")
            segments.append((int(step), tuple(float(c) / 1e3 for c in costs.split(","))))
        if any(c <= 0 for _, cs in segments for c in cs) or [s for s, _ in segments] != sorted({s for s, _ in segments}):
            raise ValueError
        return tuple(segments)
    except ValueError:
        raise ValueError(f"DYNMO_COSTS={spec!r}: use STEP:MS,MS,...[;STEP:MS,...] with increasing steps "
                         "and positive milliseconds per layer") from None


def injected_costs(rec: StepRecord, perturb: Callable[[int, list[float]], list[float]] | None = None) -> StepRecord:
    """`rec` with the per-layer costs DYNMO_COSTS gives for its step (see above), or `rec` itself;
    `perturb(step, costs)`, if given, turns them into what the profiler records (the noise)."""
    spec = os.environ.get("DYNMO_COSTS", "")
    if not spec:
        return rec
    current = [c for s, c in _cost_segments(spec) if s <= rec.step]
    if not current:
        return rec
    costs = list(current[-1])
    if len(costs) != len(rec.layer_cost_s):
        raise ValueError(f"DYNMO_COSTS gives {len(costs)} layer costs; the model has {len(rec.layer_cost_s)} layers")
    if perturb is not None:
        costs = perturb(rec.step, costs)
    bwd = [2 * c / 3 for c in costs]
    wgrad = None
    if rec.layer_wgrad_s:
        wgrad = [w * b / old if old > 0 else 0.0 for w, b, old in zip(rec.layer_wgrad_s, bwd, rec.layer_bwd_s)]
    return replace(rec, layer_cost_s=costs, layer_fwd_s=[c / 3 for c in costs], layer_bwd_s=bwd, layer_wgrad_s=wgrad)
